"""Why a ``full-retrain`` run failed, in one short line wherever a person looks, and the fix for a flow run.

When a task fails, the flow stops with ``stopped``: one ERROR log line and a Failed state whose
message is that line, ``<stage> failed: <reason>``, the reason being the stage's own (the CLI's
``error:`` line, which names the file, the key, the value and the fix). The state's name carries it
too, cut to ``NAME_CHARS``: ``Failed at validate: data validation failed: ...``. ``prefect deployment
run ... --watch`` prints only the final state's name (``Flow run finished in state '...'``; a
server streams no logs to it unless told to), so the name is where a terminal user reads why. A flow run takes no ``--set`` and no ``--params``, so a fix phrased for the CLI is
rephrased for the params file the run was started with (``for_flow_run``).

The failure hook then writes ``<project>/<runs_dir>/last_failure.md`` and the markdown artifact
``full-retrain-failure``: the reason and the fix on top, then the run, then the details (the stage's
command and the tail of its stderr, wrapped). On success the file is removed, so its presence means
"the last run failed". ``--watch`` exits 1 on a failed run, for a cron job or CI to mail.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from prefect import Flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import FlowRun, State
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Failed

from grpo.config import ConfigError
from tasks.artifacts import project_config
from tasks.markdown import fit, wrap_code

FAILURE_FILE = "last_failure.md"
REASON_CHARS = 300
NAME_CHARS = 100
DEPLOYMENT = "full-retrain/full-retrain"
logger = logging.getLogger("grpo_dual.notify")

_STOPPED: dict[str, tuple[str, str, str]] = {}
"""``{flow run id: (stage, reason, details)}`` from ``stopped`` to the failure hook (same process)."""

_CLI_ONLY = (
    # "fix it in configs/x.yaml or with --set grpo.lr=..." -> "fix it in configs/x.yaml"
    (re.compile(r",?\s*or (?:with |pass |use )?`?--(?:set|params) [^\s`;,)]+`?"), lambda m, _: ""),
    # "give it with --set model.name_or_path=PATH" -> "give it with `model.name_or_path` in configs/x.yaml"
    (re.compile(r"`?--set ([\w.]+)=[^\s`;,)]*`?"), lambda m, params: f"`{m.group(1)}` in {params}"),
    (re.compile(r"`?--params [^\s`;,)]+`?"), lambda m, _: "-p params_path=PATH"),
    # a workspace's params.yaml is written from the run's params file: that is the file to edit
    (re.compile(r"[^\s`'\"]*\.workspaces/[^/\s]+/params\.yaml"), lambda m, params: params),
)


def for_flow_run(text: str, params_path: str) -> str:
    """``text`` with every CLI-only fix (``--set key=...``, ``--params PATH``) rephrased for a flow run:
    the key to edit in ``params_path``, the file the run was started with."""
    for pattern, replace in _CLI_ONLY:
        text = pattern.sub(lambda m, replace=replace: replace(m, params_path), text)
    return text


def one_line(text: str, width: int = REASON_CHARS) -> str:
    """The first line of ``text``, at most ``width`` characters."""
    first = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    return first if len(first) <= width else first[: width - 1].rstrip() + "…"


def relaunch(flow_run: FlowRun) -> str:
    """How to start the run again, the way ``flow_run`` was started (from the deployment or not)."""
    params_path = flow_run.parameters.get("params_path", "params.yaml")
    params = "" if params_path == "params.yaml" else f" -p params_path={params_path}"
    if flow_run.deployment_id:
        return f"`prefect deployment run {DEPLOYMENT}{params}`"
    return "`python -m flows.full_retrain`" + (f" with params_path={params_path}" if params else "")


def stopped(stage: str, state: State, params_path: str) -> State:
    """The flow's final state when task ``stage`` ended in ``state`` (failed): ``<stage> failed: <reason>``."""
    exc = state.result(raise_on_failure=False)
    reason = state.message or (str(exc) if isinstance(exc, BaseException) else state.name)
    reason = for_flow_run(one_line(reason), params_path)
    text = str(exc) if isinstance(exc, BaseException) else ""
    details = for_flow_run(getattr(exc, "details", "") or (text if "\n" in text else ""), params_path)
    message = f"{stage} failed: {reason}"
    _STOPPED[str(current_flow_run.id)] = (stage, reason, details)
    get_run_logger().error("full-retrain stopped: %s (details: %s)", message, FAILURE_FILE)
    return Failed(name=one_line(f"Failed at {stage}: {reason}", NAME_CHARS), message=message)


def failure_file(flow_run: FlowRun) -> Path:
    """``<project>/<runs_dir>/last_failure.md`` of the project the run was started on."""
    project = Path(flow_run.parameters.get("project_dir", ".")).resolve()
    try:
        runs = project_config(project).paths.runs_dir
    except (ConfigError, OSError):
        runs = "runs"
    return project / runs / FAILURE_FILE


def failure_report(flow_run: FlowRun, state: State) -> str:
    """Markdown: why (one line) and the fix first, then the run, then the details (wrapped)."""
    unexpected = (None, one_line(state.message or state.name), "\n".join(str(state.message).splitlines()[1:]))
    stage, reason, details = _STOPPED.pop(str(flow_run.id), unexpected)
    where = f" at {stage}" if stage else ""
    again = f"start the run again ({relaunch(flow_run)}): it reruns only what is stale"
    lines = [
        f"# full-retrain failed{where}",
        "",
        f"**Why:** {reason}",
        "",
        f"**Then:** {again}." if "fix" in reason.lower() else f"**Fix:** the cause above, then {again}.",
        "",
        f"- flow run: `{flow_run.name}` (`{flow_run.id}`)",
        f"- parameters: {', '.join(f'`{k}={v}`' for k, v in flow_run.parameters.items())}",
        f"- failed at {state.timestamp:%Y-%m-%d %H:%M:%S %Z}",
        f"- logs: `prefect flow-run logs {flow_run.id}`",
    ]
    if details.strip():
        lines += ["", "## Details", "", wrap_code(details.strip())]
    return fit("\n".join(lines) + "\n")


def notify_failure(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """``on_failure`` hook: write the failure file and artifact, log where they are."""
    text = failure_report(flow_run, state)
    path = failure_file(flow_run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    create_markdown_artifact(markdown=text, key="full-retrain-failure", description="Why the last run failed")
    logger.error("full-retrain run %s failed; the reason and the fix are in %s", flow_run.name, path)


def clear_failure(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """``on_completion`` hook: a successful run removes the last failure's file."""
    failure_file(flow_run).unlink(missing_ok=True)
