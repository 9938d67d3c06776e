"""tasks/: the environment every stage runs in, and how stage files become artifact rows (fast)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.schedule import nightly_cron, schedule_label
from grpo.config import ConfigError, ScheduleConfig, load_config
from tasks.artifacts import _cells, cell, flatten
from tasks.dvc_stage import stage_env
from tasks.markdown import CELL, cells, fit, width_problems
from tasks.notify import for_flow_run
from tasks.workspace import run_folder


def test_stage_env_is_offline_and_runs_the_project_code(tmp_path, monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    env = stage_env(tmp_path)
    assert env["WANDB_DIR"] == str(tmp_path)  # W&B's offline runs stay in the project, not the working folder
    assert (env["DO_NOT_TRACK"], env["DVC_NO_ANALYTICS"], env["PREFECT_SERVER_ANALYTICS_ENABLED"]) == ("1", "1", "false")
    assert env["WANDB_MODE"] == "offline" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["DVC_SITE_CACHE_DIR"].startswith(str(tmp_path))


def test_stage_env_keeps_a_deliberate_online_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert stage_env(tmp_path)["WANDB_MODE"] == "online"


def test_metrics_and_rows_flatten_to_table_cells():
    assert flatten({"sft": {"greedy": {"acc": 0.5}}, "steps": 2}) == {"sft.greedy.acc": 0.5, "steps": 2}
    assert _cells({"name": "I7", "numbers": {"d": 1.0}, "passed": True}) == {
        "name": "I7", "numbers": '{"d": 1.0}', "passed": True}
    assert cell(0.123456789) == 0.1235 and cell(4.76837158203125e-07) == 4.768e-07  # rounded, never to 0
    digest = cell(["63d0f59a60e411e3e4395d9f164149e0c61f056228dc370db08fd7426f197799"])
    assert len(digest) == CELL and digest.endswith("…")


WIDE = "| rule | column | result | detail |\n| --- | --- | --- | --- |\n" + (
    "| balance.ambig.train | ambig_train | pass | observed 0.5, expected between 0.19381378215210276 and "
    "0.8061862178478972 |\n")
NARROW = "| metric | value |\n| --- | --- |\n| loss | 0.5 |\n"


def test_wide_tables_become_lists_that_wrap_and_narrow_ones_stay():
    out = fit(f"# Report\n\n{WIDE}\nafter\n\n{NARROW}")
    assert "- **balance.ambig.train** · column: ambig_train · result: pass · detail: observed 0.5" in out
    assert "| balance.ambig.train" not in out and NARROW in out and out.startswith("# Report\n\n")
    assert out.rstrip().endswith("| loss | 0.5 |") and "\nafter\n" in out
    assert width_problems(out) == [] and fit(out) == out
    assert "---" not in out.split("after")[0], "the separator row is no item"


def test_a_long_heading_is_cut_on_its_line_and_a_lone_pipe_line_is_kept():
    """A heading (any level) cannot continue on the next line: it is cut with an ellipsis. A single line that
    starts with a pipe is no table (no header, no separator) and is left as written, not dropped."""
    for level in ("#", "##", "###"):
        out = fit(f"{level} " + "word " * 30 + "\n")
        assert out.count("\n") == 1 and out.startswith(f"{level} word") and out.rstrip().endswith("…")
        assert len(out.rstrip()) <= 90
    lone = "| " + "x" * 100 + "\n"
    assert fit(lone) == lone


@pytest.mark.parametrize("markdown, problem", [
    (WIDE, "table row"),  # a cell over 40 characters
    ("| " + " | ".join(["x" * 18] * 4) + " |\n| --- | --- | --- | --- |\n", "table row"),  # a row of 85 > 80
    ("word " * 30, "line of 150"),  # prose over 90
    ("- " + "item " * 30, "line of 152"),  # a list item
    ("```\n" + "x " * 45 + "\n```\n", "code line of 90"),  # a code line over 80
])
def test_width_problems_finds_every_kind_of_wide_line_and_fit_mends_it(markdown, problem):
    found = width_problems(markdown)
    assert len(found) == 1 and found[0].startswith(problem), found
    fitted = fit(markdown)
    assert width_problems(fitted) == []
    assert "".join(fitted.split()).replace("`", "") == "".join(markdown.split()).replace("`", "") or problem == "table row"


def test_what_fits_is_left_alone_and_images_are_exempt():
    text = "# T\n\n" + "word " * 17 + "\n\n" + NARROW + "\n```\n" + "x" * 80 + "\n```\n"
    image = "![curve](data:image/png;base64," + "A" * 5000 + ")\n"
    assert width_problems(text + image) == [] and fit(text + image) == text + image
    assert cells("| a | b \\| c |") == ["a", "b \\| c"]  # an escaped pipe stays in its cell
    assert width_problems("| x | " + "a\\|" * 14 + " |\n| --- | --- |\n")  # 42 characters in one cell


def test_a_flow_runs_fix_names_the_params_file_never_a_cli_flag(tmp_path):
    """A flow run takes no --set and no --params: the fix the CLI suggests is rephrased for the file."""
    bad = tmp_path / "configs" / "lr.yaml"
    bad.parent.mkdir()
    bad.write_text("grpo:\n  lr: -1.0\n", encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_config(bad)
    cli = str(raised.value)
    assert "--set grpo.lr=" in cli  # what the CLI says ...
    flow = for_flow_run(cli, "configs/lr.yaml")  # ... and what a flow run says
    assert "--set" not in flow and "grpo.lr" in flow and flow.endswith(f"fix it in {bad}"), flow
    assert for_flow_run("give it with --set model.name_or_path=PATH", "configs/x.yaml") == (
        "give it with `model.name_or_path` in configs/x.yaml")
    assert for_flow_run("/p/.workspaces/x/params.yaml: grpo.lr must be > 0", "configs/x.yaml") == (
        "configs/x.yaml: grpo.lr must be > 0")  # the workspace's params.yaml is written from the run's file
    assert "--params" not in for_flow_run("run from the project root or pass --params PATH", "a.yaml")


def test_the_schedule_label_carries_the_time_zone():
    daily = ScheduleConfig(cron="30 2 * * *", timezone="Europe/Paris")
    assert schedule_label(daily) == "every day at 02:30 (Europe/Paris)"
    assert schedule_label(ScheduleConfig(cron="0 2 * * 1-5")) == "cron 0 2 * * 1-5 (UTC)"
    # a minute or an hour that is no single number: not one time a day
    assert schedule_label(ScheduleConfig(cron="*/15 2 * * *")) == "cron */15 2 * * * (UTC)"
    assert schedule_label(ScheduleConfig(cron="0 */6 * * *")) == "cron 0 */6 * * * (UTC)"
    assert nightly_cron(daily, Path("params.yaml")).slug == "every day at 02:30 (Europe/Paris)"


def test_a_workspace_is_its_own_git_repository_with_the_last_run_committed(tmp_path):
    """`dvc metrics diff` there compares with HEAD: the state the last run left."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / ".gitignore").write_text("/models/\n/.workspaces/\n", encoding="utf-8")
    (project / "params.yaml").write_text("seed: 1\n", encoding="utf-8")
    (project / "configs" / "p.yaml").write_text("extends: ../params.yaml\nseed: 2\n", encoding="utf-8")
    (project / "code.py").write_text("x = 1\n", encoding="utf-8")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the project"]):  # a checkout, as a user's
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project, check=True)
    (project / "metrics" / "key" / "sft").mkdir(parents=True)  # the project's own run: untracked, not ignored
    (project / "metrics" / "key" / "sft" / "loss_final.json").write_text('{"value": 9.0}\n', encoding="utf-8")
    workspace = run_folder(project, project / "configs" / "p.yaml")
    assert not (workspace / "metrics").exists()  # a workspace makes its own outputs

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=workspace, capture_output=True, text=True, check=True).stdout

    assert (workspace / ".git").is_dir() and git("status", "--porcelain") == ""
    assert len(git("log", "--format=%s").splitlines()) == 1 and "no_scm" not in (
        workspace / ".dvc" / "config.local").read_text()
    (workspace / "metrics" / "key" / "sft").mkdir(parents=True)  # what a run leaves
    (workspace / "metrics" / "key" / "sft" / "loss_final.json").write_text('{"value": 1.5}\n', encoding="utf-8")
    (workspace / "models").mkdir()
    (workspace / "models" / "weights.bin").write_bytes(b"0")
    (project / "code.py").write_text("x = 2\n", encoding="utf-8")
    assert run_folder(project, project / "configs" / "p.yaml") == workspace  # the next run
    assert git("show", "HEAD:metrics/key/sft/loss_final.json") == '{"value": 1.5}\n'
    assert git("show", "HEAD:code.py") == "x = 1\n" and (workspace / "code.py").read_text() == "x = 2\n"
    assert "models/weights.bin" not in git("ls-files")  # git-ignored outputs stay out
    assert run_folder(project, project / "configs" / "p.yaml") == workspace
    assert len(git("log", "--format=%s").splitlines()) == 3  # the code change is the third commit's


