"""The deployments against a real Prefect server: served (flows/serve.py) and on a work pool (flows/deploy.py).

One ``prefect server start`` on a free 127.0.0.1 port for the module (tests/prefect_server.py). Each
test works in a clone of the built tiny project, so a run proves the wiring (deployment, runner or
worker, flow, tasks, DVC, artifacts) in seconds: DVC finds every stage up to date.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.artifacts import MAX_TABLE_LINE
from tests.browser import CHROMIUM, browser
from tests.prefect_runs import ARTIFACT_KEYS, artifact_keys, task_runs
from tests.prefect_server import BIN, running_server, wait_until
from tests.project_copy import ROOT, clone, missing_stage_modules

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_stage_modules()),
                       reason=f"stage modules not written yet: {', '.join(missing_stage_modules())}"),
]

DEPLOYMENT = "full-retrain/full-retrain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tasks.dvc_stage import stage_env

    with running_server(tmp_path_factory.mktemp("prefect"), stage_env(ROOT)) as running:
        yield running


@contextlib.contextmanager
def api_client(server):
    """A client of the module's server (settings first: get_client reads them when called)."""
    with temporary_settings(updates={PREFECT_API_URL: server.api}), get_client(sync_client=True) as client:
        yield client


def _deployment(client):
    try:
        return client.read_deployment_by_name(DEPLOYMENT)
    except Exception:  # ObjectNotFound until it is registered
        return None


def _run_and_watch(server, project: Path, *params: str) -> tuple[subprocess.CompletedProcess, UUID]:
    """``prefect deployment run full-retrain/full-retrain --watch``, as the README shows it."""
    args = [str(BIN / "prefect"), "deployment", "run", DEPLOYMENT, *params, "--watch", "--watch-timeout", "400"]
    run = subprocess.run(args, cwd=project, env=server.env_for(project), capture_output=True, text=True, timeout=500)
    output = run.stdout + run.stderr
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert found, output + "\n".join(p.read_text()[-3000:] for p in server.logs())
    return run, UUID(found.group(1))


def test_served_deployment_runs_on_demand(server, built_project, tmp_path):
    project = clone(built_project, tmp_path / "project")
    serving = server.start([sys.executable, "-m", "flows.serve"], project, "serve.log", server.env_for(project))
    try:
        with api_client(server) as client:
            wait_until(lambda: _deployment(client) is not None, 120, DEPLOYMENT, server.logs())
            deployment = _deployment(client)
            (schedule,) = deployment.schedules
            assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "UTC")
            assert deployment.parameters["project_dir"] == str(project.resolve())

            run, flow_run_id = _run_and_watch(server, project)
            assert run.returncode == 0, run.stdout + run.stderr
            assert_readme_shows(run.stdout)
            flow_run = client.read_flow_run(flow_run_id)
            assert flow_run.state.is_completed(), flow_run.state
            assert {"params", "fingerprint", "evaluate"} <= set(task_runs(client, flow_run_id))
            assert ARTIFACT_KEYS <= artifact_keys(client, flow_run_id)
            assert_artifacts_readable(server, client, flow_run_id, tmp_path)

            failed, failed_id = _run_and_watch(server, project, "-p", "params_path=missing.yaml")
            assert failed.returncode == 1, failed.stdout + failed.stderr  # what a cron job or CI can mail
            assert client.read_flow_run(failed_id).state.is_failed()
            assert "full-retrain-failure" in artifact_keys(client, failed_id)
            assert "missing.yaml" in (project / "runs" / "last_failure.md").read_text(encoding="utf-8")
    finally:
        from tests.prefect_server import stop

        stop(serving)


def test_work_pool_deployment_runs_on_a_worker(server, built_project, tmp_path):
    """flows/deploy.py: the deployment lives on the server (pool, cron, limit 1); a worker runs it."""
    project = clone(built_project, tmp_path / "project")
    env = server.env_for(project)
    deployed = subprocess.run([sys.executable, "-m", "flows.deploy"], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "prefect worker start --pool grpo-process" in deployed.stdout
    with api_client(server) as client:
        deployment = _deployment(client)
        assert deployment.work_pool_name == "grpo-process"
        assert client.read_work_pool("grpo-process").type == "process"
        assert deployment.global_concurrency_limit.limit == 1  # one full-retrain at a time, shown in the UI
        assert deployment.parameters["project_dir"] == str(project.resolve())
        server.start([str(BIN / "prefect"), "worker", "start", "--pool", "grpo-process", "--limit", "1"], project,
                     "worker.log", {**env, "PREFECT_WORKER_QUERY_SECONDS": "2"})
        run, flow_run_id = _run_and_watch(server, project)
        assert run.returncode == 0, run.stdout + run.stderr + (server.home / "worker.log").read_text()[-4000:]
        flow_run = client.read_flow_run(flow_run_id)
        assert flow_run.state.is_completed() and flow_run.work_pool_name == "grpo-process", flow_run
        assert ARTIFACT_KEYS <= artifact_keys(client, flow_run_id)


def _artifact(client, flow_run_id: UUID, key: str):
    (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
    return found


def assert_artifacts_readable(server, client, flow_run_id: UUID, shots: Path) -> None:
    """Figures are embedded images, tables fit: in the markdown, and (with chromium) in the UI at 1,400 px."""
    figures = _artifact(client, flow_run_id, "training-curves")
    assert figures.data.count("](data:image/png;base64,") == 2 and "http" not in figures.data
    validation = _artifact(client, flow_run_id, "validation-report")
    assert max((len(line) for line in validation.data.splitlines() if line.startswith("|")), default=0) <= MAX_TABLE_LINE
    if CHROMIUM is None:
        return
    ui = server.api.removesuffix("/api")
    with browser(width=1400, height=1000) as page:
        page.goto(f"{ui}/artifacts/artifact/{figures.id}")
        shown = page.wait_for("[...document.images].filter(i => i.src.startsWith('data:image/png') && i.complete"
                              " && i.naturalWidth > 0).length")
        assert shown == 2
        page.screenshot(shots / "training-curves.png")
        page.goto(f"{ui}/artifacts/artifact/{validation.id}")
        page.wait_for("document.body.innerText.includes('Data validation: PASSED')")
        overflowing = page.evaluate("[...document.querySelectorAll('table, pre, li, p')].filter("
                                    "e => e.scrollWidth > e.clientWidth + 1).length")
        page.screenshot(shots / "validation-report.png")
        assert overflowing == 0, f"clipped elements in the validation report at 1,400 px: {shots}"


def assert_readme_shows(printed: str) -> None:
    """The README's block after `prefect deployment run full-retrain/full-retrain --watch` is what it prints."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"\$ prefect deployment run full-retrain/full-retrain --watch\n(.*?)```", readme, re.S)
    assert block, "README.md must show `$ prefect deployment run full-retrain/full-retrain --watch` and its output"
    for line in filter(None, (raw.strip() for raw in block.group(1).splitlines())):
        pattern = re.escape(line).replace(re.escape("<uuid>"), "[0-9a-f-]{36}").replace(re.escape("..."), ".*")
        assert re.search(pattern, printed), (line, printed)
