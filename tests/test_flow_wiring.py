"""flows/full_retrain.py's wiring with stand-in tasks (fast; ``tests/test_flows.py`` runs the real flow, slow):
the fingerprints are refreshed before any stage, every stage gets the flow's ``force``, each waits for the
one before, and a failed stage stops the rest."""

from __future__ import annotations

import pytest
from prefect.states import Completed, Failed

from flows import full_retrain as flow_module


@pytest.fixture
def calls(monkeypatch):
    """Each task replaced by a stand-in that records (name, force, the name of what it waited for)."""
    seen: list[tuple[str, bool | None, str | None]] = []

    def stand_in(name: str, fails: bool = False):
        def run(where, *force, wait_for, return_state):
            assert return_state is True, f"{name}: a failure must come back as a state for the flow to stop on"
            seen.append((name, force[0] if force else None, wait_for[0].name))
            return Failed(name=name, message=f"{name} broke") if fails else Completed(name=name, data=True)
        return run

    def use_params(project_dir, params_path, return_state):
        assert return_state is True, "params: a failure must come back as a state for the flow to stop on"
        return Completed(name="params", data=f"{project_dir}/{params_path}")

    monkeypatch.setattr(flow_module, "use_params", use_params)
    monkeypatch.setattr(flow_module, "fingerprint", stand_in("fingerprint"))
    monkeypatch.setattr(flow_module, "STAGES", {name: stand_in(name) for name in flow_module.STAGES})
    monkeypatch.setattr(flow_module, "stopped", lambda stage, state, params_path: f"stopped at {stage}")
    return seen, stand_in


def test_fingerprints_first_then_every_stage_forced_in_order(calls):
    seen, _ = calls
    ran = flow_module.full_retrain.fn(force=True, params_path="p.yaml", project_dir="proj")
    names = ["fingerprint", *flow_module.STAGES]
    assert [name for name, _, _ in seen] == names and list(ran) == names
    assert all(force is True for name, force, _ in seen if name != "fingerprint")
    assert [waited for _, _, waited in seen] == ["params", *names[:-1]]  # each after the one before


def test_a_failed_stage_stops_the_ones_after_it(calls, monkeypatch):
    seen, stand_in = calls
    monkeypatch.setitem(flow_module.STAGES, "sft", stand_in("sft", fails=True))
    assert flow_module.full_retrain.fn(force=False) == "stopped at sft"
    assert [name for name, _, _ in seen] == ["fingerprint", "prepare", "validate", "base", "sft"]
    assert all(force is False for name, force, _ in seen if name != "fingerprint")


def test_a_run_forces_no_stage_unless_asked(calls):
    seen, _ = calls
    flow_module.full_retrain.fn()
    assert all(force is False for name, force, _ in seen if name != "fingerprint")
