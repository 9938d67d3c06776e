"""Task ``fingerprint``: refresh the semantic code fingerprints every other stage depends on."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.dvc_stage import run_stage, stage_state


@task(name="fingerprint")
def fingerprint(project_dir: str) -> State:
    """Run the always-changed DVC stage ``fingerprint`` (`grpo fingerprint`); cheap, never retried."""
    return stage_state("fingerprint", run_stage("fingerprint", project_dir))
