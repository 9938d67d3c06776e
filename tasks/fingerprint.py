"""Task ``fingerprint``: refresh the semantic code fingerprints every other stage depends on."""

from __future__ import annotations

from prefect import task
from prefect.states import State

from tasks.states import stage_result


@task(name="fingerprint")
def fingerprint(project_dir: str) -> State:
    """Run the always-changed DVC stage ``fingerprint`` (`grpo fingerprint`); cheap, never retried."""
    return stage_result("fingerprint", project_dir)
