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
from tasks.markdown import width_problems
from tasks.retry import RETRY_DELAY_S
from tasks.train import Progress, train
from tasks.workspace import WORKSPACES_DIR
from tests.prefect_runs import ARTIFACT_KEYS, artifact_keys, artifacts, task_runs, width_report
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
        retried = runs["evaluate"]
        assert retried.run_count == 2 and retried.state.is_completed()
        assert retried.state.name == "Ran on attempt 2" and retried.name == "evaluate: ran on attempt 2"
        assert "attempt 1 failed: the stage command was killed by signal 9 (SIGKILL)" in retried.state.message
        delay = retried.empirical_policy.retry_delay
        assert isinstance(delay, int | float) and delay == RETRY_DELAY_S  # a number: the UI shows "30s", not "NaNs"
        assert all(run.run_count == 1 for name, run in runs.items() if name != "evaluate")
        assert {runs[name].name for name in ("sft", "grpo")} == {"sft: ran", "grpo: ran"}  # the graph's labels
        assert ARTIFACT_KEYS <= artifact_keys(client, flow_run_id)
        assert width_report(client, flow_run_id) == {}  # every artifact within 1,280 px
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
    assert oneoff.is_failed() and oneoff.message.startswith("validate failed: "), oneoff.message
    assert oneoff.name.startswith("Failed at validate: data validation failed") and len(oneoff.name) <= 100
    assert "text.template_slots" in oneoff.message and "\n" not in oneoff.message, oneoff.message
    assert (project / "params.yaml").read_bytes() == params and (project / "dvc.lock").read_bytes() == lock
    assert_failure_explained(oneoff, project, "validate")
    bad_value = _bad_params_value(project)
    assert bad_value.is_failed() and bad_value.message.startswith("params failed: "), bad_value.message
    assert "grpo.lr" in bad_value.message and "params_lr.yaml" in bad_value.message, bad_value.message
    assert "--set" not in bad_value.message  # a flow run cannot take it: the fix names the file
    assert_failure_explained(bad_value, project, "params")

    again = full_retrain(project_dir=str(project), return_state=True)
    assert again.is_completed(), again.message
    assert again.result() == {name: name == "fingerprint" for name in STAGES}  # DVC: nothing is stale
    assert (project / "params.yaml").read_bytes() == params and (project / "dvc.lock").read_bytes() == lock
    assert not (project / "runs" / "last_failure.md").exists()
    with get_client(sync_client=True) as client:
        runs = task_runs(client, again.state_details.flow_run_id)
        assert {name: runs[name].state.name for name in STAGES} == {
            name: "Ran" if name == "fingerprint" else "Skipped" for name in STAGES}
        assert {runs[name].name for name in STAGES} == {"fingerprint: ran"} | {
            f"{name}: skipped" for name in STAGES if name != "fingerprint"}  # the graph tells them apart
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
        assert "\n" not in runs["validate"].state.message and runs["validate"].name == "validate: failed"
        keys = artifact_keys(client, state.state_details.flow_run_id)
        assert {"validation-report", "full-retrain-failure"} <= keys, keys
        assert width_report(client, state.state_details.flow_run_id) == {}
    return state


def _bad_params_value(project: Path):
    """A one-off run whose params file has a value the config refuses: it fails at the params task."""
    (project / "params_lr.yaml").write_text("extends: params.yaml\ngrpo:\n  lr: -1.0\n", encoding="utf-8")
    return full_retrain(project_dir=str(project), params_path="params_lr.yaml", return_state=True)


def assert_failure_explained(state, project: Path, stage: str) -> None:
    """The reason in one line first, wherever it is read: state, artifact, runs/last_failure.md, logs."""
    reason = state.message.split(": ", 1)[1]
    report = (project / "runs" / "last_failure.md").read_text(encoding="utf-8")
    # The report's prose is wrapped to the UI's width: the reason reads the same whatever the line breaks.
    heading, why = report.split("\n\n", 1)
    assert heading == f"# full-retrain failed at {stage}", report[:400]
    assert " ".join(why.split()).startswith(" ".join(f"**Why:** {reason[:60]}".split())), report[:400]
    assert "Traceback" not in report.split("## Details")[0] and width_problems(report) == [], report
    with get_client(sync_client=True) as client:
        (artifact,) = [a for a in artifacts(client, state.state_details.flow_run_id) if a.key == "full-retrain-failure"]
        assert artifact.data == report
        errors = [log.message for log in _logs(client, state.state_details.flow_run_id) if log.level >= logging.ERROR]
    first = next(m for m in errors if "Traceback" in m or reason[:40] in m)
    assert reason[:40] in first and "Traceback" not in first, errors  # the reason before any traceback
    assert any(m.startswith(f"full-retrain stopped: {state.message}") for m in errors), errors


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
