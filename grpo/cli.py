"""``grpo <command>``: the only argument parser of the project.

One command per pipeline stage, built from the stage table (``grpo/provenance/stages.py``), plus the
commands that are not stages (``plot-entropy``, ``diagnose``, ``fingerprint``, ``pipeline``). Every
command takes ``--params PATH`` and any number of ``--set section.key=value`` overrides, loads the one
typed config, and calls one library function ``run(cfg, **options)`` whose keyword arguments are the
command's own options, typed. Flag combinations are checked here, before the library runs. Entry
modules are imported lazily so ``grpo --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from grpo.config import ConfigError, load_config
from grpo.errors import GrpoError
from grpo.eval.keymetrics import write_key_metrics
from grpo.offline import allow_network, offline_by_default
from grpo.provenance import stages

COMMON = ("command", "params", "overrides")


class UsageError(GrpoError):
    """A combination of command-line options that cannot mean anything."""


def _no_args(parser: argparse.ArgumentParser) -> None:
    """This command needs nothing beyond --params and --set."""


def _plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--entropy-files", nargs="*", type=Path, default=None, help="entropy_history_*.json files"
    )
    parser.add_argument("--labels", nargs="*", default=None, help="one label per entropy file")
    parser.add_argument(
        "--search-dir", type=Path, default=None, help="plot every entropy_history_*.json under it"
    )
    parser.add_argument("--metrics-file", type=Path, default=None, help="per-step JSONL for reward curves")
    parser.add_argument("--with-stats", action="store_true", help="add a panel of mean/min/max/final")
    parser.add_argument("--out", type=Path, default=None, help="output PNG path")


def _check_plot_args(options: dict) -> None:
    files, labels, search_dir = options["entropy_files"], options["labels"], options["search_dir"]
    if files is not None and search_dir is not None:
        raise UsageError("give either --entropy-files or --search-dir, not both")
    if files is None and labels:
        raise UsageError("--labels names --entropy-files; with --search-dir labels come from file names")
    if files is not None and not files:
        raise UsageError(
            "--entropy-files was given without any file; list at least one entropy_history_*.json"
        )
    if files and labels and len(labels) != len(files):
        raise UsageError(
            f"--labels has {len(labels)} label(s) for {len(files)} --entropy-files: give one label per file "
            "or none (labels then come from the file names)"
        )


def _diagnose_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="model folder or checkpoint folder to diagnose")
    parser.add_argument("--out", default=None, help="write the diagnosis as JSON here too")


def _seeds_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run (default: 1 2 3)"
    )


def _bias_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bbq",
        type=Path,
        required=True,
        help="folder of BBQ category files (data/*.jsonl of github.com/nyu-mll/BBQ)",
    )
    parser.add_argument(
        "--per-category", type=_item_count, default=100, help="items drawn from each category (default: 100)"
    )


def _count(what: str, hint: str):
    """An argparse type: an integer of at least 1, else an error naming ``what`` and ``hint``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is not {what}: give 1 or more{hint}")
        return value

    return parse


_item_count = _count("an item count", " (default 100)")
_positive_int = _count("a step count", ", or leave the option out to train all grpo.steps")


def _train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-steps",
        type=_positive_int,
        default=None,
        help="stop after this many steps (at least 1; default: all grpo.steps)",
    )
    parser.add_argument(
        "--select",
        choices=("worst_kind", "last"),
        default=None,
        help="which checkpoint becomes models/grpo: the best on the validation split by its worst kind of item, "
        "or the last step (default: params grpo.selection.rule)",
    )


AddArgs = Callable[[argparse.ArgumentParser], None]
CheckArgs = Callable[[dict], None]


class Command(NamedTuple):
    """One ``grpo`` command: its entry function, help line, options and the check of their combination."""

    entry: str
    help: str
    add_args: AddArgs = _no_args
    check: CheckArgs | None = None


# Options of the stage commands that take more than --params/--set.
STAGE_ARGS: dict[str, AddArgs] = {"train": _train_args}

COMMANDS: dict[str, Command] = {
    **{
        spec.command: Command(spec.entry, spec.help, STAGE_ARGS.get(spec.command, _no_args))
        for spec in stages.STAGES.values()
    },
    "plot-entropy": Command(
        "grpo.eval.plots:run",
        "plot entropy and reward curves of one or many runs",
        _plot_args,
        _check_plot_args,
    ),
    "diagnose": Command(
        "grpo.checks.diagnose:run", "deep entropy diagnosis of a model or checkpoint", _diagnose_args
    ),
    "fingerprint": Command(
        "grpo.provenance.fingerprint:run", "write the semantic code fingerprint of every stage"
    ),
    "status": Command(
        "grpo.provenance.status:run", "what is stale and why (refreshes fingerprints, then dvc status)"
    ),
    "pipeline": Command(
        "grpo.pipeline:run",
        "run every stage in order in one process, without DVC (`make run` runs them by `dvc repro`)",
    ),
    "bias": Command(
        "grpo.eval.bias:run", "the run's models on published BBQ items: accuracy and bias scores", _bias_args
    ),
    "seeds": Command(
        "grpo.seed_sweep:run", "run the pipeline once per seed and print GRPO − SFT across seeds", _seeds_args
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        cmd = sub.add_parser(name, help=command.help, description=command.help)
        cmd.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
        cmd.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one params value, e.g. --set grpo.loss.beta=0.1 (repeatable)",
        )
        command.add_args(cmd)
    return parser


def resolve(entry: str) -> Callable[..., int]:
    """The function named by ``module:function``."""
    module_name, _, func_name = entry.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    offline_by_default()  # before any Hugging Face import; `dvc repro` runs these commands too
    command = COMMANDS[args.command]
    options = {key: value for key, value in vars(args).items() if key not in COMMON}
    try:
        if command.check is not None:
            command.check(options)
        cfg = load_config(args.params, args.overrides)
    except (UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.model.allow_download:
        allow_network()
    try:
        code = resolve(command.entry)(cfg, **options)
        if not code:
            write_key_metrics(
                cfg, next((s.name for s in stages.STAGES.values() if s.command == args.command), "")
            )
    except (GrpoError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
