"""flows/full_retrain.py under Prefect's test harness: end to end, a retried failure, a data gate stop.

Real Prefect (a temporary server and SQLite), real DVC, the tiny params of tests/project_copy.py.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path
from uuid import UUID

import pytest
import yaml
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId, LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker
from prefect.testing.utilities import prefect_test_harness

from flows.full_retrain import full_retrain
from tasks.dvc_stage import FAIL_ONCE_ENV
from tasks.train import Progress, train
from tasks.workspace import WORKSPACES_DIR
from tests.prefect_runs import ARTIFACT_KEYS, artifact_keys, task_runs
from tests.project_copy import clone, copy_project, merge, missing_stage_modules

STAGES = ("fingerprint", "prepare", "validate", "base", "sft", "preflight", "grpo", "evaluate")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_stage_modules()),
                       reason=f"stage modules not written yet: {', '.join(missing_stage_modules())}"),
]


@pytest.fixture(scope="module")
def harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def _broken_halueval(count: int = 24) -> str:
    """HaluEval QA rows that load fine but keep a ``NAME1`` template slot (rule text.template_slots)."""
    rows = [{"knowledge": f"Town {i} was founded by NAME1 Venn in {1800 + i}.", "question": f"Who founded town {i}?",
             "right_answer": "NAME1 Venn", "hallucinated_answer": f"Otto Marsh {i}"} for i in range(count)]
    return "".join(json.dumps(row) + "\n" for row in rows)


def _logs(client, flow_run_id) -> list:
    """Every log record of one flow run (flushed to the API first), oldest first."""
    APILogWorker.drain_all(timeout=10)
    return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_full_retrain_runs_end_to_end_and_retries_a_transient_failure(harness, tmp_path, monkeypatch):
    """Real kill, real retry, the pipeline as the graph; a one-off params run leaves params.yaml alone."""
    project = copy_project(tmp_path / "project")
    monkeypatch.setenv(FAIL_ONCE_ENV, "evaluate")
    state = full_retrain(project_dir=str(project), return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == dict.fromkeys(STAGES, True)
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = task_runs(client, flow_run_id)
        assert set(runs) == {"params", *STAGES}
        assert runs["evaluate"].run_count == 2 and runs["evaluate"].state.is_completed()
        assert runs["evaluate"].state.name == "Ran on attempt 2"
        assert all(run.run_count == 1 for name, run in runs.items() if name != "evaluate")
        assert ARTIFACT_KEYS <= artifact_keys(client, flow_run_id)
        chain = ["params", *STAGES]  # the graph is the pipeline: each stage waits for the one before
        for upstream, stage in zip(chain, chain[1:], strict=False):
            inputs = runs[stage].task_inputs
            assert [ref.id for ref in inputs["wait_for"]] == [runs[upstream].id], (stage, inputs)
            assert all(not refs for key, refs in inputs.items() if key != "wait_for"), (stage, inputs)
        logs = _logs(client, flow_run_id)
        errors = [log.message for log in logs if log.level >= logging.ERROR]
        bars = [log.message for log in logs if re.match(r"sft:\s+\d+%\|", log.message)]
        assert len(bars) == 2, bars  # SFT's 2 steps take < 10 s (TQDM_MININTERVAL): its first and last line only
        assert any("stage evaluate failed on attempt 1" in m and "killed by signal 9 (SIGKILL)" in m
                   and "transient" in m for m in errors), errors
    assert (project / "models" / "grpo" / "lineage.json").is_file()

    monkeypatch.delenv(FAIL_ONCE_ENV)
    params, lock = (project / "params.yaml").read_bytes(), (project / "dvc.lock").read_bytes()
    oneoff = _one_off_broken_params(project)
    assert oneoff.is_failed() and "text.template_slots" in oneoff.message, oneoff.message
    assert (project / "params.yaml").read_bytes() == params and (project / "dvc.lock").read_bytes() == lock
    assert (project / "runs" / "last_failure.md").is_file()  # the failure hook's trace

    again = full_retrain(project_dir=str(project), return_state=True)
    assert again.is_completed(), again.message
    assert again.result() == {name: name == "fingerprint" for name in STAGES}  # DVC: nothing is stale
    assert (project / "params.yaml").read_bytes() == params and (project / "dvc.lock").read_bytes() == lock
    assert not (project / "runs" / "last_failure.md").exists()
    with get_client(sync_client=True) as client:
        runs = task_runs(client, again.state_details.flow_run_id)
        assert {name: runs[name].state.name for name in STAGES} == {
            name: "Ran" if name == "fingerprint" else "Skipped" for name in STAGES}
        commands = [m.removeprefix("$ ") for m in (log.message for log in _logs(client, again.state_details.flow_run_id))
                    if m.startswith("$ cd ")]
    assert len(commands) == len(STAGES)
    pasted = subprocess.run(["bash", "-c", commands[-1]], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=300)  # pasted into a bare shell as it is
    assert pasted.returncode == 0 and "didn't change, skipping" in pasted.stdout + pasted.stderr, pasted


def _one_off_broken_params(project: Path):
    """A one-off run with a params file whose data breaks a rule: it fails at validate, in its workspace."""
    tree = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    broken = merge(tree, {"data": {"hallucination_source": "halueval", "hallucination_path": "broken_halueval.jsonl"}})
    (project / "params_broken.yaml").write_text(yaml.safe_dump(broken), encoding="utf-8")
    (project / "broken_halueval.jsonl").write_text(_broken_halueval(), encoding="utf-8")
    state = full_retrain(project_dir=str(project), params_path="params_broken.yaml", return_state=True)
    workspace = project / WORKSPACES_DIR / "params_broken"
    assert yaml.safe_load((workspace / "params.yaml").read_text(encoding="utf-8")) == broken  # what DVC read there
    assert (workspace / "data" / "processed").is_dir() and not (workspace / "models").exists()
    with get_client(sync_client=True) as client:
        runs = task_runs(client, state.state_details.flow_run_id)
        assert set(runs) == {"params", "fingerprint", "prepare", "validate"}
        assert runs["validate"].run_count == 1 and runs["validate"].state.is_failed()
        keys = artifact_keys(client, state.state_details.flow_run_id)
        assert {"validation-report", "full-retrain-failure"} <= keys, keys
    return state


def test_force_retrains_grpo_from_scratch(harness, built_project, tmp_path):
    """force=true: the persisted final checkpoint is not resumed; GRPO trains again from step 1."""
    project = clone(built_project, tmp_path / "project")
    run_dir = project / "runs" / "default"
    assert (run_dir / "metrics.jsonl").is_file() and list(run_dir.glob("checkpoint-*"))  # what it could resume

    @flow
    def forced_grpo() -> bool:
        return train(str(project), True, return_state=True).result()

    state = forced_grpo(return_state=True)
    assert state.is_completed() and state.result() is True, state.message
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # one fresh run, not the old lines plus a resume
    with get_client(sync_client=True) as client:
        messages = [log.message for log in _logs(client, state.state_details.flow_run_id)]
    assert any("force: removing" in m for m in messages), messages
    assert not any("grpo: resuming from" in m for m in messages), messages
    assert any("Running stage 'grpo'" in m for m in messages), messages


def test_grpo_progress_is_updated_only_when_a_step_is_logged(harness, tmp_path):
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)

    @flow
    def watch() -> tuple[list[bool], str]:
        progress = Progress(run_dir, steps=4)
        sent = [progress.poll(), progress.poll()]  # nothing logged yet: nothing sent
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.0}) + "\n", encoding="utf-8")
        sent += [progress.poll(), progress.poll(), progress.poll()]
        with (run_dir / "metrics.jsonl").open("a", encoding="utf-8") as out:
            out.write(json.dumps({"step": 2, "reward": 0.5}) + "\n")
        sent.append(progress.poll())
        return sent, str(progress.id)

    sent, artifact_id = watch()
    assert sent == [False, False, True, False, False, True]
    with get_client(sync_client=True) as client:
        assert client.read_artifacts(
            artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[UUID(artifact_id)])))[0].data == 50.0
