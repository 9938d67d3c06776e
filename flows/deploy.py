"""``python -m flows.deploy``: the production path, the ``full-retrain`` deployment on a process work pool.

``python -m flows.serve`` runs the nightly schedule from one foreground process: stopping it pauses
the deployment's schedule. This instead registers the deployment with the server once, on the work
pool ``grpo-process`` (created as a ``process`` pool if absent), on the cron of params.yaml, with a
deployment concurrency limit of 1 (one full-retrain at a time, shown in the UI; a run due while one
is going waits). Any number of ``prefect worker start --pool grpo-process`` processes, started and
restarted independently (systemd, a container), pick the runs up; the schedule does not depend on them.
The flow's code is loaded from the project folder (``from_source``), so the worker runs the code that
is in the project when the run starts.
"""

from __future__ import annotations

from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound

from flows.full_retrain import full_retrain
from flows.schedule import drop_other_schedules, nightly_cron, schedule_label
from grpo.config import load_config

WORK_POOL = "grpo-process"
ENTRYPOINT = "flows/full_retrain.py:full_retrain"


def ensure_work_pool(name: str = WORK_POOL) -> None:
    """Create the process work pool ``name`` unless it exists."""
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def deploy(project_dir: str | Path = ".", work_pool: str = WORK_POOL) -> str:
    """Create or update the deployment on ``work_pool``; returns its id."""
    project = Path(project_dir).resolve()
    params = project / "params.yaml"
    schedule = load_config(params).schedule
    cron = nightly_cron(schedule, params)  # a bad cron fails here, before the server is touched
    ensure_work_pool(work_pool)
    drop_other_schedules(f"{full_retrain.name}/{schedule.deployment}", cron.slug)
    flow = full_retrain.from_source(source=str(project), entrypoint=ENTRYPOINT)
    return str(
        flow.deploy(
            name=schedule.deployment,
            work_pool_name=work_pool,
            schedules=[cron],
            parameters={"force": schedule.force, "params_path": "params.yaml", "project_dir": str(project)},
            concurrency_limit=1,
            description=f"On work pool {work_pool}: the nightly full retrain runs {schedule_label(schedule)} "
            f"when a worker polls it (`prefect worker start --pool {work_pool}`).",
            build=False,
            push=False,
            print_next_steps=False,
        )
    )


if __name__ == "__main__":
    deployment_id = deploy()
    print(
        f"deployment full-retrain/full-retrain ({deployment_id}) on work pool {WORK_POOL}; "
        f"start a worker: prefect worker start --pool {WORK_POOL}"
    )
