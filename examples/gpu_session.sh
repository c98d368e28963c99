#!/usr/bin/env bash
# One lent-GPU session's checks in one command (docs/gpu.md): the engine's suite on the GPU, then same-run
# benchmarks on a random-weight model of SmolLM2-135M's shape.
#
# Usage: examples/gpu_session.sh WHEELS_DIR CONFIG_DIR OUT_DIR [tests|bench|confirm|owed|all]
#   WHEELS_DIR: wheels to install over the machine's packages (transformers in pyproject's range);
#   CONFIG_DIR: config.json and tokenizer files of the model whose shape is benchmarked;
#   OUT_DIR:    logs: tests.log, bench.log (every benchmark, one after another), profile.txt (a lent machine
#               returns at most 8 files: one per benchmark would be too many).
# confirm: the tests, then the default settings once at 512 prompts and float32 outputs against static generate.
# owed: the engine files not yet run on a GPU (and the bfloat16 and async files), the confirm benchmarks, a sampled
#       and a synchronous 512-prompt run, then the profile.
# triton: the sleep, graph and async files (the sleep tests first), the Triton kernel's and varlen graphs' files,
#       then the parity, graph, async and bfloat16 files with the kernel on (CONTBATCH_ATTENTION_KERNEL=triton),
#       then 512-prompt runs with the kernel off, on, off, a float32 run with it on, and top-p without top-k.
set -uo pipefail
WHEELS=$1 CONFIG=$2 OUT=$3 WHAT=${4:-all}
# The parity, graph, async and API suites first; the C++ kernels', compile, fused-module, head-screen and
# structured-output files assert CPU specifics or need the embedded model. GPU_TEST_FILES (space-separated) runs
# others instead: GPU_TEST_FILES=rest, the engine files no GPU session has run yet.
TEST_FILES=(tests/engine/test_parity.py tests/engine/test_cuda_graphs.py tests/engine/test_async_batching.py
  tests/test_api.py tests/test_manager.py tests/engine/test_bfloat16.py tests/engine/test_sliding_window.py
  tests/engine/test_generate_semantics.py tests/engine/test_n_samples.py tests/engine/test_prefix_cache.py)
REST=(tests/engine/test_attached_model.py tests/engine/test_attention_groups.py tests/engine/test_bad_input.py
  tests/engine/test_beam_search.py tests/engine/test_fork.py tests/engine/test_logits_processors.py
  tests/engine/test_logprobs_mode.py tests/engine/test_ops.py tests/engine/test_prompt_logprobs.py
  tests/engine/test_sampler.py tests/engine/test_scheduler.py tests/engine/test_score_requests.py
  tests/engine/test_sleep.py tests/engine/test_step_outputs.py tests/engine/test_touch_limit.py
  tests/engine/test_weights.py tests/engine/test_block_pool.py)
TRITON_FILES=(tests/engine/test_sleep.py tests/engine/test_cuda_graphs.py tests/engine/test_async_batching.py
  tests/engine/test_handoff.py tests/engine/test_triton_attention.py tests/engine/test_varlen_graphs.py)
KERNEL_ON_FILES=(tests/engine/test_parity.py tests/engine/test_cuda_graphs.py tests/engine/test_async_batching.py
  tests/engine/test_bfloat16.py tests/engine/test_sliding_window.py)
[[ $WHAT == owed ]] && GPU_TEST_FILES=${GPU_TEST_FILES:-owed}
[[ $WHAT == triton ]] && TEST_FILES=("${TRITON_FILES[@]}")
case ${GPU_TEST_FILES:-} in
  "") ;;
  rest) TEST_FILES=("${REST[@]}") ;;
  owed) TEST_FILES=("${REST[@]}" tests/engine/test_bfloat16.py tests/engine/test_async_batching.py
               tests/engine/test_handoff.py tests/engine/test_unsupported_models.py) ;;
  *) read -r -a TEST_FILES <<<"$GPU_TEST_FILES" ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E "^Model name|^CPU\(s\)"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__)"

