"""grpo/pipeline.py: every stage in order, each one's key metrics written under the stage's name (the name
``dvc metrics show`` and the Prefect UI read), and a failing stage stops the ones after it. The stages here
are stand-ins; ``tests/test_flows.py`` and ``tests/test_dvc_pipeline.py`` run the real ones."""

from __future__ import annotations

import sys
import types

from grpo import pipeline
from grpo.config import config_from_dict
from grpo.provenance import stages
from grpo.provenance.stages import StageSpec


def _stand_ins(monkeypatch, codes: dict[str, int]) -> list[str]:
    """Stages named as the real ones whose command differs from the name (``grpo`` runs ``grpo train``),
    each a module whose ``run`` records its call and returns its code."""
    ran: list[str] = []
    specs = {}
    for name, command in (("prepare", "prepare"), ("grpo", "train"), ("evaluate", "evaluate")):
        module = types.ModuleType(f"stand_in_{name}")
        module.run = lambda cfg, name=name: ran.append(name) or codes.get(name, 0)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        specs[name] = StageSpec(name, command, (module.__name__,), (), ())
    monkeypatch.setattr(stages, "STAGES", specs)
    return ran


def test_each_stage_runs_in_order_and_its_key_metrics_go_under_its_name(monkeypatch, capsys):
    ran = _stand_ins(monkeypatch, {})
    written: list[str] = []
    monkeypatch.setattr(pipeline, "write_key_metrics", lambda cfg, stage: written.append(stage))
    assert pipeline.run(config_from_dict({})) == 0
    assert ran == written == ["prepare", "grpo", "evaluate"]
    assert capsys.readouterr().out.startswith("pipeline: prepare ")


def test_a_failing_stage_stops_the_pipeline_with_its_code(monkeypatch, capsys):
    ran = _stand_ins(monkeypatch, {"grpo": 3})
    monkeypatch.setattr(pipeline, "write_key_metrics", lambda cfg, stage: None)
    assert pipeline.run(config_from_dict({})) == 3
    assert ran == ["prepare", "grpo"]
    assert "pipeline: stage grpo exited 3; later stages not run" in capsys.readouterr().out
