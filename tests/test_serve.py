"""The deployments against a real Prefect server: served (flows/serve.py) and on a work pool (flows/deploy.py).

One ``prefect server start`` on a free 127.0.0.1 port for the module (tests/prefect_server.py). Each
test works in a clone of the built tiny project, so a run proves the wiring (deployment, runner or
worker, flow, tasks, DVC, artifacts) in seconds: DVC finds every stage up to date.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.browser import CHROMIUM, browser
from tests.prefect_runs import ARTIFACT_KEYS, artifact_keys, task_runs, width_report
from tests.prefect_server import BIN, running_server, wait_until
from tests.processes import stop
from tests.project_copy import ROOT, clone, missing_stage_modules, write_params

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
            assert schedule.slug == "every day at 02:00 (UTC)"  # what the deployment page shows
            assert deployment.parameters["project_dir"] == str(project.resolve())
            assert f"pid {serving.pid} on " in deployment.description and not deployment.paused

            run, flow_run_id = _run_and_watch(server, project)
            assert run.returncode == 0, run.stdout + run.stderr
            assert_readme_shows(run.stdout)
            flow_run = client.read_flow_run(flow_run_id)
            assert flow_run.state.is_completed(), flow_run.state
            assert {"params", "fingerprint", "evaluate"} <= set(task_runs(client, flow_run_id))
            assert ARTIFACT_KEYS <= artifact_keys(client, flow_run_id)
            assert width_report(client, flow_run_id) == {}
            assert_artifacts_readable(server, client, flow_run_id, tmp_path)

            failed, failed_id = _run_and_watch(server, project, "-p", "params_path=missing.yaml")
            assert failed.returncode == 1, failed.stdout + failed.stderr  # what a cron job or CI can mail
            state = client.read_flow_run(failed_id).state
            assert state.is_failed() and state.message.startswith("params failed: missing.yaml: no such params")
            assert state.name.startswith("Failed at params: missing.yaml: no such params file") and "\n" not in (
                state.message)
            printed = " ".join(failed.stdout.split())  # rich wraps at 80 columns without a terminal
            assert f"Flow run finished in state '{state.name}'." in printed, failed.stdout  # --watch: why
            assert "Traceback" not in failed.stdout, failed.stdout
            assert "full-retrain-failure" in artifact_keys(client, failed_id) and width_report(client, failed_id) == {}
            if CHROMIUM is not None:
                with browser(width=UI_WIDTH, height=1000) as page:
                    assert_fits_in_ui(page, server.api.removesuffix("/api"),
                                      _artifact(client, failed_id, "full-retrain-failure"), "Why:",
                                      tmp_path / "full-retrain-failure.png")
            report = (project / "runs" / "last_failure.md").read_text(encoding="utf-8")
            assert report.startswith("# full-retrain failed at params\n\n**Why:** missing.yaml: no such params")
            relaunch = f"`prefect deployment run {DEPLOYMENT} -p params_path=missing.yaml`"  # as it was launched
            assert relaunch in " ".join(report.split()), report
    finally:
        stop(serving)


def _described(client, text: str) -> bool:
    deployment = _deployment(client)
    return deployment is not None and text in (deployment.description or "")


def test_a_stopped_serve_says_so_and_a_restart_keeps_the_deployment_served(server, built_project, tmp_path):
    """Two `make serve` overlapping on a restart: the old one's stop leaves the new one's deployment alone;
    the last one's stop pauses it and its description says it is not served."""
    project = clone(built_project, tmp_path / "project")
    old = server.start([sys.executable, "-m", "flows.serve"], project, "serve-old.log", server.env_for(project))
    new = None
    try:
        with api_client(server) as client:
            wait_until(lambda: _described(client, f"pid {old.pid} on "), 120, "the old serve", server.logs())
            new = server.start([sys.executable, "-m", "flows.serve"], project, "serve-new.log",
                               server.env_for(project))
            wait_until(lambda: _described(client, f"pid {new.pid} on "), 120, "the new serve", server.logs())
            stop(old)
            assert old.returncode is not None
            deployment = _deployment(client)
            assert not deployment.paused and f"pid {new.pid} on " in deployment.description, deployment
            stop(new)
            deployment = _deployment(client)
            assert deployment.paused, deployment
            assert deployment.description.startswith("Not served: `make serve` (pid ") and (
                f"pid {new.pid} on " in deployment.description), deployment.description
            (schedule,) = deployment.schedules  # one schedule, however many times it was served
    finally:
        for proc in (old, new):
            if proc is not None:
                stop(proc)


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
        assert deployment.description.startswith("On work pool grpo-process"), deployment.description

        write_params(project, {"schedule": {"cron": "30 3 * * *", "timezone": "Europe/Paris"}})
        again = subprocess.run([sys.executable, "-m", "flows.deploy"], cwd=project, env=env, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        (schedule,) = _deployment(client).schedules  # the new schedule replaces the old one
        assert (schedule.schedule.cron, schedule.slug) == ("30 3 * * *", "every day at 03:30 (Europe/Paris)")


def _artifact(client, flow_run_id: UUID, key: str):
    (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
    return found


UI_WIDTH = 1280
"""The window the artifacts must fit without horizontal scrolling (tasks/markdown.py's bounds)."""
OVERFLOWING = ("[...document.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1"
               " && ['auto', 'scroll', 'hidden'].includes(getComputedStyle(e).overflowX))"
               ".map(e => `${e.tagName}.${e.className} ${e.scrollWidth} > ${e.clientWidth}`)")
"""Every element whose content is wider than its box and scrolls or is cut: a table's or a code block's
box scrolls sideways (the UI wraps neither cells nor code lines)."""


def assert_fits_in_ui(page, ui: str, artifact, shown_when: str, shot: Path) -> None:
    """The artifact's page at ``UI_WIDTH`` px: no table, code block, list item or paragraph is clipped."""
    page.goto(f"{ui}/artifacts/artifact/{artifact.id}")
    page.wait_for(f"document.body.innerText.includes({json.dumps(shown_when)})")
    overflowing = page.evaluate(OVERFLOWING)
    page.screenshot(shot)
    assert overflowing == [], f"{artifact.key} scrolls sideways at {UI_WIDTH} px ({shot}): {overflowing}"


def assert_artifacts_readable(server, client, flow_run_id: UUID, shots: Path) -> None:
    """Figures are embedded images, text fits: in the markdown, and (with chromium) in the UI at 1,280 px."""
    figures = _artifact(client, flow_run_id, "training-curves")
    assert figures.data.count("](data:image/png;base64,") == 2 and "http" not in figures.data
    if CHROMIUM is None:
        return
    ui = server.api.removesuffix("/api")
    with browser(width=UI_WIDTH, height=1000) as page:
        page.goto(f"{ui}/artifacts/artifact/{figures.id}")
        shown = page.wait_for("[...document.images].filter(i => i.src.startsWith('data:image/png') && i.complete"
                              " && i.naturalWidth > 0).length")
        assert shown == 2
        page.screenshot(shots / "training-curves.png")
        for key, shown_when in (("validation-report", "Data validation: PASSED"), ("preflight-checks", "passed"),
                                ("preflight-details", "Pre-flight"), ("eval-report", "Evaluation"),
                                ("eval-details", "Evaluation"), ("grpo-metrics", "reward_std")):
            assert_fits_in_ui(page, ui, _artifact(client, flow_run_id, key), shown_when, shots / f"{key}.png")


def assert_readme_shows(printed: str) -> None:
    """The README's block after `prefect deployment run full-retrain/full-retrain --watch` is what it prints."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"\$ prefect deployment run full-retrain/full-retrain --watch\n(.*?)```", readme, re.S)
    assert block, "README.md must show `$ prefect deployment run full-retrain/full-retrain --watch` and its output"
    for line in filter(None, (raw.strip() for raw in block.group(1).splitlines())):
        pattern = re.escape(line).replace(re.escape("<uuid>"), "[0-9a-f-]{36}").replace(re.escape("..."), ".*")
        assert re.search(pattern, printed), (line, printed)