if [[ $WHAT == tests || $WHAT == confirm || $WHAT == owed || $WHAT == triton || $WHAT == all ]]; then
  # One process: engines size their cache from the GPU's free memory, which parallel workers would share.
  # SIGINT at the limit still prints pytest's summary of what ran.
  CONTBATCH_TEST_DEVICE=cuda timeout -s INT "${TEST_SECONDS:-150}" python3 -m pytest -q -rfE --timeout 30 \
    -p no:cacheprovider --durations=8 "${TEST_FILES[@]}" >"$OUT/tests.log" 2>&1
  echo "tests rc=$?: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -20
  if [[ $WHAT == triton ]]; then
    CONTBATCH_ATTENTION_KERNEL=triton CONTBATCH_TEST_DEVICE=cuda timeout -s INT "${TEST_SECONDS:-150}" python3 -m \
      pytest -q -rfE --timeout 30 -p no:cacheprovider "${KERNEL_ON_FILES[@]}" >"$OUT/tests-kernel.log" 2>&1
    echo "kernel-on tests rc=$?: $(tail -1 "$OUT/tests-kernel.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-kernel.log" | cut -c1-300 | head -20
  fi
fi

if [[ $WHAT == bench || $WHAT == confirm || $WHAT == owed || $WHAT == triton || $WHAT == all ]]; then
  python3 examples/random_weights_model.py "$CONFIG" /tmp/rw >/dev/null || exit 1
  bench() {  # name, then flags
    local name=$1; shift
    timeout 120 python3 -m contbatch.cli bench --model /tmp/rw --static-batch-size 128 "$@" >/tmp/bench-run.log 2>&1
    echo "$name rc=$?"; grep -E "^\| (contbatch|static|transformers)|agree" /tmp/bench-run.log
    { echo "=== $name: $*"; cat /tmp/bench-run.log; } >>"$OUT/bench.log"
  }
  if [[ $WHAT == triton ]]; then  # the kernel (and varlen graphs) off, on, off; float32 outputs with it on
    for kernel in off triton off; do
      CONTBATCH_ATTENTION_KERNEL=$kernel bench "kernel-$kernel-512" --engines contbatch --num-prompts 512
    done
    CONTBATCH_ATTENTION_KERNEL=triton bench f32-kernel-128 --dtype float32 --engines contbatch,static
    bench topp-512 --engines contbatch --num-prompts 512 --temperature 0.7 --top-p 0.9 --top-k 0  # a full sort
    exit 0
  fi
  if [[ $WHAT == confirm || $WHAT == owed ]]; then  # the defaults (auto), float32 outputs against static generate
    bench auto-512 --engines contbatch --num-prompts 512
    bench f32-auto-128 --dtype float32 --engines contbatch,static
    [[ $WHAT == confirm ]] && exit 0
    bench "sampled-512" --engines contbatch --num-prompts 512 --temperature 0.7 --top-p 0.9 --top-k 50
    bench "sampled-topk-512" --engines contbatch --num-prompts 512 --temperature 0.7 --top-k 50
    bench "async-off-512" --engines contbatch --num-prompts 512 --async-batching off
  else
  for run in 1 2; do
    for a in off on; do bench "async-$a-512-$run" --engines contbatch --num-prompts 512 --async-batching $a; done
  done
  bench "async-off-128" --engines contbatch --async-batching off
  bench "async-on-128" --engines contbatch --async-batching on
  bench "graphs-off-128" --engines contbatch --cuda-graphs off
  bench "sampled-512" --engines contbatch --num-prompts 512 --temperature 0.7 --top-p 0.9 --top-k 50
  fi
  python3 - "$OUT/profile.txt" <<'EOF'
import cProfile, pstats, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from contbatch import ContinuousBatchingConfig, generate_batch
from contbatch.data.prompts import chat_inputs, load_prompts
tokenizer = AutoTokenizer.from_pretrained("/tmp/rw")
model = AutoModelForCausalLM.from_pretrained("/tmp/rw", dtype=torch.bfloat16).cuda().eval()
inputs = chat_inputs(tokenizer, load_prompts(limit=512))
generation = GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=None, pad_token_id=0)
config = ContinuousBatchingConfig(block_size=16, use_async_batching=False)
generate_batch(model, inputs, generation, config, progress_bar=False)
profile = cProfile.Profile()
profile.enable()
generate_batch(model, inputs, generation, config, progress_bar=False)
profile.disable()
with open(sys.argv[1], "w") as out:
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(40)
EOF
  echo "profile rc=$?"; head -12 "$OUT/profile.txt" | tail -6
fi
