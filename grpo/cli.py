"""``grpo <stage>``: the only argument parser of the project; one command per pipeline stage.

Every command takes ``--params PATH`` and any number of ``--set section.key=value`` overrides, loads
the one typed config, and calls one library function ``run(cfg, args)``. Commands are imported lazily
so ``grpo --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from grpo.config import ConfigError, load_config
from grpo.errors import GrpoError


def _no_args(parser: argparse.ArgumentParser) -> None:
    """This command needs nothing beyond --params and --set."""


def _plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entropy-files", nargs="*", default=None, help="entropy_history_*.json files")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per entropy file")
    parser.add_argument("--search-dir", default=None, help="plot every entropy_history_*.json under it")
    parser.add_argument("--metrics-file", default=None, help="per-step JSONL for reward curves")
    parser.add_argument("--with-stats", action="store_true", help="add a panel of mean/min/max/final")
    parser.add_argument("--out", default=None, help="output PNG path")


def _diagnose_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="model folder or checkpoint folder to diagnose")
    parser.add_argument("--out", default=None, help="write the diagnosis as JSON here too")


def _seeds_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run (default: 1 2 3)")


def _train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")


# name -> (module:function, help, extra-argument adder)
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "prepare": ("grpo.data.prepare:run", "generate or load the dataset into data/processed", _no_args),
    "validate": ("grpo.data.validate:run", "Great Expectations gate over the processed data", _no_args),
    "base": ("grpo.model.base:run", "build the embedded tiny model or resolve the configured one", _no_args),
    "sft": ("grpo.train.sft:run", "supervised fine-tuning with the one chat renderer", _no_args),
    "preflight": ("grpo.checks.preflight:run", "check invariants I1-I12 on the configured model", _no_args),
    "train": ("grpo.train.trainer:run", "GRPO on both reward tasks", _train_args),
    "evaluate": ("grpo.eval.evaluate:run", "evaluate base, SFT and GRPO models side by side", _no_args),
    "plot-entropy": ("grpo.eval.plots:run", "plot entropy and reward curves of one or many runs", _plot_args),
    "diagnose": ("grpo.checks.diagnose:run", "deep entropy diagnosis of a model or checkpoint", _diagnose_args),
    "fingerprint": ("grpo.provenance.fingerprint:run", "write the semantic code fingerprint of every stage", _no_args),
    "pipeline": ("grpo.pipeline:run", "run every stage in order (what `make run` does)", _no_args),
    "seeds": ("grpo.seeds:run", "run the pipeline once per seed and print GRPO − SFT across seeds", _seeds_args),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text, add_args) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
        cmd.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one params value, e.g. --set grpo.loss.beta=0.1 (repeatable)",
        )
        add_args(cmd)
    return parser


def _resolve(target: str) -> Callable:
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run = _resolve(COMMANDS[args.command][0])
    try:
        code = run(cfg, args)
    except (GrpoError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