def test_a_workspace_holds_the_committed_code_the_resolved_params_and_the_projects_cache(tmp_path, monkeypatch):
    """What a workspace starts from: the project's code as git has it (the project's ``dvc.lock`` and a tracked
    file deleted since not among it), the profile's params with ``extends`` resolved, and the project's DVC
    cache; the project's own ``params.yaml``, named relatively from the project, runs in the project."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "params.yaml").write_text("seed: 1\ndata:\n  n_train: 40\n", encoding="utf-8")
    (project / "configs" / "p.yaml").write_text("extends: ../params.yaml\nseed: 2\n", encoding="utf-8")
    (project / "dvc.lock").write_text("schema: '2.0'\n", encoding="utf-8")
    (project / "gone.py").write_text("y = 1\n", encoding="utf-8")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the project"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project, check=True)
    (project / "gone.py").unlink()  # deleted, the deletion not committed
    workspace = run_folder(project, project / "configs" / "p.yaml")
    assert not (workspace / "dvc.lock").exists() and not (workspace / "gone.py").exists()
    assert yaml.safe_load((workspace / "params.yaml").read_text()) == {"seed": 2, "data": {"n_train": 40}}
    assert f"dir = {project.resolve() / '.dvc' / 'cache'}" in (workspace / ".dvc" / "config.local").read_text()
    monkeypatch.chdir(project)
    assert run_folder(Path("."), Path("params.yaml")) == project.resolve()


def test_every_retried_task_waits_a_number_of_seconds():
    """The task page formats the retry delay as a number: a list of delays shows as "Retry Delay: NaNs"."""
    from flows.full_retrain import STAGES

    retried = {name: task for name, task in STAGES.items() if task.retries}
    assert set(retried) == {"sft", "grpo", "evaluate"}
    assert all(isinstance(task.retry_delay_seconds, int | float) for task in retried.values()), {
        name: task.retry_delay_seconds for name, task in retried.items()}


def test_a_reason_as_wide_as_allowed_is_kept_and_a_wider_one_cut_to_the_width():
    from tasks.notify import REASON_CHARS, one_line

    assert one_line("\n  " + "r" * REASON_CHARS + "\nsecond line") == "r" * REASON_CHARS
    cut = one_line("r" * (REASON_CHARS + 1))
    assert cut == "r" * (REASON_CHARS - 1) + "…" and len(cut) == REASON_CHARS


def test_commit_all_says_whether_it_committed(tmp_path):
    """True for the first commit and for a change; False when nothing changed since the last one."""
    from tasks.workspace import commit_all

    (tmp_path / "a.txt").write_text("1\n", encoding="utf-8")
    assert commit_all(tmp_path, "first") is True
    assert commit_all(tmp_path, "nothing new") is False
    (tmp_path / "a.txt").write_text("2\n", encoding="utf-8")
    assert commit_all(tmp_path, "a change") is True
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert log.splitlines() == ["a change", "first"]
