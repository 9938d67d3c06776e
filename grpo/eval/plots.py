"""``grpo plot-entropy``: entropy curves of one or many runs (plus reward curves and stats) as a PNG.

Entropy collapse is the failure users most need to see at a glance, so every run's
``entropy_history_<experiment>.json`` (``[{"step": 1, "entropy": 4.53}, ...]``, written by the trainer)
goes on one shared axis. A per-step metrics JSONL adds the reward mean +- std and
``frac_reward_zero_std`` (the share of groups that carry no learning signal) below it.

Figures are built with ``matplotlib.figure.Figure`` directly, never pyplot: no display, no global
backend switch, nothing kept alive in pyplot's registry when many plots are drawn in one process.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from grpo import paths
from grpo.config import Config
from grpo.errors import GrpoError
from grpo.eval.metrics import KEY_ROWS
from grpo.files import write_atomically
from grpo.health.metrics import MetricsError, read_metrics

ENTROPY_PREFIX = "entropy_history_"
ENTROPY_PATTERN = f"{ENTROPY_PREFIX}*.json"
DPI = 100
PANEL_SIZE = (9.0, 3.0)
"""Width and height in inches of one panel; the PNG is 900 px wide and 300 px per panel tall."""


class PlotInputError(GrpoError):
    """An entropy history or metrics file is missing or malformed, or the plot arguments disagree."""


# --------------------------------------------------------------------------- reading


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def experiment_label(path: Path) -> str:
    """``runs/entropy_history_cagrad.json`` -> ``cagrad``; any other file name -> its stem."""
    stem = Path(path).stem
    return stem.removeprefix(ENTROPY_PREFIX) or stem


def load_entropy_history(path: Path) -> list[dict]:
    """Read an entropy history file, sorted by step; a problem names the file and the bad entry."""
    path = Path(path)
    if not path.is_file():
        raise PlotInputError(
            f"{path}: no such entropy history file; pass an existing {ENTROPY_PATTERN} "
            "(`grpo train` writes one per run) or use --search-dir"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PlotInputError(
            f'{path}: not valid JSON ({exc}); expected [{{"step": 1, "entropy": 4.5}}, ...]'
        ) from None
    if not isinstance(data, list) or not data:
        raise PlotInputError(
            f'{path}: expected a non-empty JSON list of {{"step", "entropy"}} entries, got '
            f"{type(data).__name__ if data else 'an empty list'}"
        )
    for index, entry in enumerate(data):
        if not isinstance(entry, dict) or not all(_is_number(entry.get(key)) for key in ("step", "entropy")):
            raise PlotInputError(
                f"{path}: entry {index} is {entry!r}; every entry needs a finite number under both "
                "'step' and 'entropy'"
            )
    return sorted(data, key=lambda entry: entry["step"])


def load_metrics_jsonl(path: Path) -> list[dict]:
    """Read a per-step metrics JSONL through the trainer's own reader (``read_metrics``) and check it
    holds something to plot."""
    path = Path(path)
    if not path.is_file():
        raise PlotInputError(
            f"{path}: no such metrics file; pass the per-step JSONL that `grpo train` writes"
        )
    try:
        rows = read_metrics(path)
    except MetricsError as exc:
        raise PlotInputError(str(exc)) from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or not _is_number(row.get("step")):
            raise PlotInputError(
                f"{path}: record {number} needs a JSON object with a numeric 'step' (got {str(row)[:80]!r})"
            )
    if not any(_is_number(row.get(key)) for row in rows for key in ("reward", "frac_reward_zero_std")):
        raise PlotInputError(
            f"{path}: no line has a numeric 'reward' or 'frac_reward_zero_std'; pass the GRPO per-step "
            "metrics JSONL, not another file"
        )
    return rows


def discover_entropy_files(search_dir: Path) -> dict[str, Path]:
    """Label -> file for every ``entropy_history_*.json`` under ``search_dir`` (recursively).

    The label is the experiment name from the file name; two runs with the same name in different
    folders get their folder appended, so neither silently replaces the other.
    """
    search_dir = Path(search_dir)
    if not search_dir.is_dir():
        raise PlotInputError(
            f"--search-dir {search_dir}: no such folder; pass the folder that holds the runs"
        )
    paths = sorted(search_dir.rglob(ENTROPY_PATTERN))
    if not paths:
        raise PlotInputError(
            f"--search-dir {search_dir}: no {ENTROPY_PATTERN} found under it; run `grpo train` first "
            "or pass files with --entropy-files"
        )
    counts = Counter(experiment_label(path) for path in paths)
    found = {}
    for path in paths:
        label = experiment_label(path)
        if counts[label] > 1:
            label = f"{label} ({path.parent.relative_to(search_dir).as_posix()})"
        found[label] = path
    return found


# --------------------------------------------------------------------------- stats and drawing


def entropy_stats(history: list[dict]) -> dict[str, float | int]:
    """Mean, min, max and final (last step) entropy of one run, and its number of steps.

    | history (step: entropy)  | mean | min | max | final | steps |
    | ------------------------ | ---- | --- | --- | ----- | ----- |
    | 2: 3.0, 1: 4.0, 3: 2.0   | 3.0  | 2.0 | 4.0 | 2.0   | 3     |
    """
    if not history:
        raise PlotInputError("entropy_stats: the history is empty; a run needs at least one step")
    values = [entry["entropy"] for entry in history]
    last = max(history, key=lambda entry: entry["step"])
    return {
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "final": last["entropy"],
        "steps": len(history),
    }


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    kept = [row for row in rows if _is_number(row.get(key))]
    return [row["step"] for row in kept], [row[key] for row in kept]


def _draw_entropy(ax: Axes, histories: dict[str, list[dict]]) -> None:
    for label, history in histories.items():
        ordered = sorted(history, key=lambda entry: entry["step"])
        ax.plot([e["step"] for e in ordered], [e["entropy"] for e in ordered], marker=".", label=label)
    ax.set_title("policy entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def _draw_reward(ax: Axes, metrics: list[dict]) -> None:
    steps, reward = _series(metrics, "reward")
    ax.plot(steps, reward, color="black", label="reward")
    std_rows = [row for row in metrics if _is_number(row.get("reward")) and _is_number(row.get("reward_std"))]
    if std_rows:
        low = [row["reward"] - row["reward_std"] for row in std_rows]
        high = [row["reward"] + row["reward_std"] for row in std_rows]
        ax.fill_between(
            [row["step"] for row in std_rows], low, high, alpha=0.2, color="gray", label="+- reward_std"
        )
    task_keys = sorted(
        {key for row in metrics for key in row if key.startswith("rewards/") and key.endswith("/mean")}
    )
    for key in task_keys:
        ax.plot(*_series(metrics, key), linewidth=1, label=key)
    ax.set_title("reward (mean +- std)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def _draw_zero_std(ax: Axes, metrics: list[dict]) -> None:
    ax.plot(*_series(metrics, "frac_reward_zero_std"), color="tab:red", label="frac_reward_zero_std")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("groups with zero reward std (no learning signal)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def _draw_stats(ax: Axes, histories: dict[str, list[dict]]) -> None:
    ax.axis("off")
    columns = ("mean", "min", "max", "final")
    cells = []
    for label, history in histories.items():
        stats = entropy_stats(history)
        cells.append([label, *(f"{stats[column]:.4f}" for column in columns), str(stats["steps"])])
    ax.table(cellText=cells, colLabels=["run", *columns, "steps"], loc="center")
    ax.set_title("entropy stats per run")


def build_entropy_figure(
    histories: dict[str, list[dict]], with_stats: bool = False, metrics: list[dict] | None = None
) -> Figure:
    """One panel per view, stacked: entropy of every run; reward and zero-std share if ``metrics``
    has them; the stats table if ``with_stats``. ``fig.axes[0]`` is the entropy panel."""
    if not histories:
        raise PlotInputError("nothing to plot: give at least one entropy history")
    panels = [lambda ax: _draw_entropy(ax, histories)]
    metrics = metrics or []
    if any(_is_number(row.get("reward")) for row in metrics):
        panels.append(lambda ax: _draw_reward(ax, metrics))
    if any(_is_number(row.get("frac_reward_zero_std")) for row in metrics):
        panels.append(lambda ax: _draw_zero_std(ax, metrics))
    if with_stats:
        panels.append(lambda ax: _draw_stats(ax, histories))
    width, height = PANEL_SIZE
    fig = Figure(figsize=(width, height * len(panels)), dpi=DPI, layout="constrained")
    for ax, draw in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels, strict=True):
        draw(ax)
    return fig


def plot_entropy(
    histories: dict[str, list[dict]], out: Path, with_stats: bool = False, metrics: list[dict] | None = None
) -> Path:
    """Draw ``build_entropy_figure`` into the PNG ``out`` (written atomically, parent folders created);
    returns ``out``."""
    out = Path(out)
    fig = build_entropy_figure(histories, with_stats=with_stats, metrics=metrics)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    write_atomically({out: png.getvalue()})
    return out


def build_eval_figure(results: dict[str, dict]) -> Figure:
    """The key rows (greedy decoding) of every evaluated model (``{model: {"greedy": {row: value}}}``) as
    grouped bars, one colour per model."""
    width, height = PANEL_SIZE
    fig = Figure(figsize=(width, height * 1.3), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    bar = 0.8 / max(len(results), 1)
    for index, (model, modes) in enumerate(results.items()):
        values = [modes.get("greedy", {}).get(key) for key in KEY_ROWS]
        ax.bar(
            [row + index * bar for row in range(len(KEY_ROWS))],
            [value if _is_number(value) else 0.0 for value in values],
            bar,
            label=model,
        )
    ax.set_xticks(
        [row + 0.4 - bar / 2 for row in range(len(KEY_ROWS))], [key.replace("/", "\n") for key in KEY_ROWS]
    )
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_title("evaluation, greedy decoding (absent values drawn as 0)")
    ax.legend()
    return fig


def plot_eval_comparison(results: dict[str, dict], out: Path) -> Path:
    """Draw ``build_eval_figure`` into the PNG ``out`` (written atomically, parent folders created)."""
    out = Path(out)
    png = io.BytesIO()
    build_eval_figure(results).savefig(png, format="png", dpi=DPI)
    write_atomically({out: png.getvalue()})
    return out


# --------------------------------------------------------------------------- command


def select_histories(
    runs_dir: Path,
    entropy_files: Sequence[Path] | None = None,
    labels: Sequence[str] | None = None,
    search_dir: Path | None = None,
) -> dict[str, Path]:
    """Label -> entropy history file: the given files (labelled by ``labels`` or their file names),
    else every history under ``search_dir`` (default ``runs_dir``, where the trainer writes them)."""
    if entropy_files is None:
        return discover_entropy_files(Path(search_dir or runs_dir))
    names = list(labels) if labels else [experiment_label(Path(path)) for path in entropy_files]
    if len(names) != len(entropy_files):
        raise PlotInputError(
            f"{len(names)} label(s) for {len(entropy_files)} entropy files: give one per file"
        )
    if len(set(names)) != len(names):
        duplicates = sorted(label for label, count in Counter(names).items() if count > 1)
        raise PlotInputError(f"labels must be distinct, {duplicates} repeat: pass --labels to name each run")
    return {label: Path(path) for label, path in zip(names, entropy_files, strict=True)}


def run(
    cfg: Config,
    entropy_files: Sequence[Path] | None = None,
    labels: Sequence[str] | None = None,
    search_dir: Path | None = None,
    metrics_file: Path | None = None,
    with_stats: bool = False,
    out: Path | None = None,
) -> int:
    """``grpo plot-entropy``: write the PNG (default ``<paths.reports_dir>/entropy.png``)."""
    selected = select_histories(paths.runs_root(cfg), entropy_files, labels, search_dir)
    histories = {label: load_entropy_history(path) for label, path in selected.items()}
    metrics = load_metrics_jsonl(Path(metrics_file)) if metrics_file else None
    out = Path(out) if out else paths.report_file(cfg, "entropy.png")
    plot_entropy(histories, out, with_stats=with_stats, metrics=metrics)
    print(f"wrote {out} ({len(histories)} run(s))")
    if with_stats:
        for label, history in histories.items():
            stats = entropy_stats(history)
            print(f"  {label}: " + " ".join(f"{key}={value:.4g}" for key, value in stats.items()))
    return 0
