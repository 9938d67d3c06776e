"""flows/schedule.py: the nightly cron of params.yaml, refused with the key, the value and the fix; what
flows/deploy.py and flows/serve.py hand Prefect."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.deploy import deploy
from flows.schedule import nightly_cron
from grpo.config import ConfigError, ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_configured_cron_becomes_prefects_schedule():
    cron = nightly_cron(ScheduleConfig(cron="30 3 * * 1-5", timezone="Europe/Paris"), Path("params.yaml"))
    assert (cron.cron, cron.timezone) == ("30 3 * * 1-5", "Europe/Paris")


@pytest.mark.parametrize("cron", ["bogus", "0 2 * *", "61 2 * * *"])
def test_a_bad_cron_names_the_file_key_value_and_fix(cron):
    with pytest.raises(ConfigError) as err:
        nightly_cron(ScheduleConfig(cron=cron), Path("proj/params.yaml"))
    message = str(err.value)
    assert message.startswith(f"proj/params.yaml: schedule.cron {cron!r} is refused by Prefect")
    assert "e.g. '0 2 * * *'" in message


def test_deploy_refuses_a_bad_cron_before_touching_the_server(tmp_path, monkeypatch):
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    params["schedule"]["cron"] = "every night"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    monkeypatch.setattr("flows.deploy.ensure_work_pool", lambda *_: pytest.fail("the server was contacted"))
    with pytest.raises(ConfigError, match=r"schedule\.cron 'every night'"):
        deploy(tmp_path)


def test_the_deployment_and_the_served_runner_carry_the_schedules_force_and_one_run_at_a_time(tmp_path,
                                                                                              monkeypatch):
    """What ``deploy`` and ``serve`` hand Prefect (the server's side stood in for; tests/test_serve.py runs a
    real one): the cron, the run's parameters with ``schedule.force``, one run at a time."""
    import flows.deploy as deploy_module
    import flows.serve as serve_module

    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    params["schedule"]["force"] = True
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    handed = {}
    for module in (deploy_module, serve_module):
        monkeypatch.setattr(module, "drop_other_schedules", lambda *args: None)
    monkeypatch.setattr(deploy_module, "ensure_work_pool", lambda *args: None)
    monkeypatch.setattr(serve_module, "release", lambda *args: True)
    deployable = type("Deployable", (), {"deploy": lambda self, **kwargs: handed.setdefault("deploy", kwargs)})
    monkeypatch.setattr(deploy_module.full_retrain, "from_source", lambda **kwargs: deployable())
    monkeypatch.setattr(serve_module.full_retrain, "serve", lambda **kwargs: handed.setdefault("serve", kwargs))
    deploy(tmp_path)
    serve_module.serve(tmp_path)
    want = {"force": True, "params_path": "params.yaml", "project_dir": str(tmp_path.resolve())}
    assert handed["deploy"]["parameters"] == want and handed["serve"]["parameters"] == want
    assert handed["deploy"]["concurrency_limit"] == 1 and handed["serve"]["limit"] == 1
    cron = params["schedule"]["cron"]
    assert [s.cron for s in handed["deploy"]["schedules"]] == [cron] == [s.cron for s in handed["serve"]["schedules"]]
