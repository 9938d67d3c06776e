"""Flow ``full-retrain``: every pipeline stage in order; DVC reruns only what is stale.

``python -m flows.full_retrain`` runs it once (``force=True`` from Python or as a deployment
parameter); ``python -m flows.serve`` serves it nightly, ``python -m flows.deploy`` deploys it to a
work pool. Each stage waits for the one before (``wait_for``), so the run's graph is the pipeline
prepare -> validate -> base -> sft -> preflight -> grpo -> evaluate. A failed stage stops the flow
before any later task: its Failed state's message is one line, ``<stage> failed: <reason>`` (the
failing rule or invariant, the bad key and its fix), and the failure hook leaves the reason, the fix and
the details in ``runs/last_failure.md`` and an artifact (tasks/notify.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from prefect import flow

from tasks.base import base
from tasks.evaluate import evaluate
from tasks.fingerprint import fingerprint
from tasks.notify import clear_failure, notify_failure, stopped
from tasks.params import use_params
from tasks.preflight import preflight
from tasks.prepare import prepare
from tasks.sft import sft
from tasks.train import train
from tasks.validate import validate

STAGES = {
    "prepare": prepare,
    "validate": validate,
    "base": base,
    "sft": sft,
    "preflight": preflight,
    "grpo": train,
    "evaluate": evaluate,
}


@flow(name="full-retrain", on_failure=[notify_failure], on_completion=[clear_failure])
def full_retrain(
    force: bool = False, params_path: str = "params.yaml", project_dir: str = "."
) -> dict[str, bool]:
    """params -> fingerprint -> prepare -> ... -> evaluate, each after the last; returns which stages ran."""
    chosen = use_params(project_dir, params_path, return_state=True)
    if not chosen.is_completed():
        return stopped("params", chosen, params_path)
    # A fresh string: the graph's edges are the stage order (wait_for), not every stage reading `params`.
    where = str(Path(chosen.result()))
    steps = {"fingerprint": partial(fingerprint, where)} | {
        name: partial(stage, where, force) for name, stage in STAGES.items()
    }
    previous, ran = chosen, {}
    for name, step in steps.items():
        previous = step(wait_for=[previous], return_state=True)
        if not previous.is_completed():
            return stopped(name, previous, params_path)  # no later task runs; the state says why
        ran[name] = previous.result()
    return ran


if __name__ == "__main__":
    full_retrain()
