"""``python -m flows.serve``: serve the ``full-retrain`` deployment on the nightly cron of params.yaml.

Run it from the project root with ``PREFECT_API_URL`` pointing at a server; then
``prefect deployment run full-retrain/full-retrain`` triggers a run and the cron (``schedule.cron``
in ``schedule.timezone``) starts one every night. ``limit=1``: this runner never starts a second run
while one is going (DVC could not run two anyway; see tasks/dvc_stage.py).

The runs depend on this one foreground process: stopping it pauses the deployment's schedule until it
is started again. For production use ``python -m flows.deploy`` (a work pool served by
``prefect worker start``) instead.
"""

from __future__ import annotations

from pathlib import Path

from flows.full_retrain import full_retrain
from flows.schedule import nightly_cron
from grpo.config import load_config


def serve(project_dir: str | Path = ".") -> None:
    """Create or update the deployment and poll for its runs until interrupted."""
    project = Path(project_dir).resolve()
    params = project / "params.yaml"
    schedule = load_config(params).schedule
    full_retrain.serve(
        name=schedule.deployment,
        schedules=[nightly_cron(schedule, params)],
        parameters={"force": schedule.force, "params_path": "params.yaml", "project_dir": str(project)},
        limit=1,
    )


if __name__ == "__main__":
    serve()
