"""``python -m flows.serve``: serve the ``full-retrain`` deployment on the nightly cron of params.yaml.

Run it from the project root with ``PREFECT_API_URL`` pointing at a server; then
``prefect deployment run full-retrain/full-retrain`` triggers a run and the cron (``schedule.cron``
in ``schedule.timezone``) starts one every night. ``limit=1``: this runner never starts a second run
while one is going (DVC could not run two anyway; see tasks/dvc_stage.py).

The runs depend on this one foreground process, and the deployment says which one: its description
reads ``Served by `make serve` (pid N on HOST, started T)``. When the process stops (Ctrl-C, SIGTERM)
it pauses the deployment and says so in the description (``Not served: ...``) - unless another
process took the deployment over meanwhile (a restart whose new process started before the old one
stopped): Prefect's own pause on shutdown is off, as it would pause the deployment the new process
serves. For production use ``python -m flows.deploy`` (a work pool served by ``prefect worker start``).
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.exceptions import ObjectNotFound

from flows.full_retrain import full_retrain
from flows.schedule import drop_other_schedules, nightly_cron, schedule_label
from grpo.config import load_config

SERVED = "Served by `make serve` ({who}): the nightly full retrain runs {when} while it runs."
STOPPED = (
    "Not served: `make serve` ({who}) stopped at {at}. The deployment is paused: no run starts until "
    "`make serve` (or `python -m flows.deploy` and a worker) is started again."
)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def release(deployment: str, who: str) -> bool:
    """Pause ``deployment`` and say it is not served, unless its description names another server than
    ``who`` (a newer ``make serve`` or ``flows.deploy`` took it over); True when it was paused."""
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return False
        if who not in (found.description or ""):
            return False
        client.pause_deployment(found.id)
        client.update_deployment(found.id, DeploymentUpdate(description=STOPPED.format(who=who, at=_now())))
    return True


def serve(project_dir: str | Path = ".") -> None:
    """Create or update the deployment and poll for its runs until interrupted; then ``release`` it."""
    project = Path(project_dir).resolve()
    params = project / "params.yaml"
    schedule = load_config(params).schedule
    cron = nightly_cron(schedule, params)
    deployment = f"{full_retrain.name}/{schedule.deployment}"
    who = f"pid {os.getpid()} on {socket.gethostname()}, started {_now()}"
    drop_other_schedules(deployment, cron.slug)
    try:
        full_retrain.serve(
            name=schedule.deployment,
            schedules=[cron],
            parameters={"force": schedule.force, "params_path": "params.yaml", "project_dir": str(project)},
            description=SERVED.format(who=who, when=schedule_label(schedule)),
            limit=1,
            pause_on_shutdown=False,
        )
    finally:
        release(deployment, who)


if __name__ == "__main__":
    serve()
