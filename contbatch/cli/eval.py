"""`contbatch eval`: lm-evaluation-harness's `lm-eval run` command line, with contbatch's backend and tasks.

Every argument goes to lm-eval's own `run` parser and entry point (lm-eval 0.4.x), after contbatch's defaults:
`--model contbatch` (registered by `contbatch.integrations.lm_eval`), `pretrained` = the embedded
SmolLM2-135M-Instruct unless `--model_args` names one, the shipped tasks' directory on the include path (beside
any `--include_path`), and `--device` the default device. So `contbatch eval --tasks contbatch_gsm8k_mc` is a
complete command; `contbatch eval --help` shows lm-eval's flags. `--threads N` sets torch's CPU threads.
"""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """lm-evaluation-harness on contbatch. Defaults: --model contbatch, model_args pretrained = the embedded
SmolLM2-135M-Instruct, the shipped tasks (contbatch_gsm8k_mc, contbatch_gsm8k_gen, tag contbatch_gsm8k) on the include
path, --device cuda when available else cpu. --threads N sets torch's CPU threads. Below, lm-eval's own `run` flags
(its examples say `lm-eval run`: write `contbatch eval`)."""

# The subparser reads no option of its own: with "+" as its prefix, every "-" flag (--help included) reaches lm-eval.
PARSER_OPTIONS: dict[str, Any] = {"add_help": False, "prefix_chars": "+"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `contbatch eval` to its subparser `parser` (made with `PARSER_OPTIONS`): everything
    after `eval` is kept, unparsed, for lm-eval."""
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                        help="lm-eval's `run` arguments: --tasks, --limit, --num_fewshot, --output_path, ...")
    parser.set_defaults(threads=None)


def _eval(args: argparse.Namespace) -> int:
    """Run `contbatch eval`: lm-eval's `run` on `args.lm_eval_args` with contbatch's defaults; return 0.

    Raises:
        RuntimeError: lm-eval is not installed.
        ValueError: from lm-eval (unknown tasks, bad arguments it validates) or the backend; bad flags exit
            through lm-eval's parser (status 2).
    """
    import torch

    try:
        from lm_eval.utils import setup_logging
    except ImportError:
        raise RuntimeError('contbatch eval needs lm-eval: pip install "contbatch[eval]"') from None
    setup_logging()
    threads, rest = _take_threads(args.lm_eval_args)
    if threads:
        torch.set_num_threads(threads)
    namespace = build_parser().parse_args(["run", *rest])
    apply_defaults(namespace)
    namespace.func(namespace)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A parser holding lm-eval's `run` subcommand (its own flags, help and entry point `func`), with the
    `contbatch` model registered."""
    from lm_eval._cli.run import Run

    import contbatch.integrations.lm_eval  # noqa: F401  (registers the model `contbatch`)

    parser = argparse.ArgumentParser(prog="contbatch eval")
    commands = parser.add_subparsers(dest="command", required=True)
    Run.create(commands)
    run = commands.choices["run"]
    run.usage = "contbatch eval --tasks <task> [<task> ...] [--model_args <arg=value> ...] [options]"
    run.description = DESCRIPTION
    return parser


def apply_defaults(namespace: argparse.Namespace) -> None:
    """Fills what neither the command line nor its `--config` YAML file set: `--model contbatch`, the embedded model
    as `pretrained` (for the `contbatch` model), the shipped tasks beside any `--include_path`, and the default
    device. Values of the YAML file that these defaults would hide are carried onto the command line."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import simple_parse_args_string

    from contbatch.data.embedded import default_device, embedded_model_dir
    from contbatch.integrations.lm_eval import TASKS_DIR

    config = EvaluatorConfig.load_yaml_config(namespace.config) if namespace.config else {}
    namespace.model = namespace.model or config.get("model") or "contbatch"
    if namespace.model == "contbatch":
        from_file = config.get("model_args") or {}
        if isinstance(from_file, str):
            from_file = simple_parse_args_string(from_file)
        model_args = {**from_file, **(namespace.model_args or {})}
        model_args.setdefault("pretrained", str(embedded_model_dir()))
        namespace.model_args = model_args
    include = namespace.include_path or config.get("include_path")
    namespace.include_path = [*([include] if include else []), str(TASKS_DIR)]
    namespace.device = namespace.device or config.get("device") or default_device()


def _take_threads(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--threads N` (or `--threads=N`) taken out of `argv`: (N or None, the other arguments)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--threads", type=int, default=None)
    known, rest = parser.parse_known_args(argv)
    return known.threads, rest
