"""grpo/train/selection.py: the choice on planted curves, the carve, and (slow) a real tiny run that picks
the planted best checkpoint and picks it again after a kill and resume."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import config_from_dict
from grpo.train.selection import SelectionError, carve, choose, due, evaluations, score_key
from tests.tiny_project import prepared_project

SFT = {"ambiguous": 0.30, "disambiguated": 0.60, "answerable": 0.80, "unanswerable": 0.40}


def planted(**changes: float) -> dict[str, float]:
    return {kind: SFT[kind] + changes.get(kind, 0.0) for kind in SFT}


# (step, accuracy per kind): a trade with the best mean (step 30) must lose to a small gain everywhere.
CURVE = [
    (10, planted(ambiguous=0.40, disambiguated=-0.20)),  # worst -0.20: a trade
    (20, planted(ambiguous=0.10, disambiguated=0.05, answerable=0.05, unanswerable=0.10)),  # worst +0.05
    (30, planted(ambiguous=0.60, unanswerable=0.50, disambiguated=-0.05)),  # best mean, worst -0.05
    (40, planted(ambiguous=0.05, disambiguated=0.05, answerable=0.05, unanswerable=0.05)),  # same worst, less mean
]


def test_a_trade_cannot_win_the_choice():
    choice = choose(CURVE, SFT)
    assert choice.index == 20 and choice.worst == pytest.approx(0.05) and choice.mean == pytest.approx(0.075)
    assert choice.reason.startswith("step 20: its worst kind changed +0.050 against SFT on the validation split")
    assert "10: -0.200" in choice.reason and "30: -0.050" in choice.reason


def test_ties_go_to_the_larger_mean_then_the_later_step():
    """Where the validation split cannot tell checkpoints apart, the last one stands, as without selection."""
    same = planted(ambiguous=0.1, disambiguated=0.1, answerable=0.1, unanswerable=0.1)
    assert choose([(5, same), (10, same)], SFT).index == 10
    assert choose([(5, planted(ambiguous=0.2, disambiguated=0.1, answerable=0.1, unanswerable=0.1)), (10, same)],
                  SFT).index == 5
    assert choose([(5, same), (10, planted(ambiguous=0.1, disambiguated=0.1, answerable=0.1, unanswerable=0.2))],
                  SFT).index == 10
    with pytest.raises(SelectionError, match="no evaluated step"):
        choose([], SFT)


def test_evaluations_are_read_from_the_run_history():
    history = [{"step": 1, "reward": 0.1}, {"step": 2, score_key("ambiguous"): 0.5, score_key("answerable"): 1.0}]
    assert evaluations(history) == [(2, {"ambiguous": 0.5, "answerable": 1.0})]


def test_pruning_spares_the_best_step_so_far():
    """``Selector.keep``: the step the choice would take now (CURVE's 20), not the last one."""
    from grpo.train.selection import Selector

    selector = Selector.__new__(Selector)  # the scores are given: no model to score with
    selector.validation, selector.sft = [{"id": "v"}], SFT
    history = [{"step": step, **{score_key(kind): value for kind, value in scores.items()}} for step, scores in CURVE]
    assert selector.keep(history) == (20,) and selector.keep(history[:1]) == (10,)
    assert selector.keep([{"step": 1, "reward": 0.0}]) == ()  # nothing evaluated yet


def test_carve_and_due_follow_the_params():
    cfg = config_from_dict({"grpo": {"steps": 12, "selection": {"records": 4, "every": 5}}})
    pool = [{"id": f"f{i}", "task": "fairness", "context_condition": "ambig" if i % 2 else "disambig"}
            for i in range(8)] + [{"id": f"h{i}", "task": "hallucination", "answerable": i % 2 == 0} for i in range(8)]
    train, validation = carve(cfg, pool)
    assert len(validation) == 4 and len(train) == 12
    assert [s for s in range(1, 13) if due(cfg, s)] == [5, 10, 12]
    last = config_from_dict({"grpo": {"selection": {"rule": "last"}}})
    assert carve(last, pool) == (pool, []) and not due(last, 40)
    greedy = config_from_dict({"grpo": {"selection": {"records": 16}}})
    with pytest.raises(SelectionError, match="leaves 0 of 16 GRPO records to train on"):
        carve(greedy, pool)


# --------------------------------------------------------------------------- a real tiny run (slow)

PLANTED_RUN = """
import json, sys
from grpo.train import selection
SFT = json.loads(sys.argv[1]); CURVE = {int(k): v for k, v in json.loads(sys.argv[2]).items()}
def planted(step, records, reference=False):
    return SFT if reference else CURVE[step.scheduler.last_epoch]  # the optimizer steps taken so far
selection.kind_accuracy = planted
from grpo.cli import main
sys.exit(main(sys.argv[3:]))
"""
# Steps 2, 4 and 6 evaluated: 2 trades, 4 gains a little everywhere, 6 trades with the best mean.
RUN_CURVE = {2: CURVE[0][1], 4: CURVE[1][1], 6: CURVE[2][1]}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return prepared_project(
        tmp_path_factory.mktemp("selection"),
        grpo={"steps": 6, "selection": {"records": 8, "every": 2}},
        checkpoint={"every": 1, "keep_last": 1},  # every older checkpoint pruned, but the best
    )


def _copy(params: Path, dest: Path) -> Path:
    shutil.copytree(params.parent, dest)
    text = (dest / "params.yaml").read_text().replace(str(params.parent), str(dest))
    (dest / "params.yaml").write_text(text)
    return dest / "params.yaml"


def _train(params: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-c", PLANTED_RUN, json.dumps(SFT), json.dumps(RUN_CURVE),
               "train", "--params", str(params), *extra]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finished(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=900)[0].decode()
    assert proc.returncode == 0, output
    return output


def adapter(params: Path) -> dict[str, torch.Tensor]:
    return load_file(str(params.parent / "models" / "grpo" / "adapter_model.safetensors"))


def checkpoint_weights(params: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(params.parent / "runs" / "tiny" / f"checkpoint-{step:08d}" / "model.safetensors"))


def same_weights(model: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor]) -> bool:
    """The saved adapter's tensors are the checkpoint's (peft's file drops the adapter name ``.default``)."""
    named = {key.replace(".default", ""): value for key, value in checkpoint.items()}
    assert named.keys() == model.keys()
    return all(torch.equal(model[key], named[key]) for key in model)


@pytest.mark.slow
def test_a_real_run_picks_the_planted_best_and_picks_it_again_after_a_kill(project, tmp_path):
    straight = _copy(project, tmp_path / "straight")
    output = _finished(_train(straight))
    assert "grpo: models/grpo is step 4: its worst kind changed +0.050" in output
    run_dir = straight.parent / "runs" / "tiny"
    kept = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert kept == ["checkpoint-00000004", "checkpoint-00000006"]  # keep_last 1, and the best
    assert same_weights(adapter(straight), checkpoint_weights(straight, 4))
    assert not same_weights(adapter(straight), checkpoint_weights(straight, 6))
    summary = json.loads((straight.parent / "metrics" / "grpo.json").read_text())
    assert summary["selected_step"] == 4 and summary["selection"]["reason"].startswith("step 4:")
    record = json.loads((run_dir / "selection.json").read_text())
    assert [e["step"] for e in record["evaluations"]] == [2, 4, 6] and record["sft"] == SFT
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if score_key("ambiguous") in line] == [2, 4, 6]

    killed = _copy(project, tmp_path / "killed")
    proc = _train(killed)
    state = killed.parent / "runs" / "tiny" / "checkpoint-00000005" / "state.json"
    deadline = time.monotonic() + 600
    while not state.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint of step 5 appeared"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # after step 4 was chosen as the best so far, before the end
    proc.wait()
    assert not (killed.parent / "models" / "grpo").exists(), "the run finished before it was killed"
    output = _finished(_train(killed))
    assert "resuming from" in output and "models/grpo is step 4" in output
    a, b = adapter(straight), adapter(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = json.loads((killed.parent / "runs" / "tiny" / "selection.json").read_text())
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in record.items() if k != "seconds"}


@pytest.mark.slow
def test_select_last_keeps_the_last_step_and_every_prompt(project, tmp_path):
    params = _copy(project, tmp_path / "last")
    output = _finished(_train(params, "--select", "last"))
    assert "models/grpo is" not in output
    assert same_weights(adapter(params), checkpoint_weights(params, 6))
    summary = json.loads((params.parent / "metrics" / "grpo.json").read_text())
    assert summary["selected_step"] == 6 and summary["selection"] is None
    assert not (params.parent / "runs" / "tiny" / "selection.json").exists()


def _moved_step(tiny_model, tiny_tokenizer):
    from tests.steps import make_step
    from tests.weights import fill_adapter, spread_weights

    generator = torch.Generator().manual_seed(0)
    spread_weights(tiny_model, generator)
    step = make_step(tiny_model, tiny_tokenizer)
    fill_adapter(step.model, generator)  # an adapter trained away from the SFT weights
    return step


def test_the_sft_baseline_is_scored_with_the_adapter_off_and_the_policy_with_it_on(tiny_model, tiny_tokenizer,
                                                                                    monkeypatch):
    """The SFT scores a resumed run compares with come from the SFT weights, not the resumed adapter."""
    from grpo.model.lora import adapter_disabled
    from grpo.train import selection
    from tests.steps import step_records

    step = _moved_step(tiny_model, tiny_tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    seen = []

    def replies(_step, model, records):  # what the replies would be drawn from
        seen.append(model(input_ids=ids).logits)
        return ["x"] * len(records)

    monkeypatch.setattr(selection, "_replies", replies)
    with torch.no_grad():
        selection.kind_accuracy(step, step_records(), reference=True)
        selection.kind_accuracy(step, step_records())
        with adapter_disabled(step.model):
            sft = step.model(input_ids=ids).logits
        policy = step.model(input_ids=ids).logits
    assert (sft - policy).abs().max() > 1e-3
    assert torch.equal(seen[0], sft) and torch.equal(seen[1], policy)


def test_the_validation_replies_are_greedy(tiny_model, tiny_tokenizer):
    """The same replies under another seed: the choice follows the checkpoints, not sampling luck."""
    from grpo.train import selection
    from tests.steps import step_records

    step = _moved_step(tiny_model, tiny_tokenizer)
    reseeded = step.cfg.model_copy(update={"seed": step.cfg.seed + 1})
    first = selection._replies(step, step.model, step_records())
    assert selection._replies(dataclasses.replace(step, cfg=reseeded), step.model, step_records()) == first


# --------------------------------------------------------------------------- the trainer's side, without a run


def _fake_step(num_processes: int = 1, reference=None):
    """What ``kind_accuracy`` reads of a step: the accelerator's place, the policy and its reference."""
    from types import SimpleNamespace

    accelerator = SimpleNamespace(process_index=0, num_processes=num_processes)
    return SimpleNamespace(accelerator=accelerator, model=torch.nn.Linear(2, 2), reference=reference)


def test_a_full_fine_tune_scores_sft_with_its_frozen_copy_and_the_policy_with_the_policy(monkeypatch):
    """``model.lora.enabled: false``: the reference is a frozen copy; only the SFT baseline is scored with it."""
    from grpo.train import selection

    step = _fake_step(reference=torch.nn.Linear(2, 2))
    seen = []
    monkeypatch.setattr(selection, "_replies", lambda _step, model, records: seen.append(model) or ["x"] * len(records))
    monkeypatch.setattr(selection, "_correct", lambda text, record: False)
    records = [{"id": "a", "task": "fairness", "context_condition": "ambig"}]
    selection.kind_accuracy(step, records, reference=True)
    selection.kind_accuracy(step, records)
    assert seen[0] is step.reference and seen[1] is step.model


def test_several_processes_add_their_counts_before_dividing(monkeypatch):
    """Accuracy over every process's answers: 1 right of 2 here, 3 of 4 on the other process -> 4/6."""
    from grpo.train import selection

    records = [{"id": f"a{i}", "task": "fairness", "context_condition": "ambig"} for i in range(4)]
    monkeypatch.setattr(selection, "_replies", lambda _step, model, mine: ["right", "wrong"][: len(mine)])
    monkeypatch.setattr(selection, "_correct", lambda text, record: text == "right")
    monkeypatch.setattr(selection, "gather_object", lambda mine: mine + [{"ambiguous": [3, 4]}])
    scores = selection.kind_accuracy(_fake_step(num_processes=2), records)
    assert scores == {"ambiguous": pytest.approx(4 / 6)}


def test_carve_refuses_a_split_that_takes_every_record_of_one_task():
    """Two fairness records, both set aside (one per kind): GRPO would train on hallucination alone."""
    cfg = config_from_dict({"grpo": {"selection": {"records": 4}}})
    pool = [{"id": "f0", "task": "fairness", "context_condition": "ambig"},
            {"id": "f1", "task": "fairness", "context_condition": "disambig"}]
    pool += [{"id": f"h{i}", "task": "hallucination", "answerable": i % 2 == 0} for i in range(8)]
    with pytest.raises(SelectionError, match=r"leaves 6 of 10 GRPO records to train on \(tasks left: \['hallucination'\]\)"):
        carve(cfg, pool)


def test_finish_loads_the_chosen_checkpoint_not_the_last_one(tmp_path):
    """The policy ends with the weights of the best step (CURVE's 20), saved at step 20, not those of step 40,
    and ``selection.json`` records that choice."""
    from types import SimpleNamespace

    from grpo.train import checkpoint as ckpt
    from grpo.train.rng_state import capture_rng
    from grpo.train.selection import Selector

    models = {}
    for step in (20, 40):
        models[step] = torch.nn.Linear(2, 2)
        ckpt.save_checkpoint(tmp_path, step, model=models[step], optimizer=None, scheduler=None, rng=capture_rng(),
                             history=[], lineage={}, keep_last=5)
    selector = Selector.__new__(Selector)  # the scores are given: no model to score with
    policy = torch.nn.Linear(2, 2)
    selector.cfg = config_from_dict({})
    selector.step, selector.run_dir = SimpleNamespace(model=policy), tmp_path
    selector.validation, selector.sft, selector.sft_seconds = [{"id": "v"}], SFT, 0.0
    history = [{"step": step, **{score_key(kind): value for kind, value in scores.items()}} for step, scores in CURVE]
    summary = selector.finish(history, 40, is_main=True)
    assert summary["step"] == 20
    assert torch.equal(policy.weight, models[20].weight) and torch.equal(policy.bias, models[20].bias)
    assert json.loads((tmp_path / "selection.json").read_text())["step"] == 20


def test_a_run_of_one_task_carves_its_validation_from_that_task():
    """The tasks a carve must leave are those the records hold: fairness alone is no error."""
    cfg = config_from_dict({"grpo": {"selection": {"records": 4}}})
    pool = [{"id": f"f{i}", "task": "fairness", "context_condition": "ambig" if i % 2 else "disambig"}
            for i in range(10)]
    train, validation = carve(cfg, pool)
    assert len(train) == 6 and len(validation) == 4


def test_changes_are_taken_over_the_kinds_both_scored():
    from grpo.train.selection import changes

    assert changes({"ambiguous": 0.5, "answerable": 0.75}, {"ambiguous": 0.25, "unanswerable": 0.5}) == {
        "ambiguous": 0.25
    }


def test_the_greedy_calls_hold_the_rollouts_rows_or_eval_batch_size_whichever_is_larger():
    from grpo.train.selection import batch_size

    rows = config_from_dict({"grpo": {"prompts_per_step": 4, "group_size": 3}, "eval": {"batch_size": 5}})
    wide = config_from_dict({"grpo": {"prompts_per_step": 4, "group_size": 3}, "eval": {"batch_size": 20}})
    assert (batch_size(rows), batch_size(wide)) == (12, 20)


def test_the_replies_answer_every_record_in_order_across_calls(tiny_model, tiny_tokenizer):
    """Records spread over several greedy calls (here 2 rows a call): one reply per record, each record's
    own (the reply it gets alone)."""
    from grpo.train import selection
    from tests.steps import step_records

    step = _moved_step(tiny_model, tiny_tokenizer)
    step = dataclasses.replace(step, cfg=step.cfg.model_copy(update={
        "grpo": step.cfg.grpo.model_copy(update={"prompts_per_step": 1}),
        "eval": step.cfg.eval.model_copy(update={"batch_size": 2})}))
    assert selection.batch_size(step.cfg) == 2
    records = step_records()
    replies = selection._replies(step, step.model, records)
    assert len(replies) == len(records) == 4
    assert replies == [selection._replies(step, step.model, [record])[0] for record in records]


def test_the_selector_scores_sft_with_the_reference_once_and_the_policy_when_due(monkeypatch, tmp_path):
    """Made at every (re)start: the SFT baseline from the reference (a resumed policy has moved), then the
    policy at each due step only, each with the seconds it took."""
    from grpo.train import selection

    calls = []

    def planted(step, records, reference=False):
        calls.append(reference)
        return {"ambiguous": 0.25} if reference else {"ambiguous": 0.75}

    monkeypatch.setattr(selection, "kind_accuracy", planted)
    cfg = config_from_dict({"grpo": {"steps": 4, "selection": {"records": 4, "every": 2}}})
    pool = [{"id": f"f{i}", "task": "fairness", "context_condition": "ambig" if i % 2 else "disambig"}
            for i in range(8)] + [{"id": f"h{i}", "task": "hallucination", "answerable": i % 2 == 0} for i in range(8)]
    started = time.perf_counter()
    selector = selection.Selector(cfg, _fake_step(), pool, tmp_path)
    assert calls == [True] and selector.sft == {"ambiguous": 0.25}
    assert 0.0 <= selector.sft_seconds <= time.perf_counter() - started
    assert selector.scores(1) == {} and calls == [True]
    began = time.perf_counter()
    scores = selector.scores(2)
    assert calls == [True, False] and scores[score_key("ambiguous")] == 0.75
    assert 0.0 <= scores[selection.SECONDS] <= time.perf_counter() - began


def test_the_record_adds_the_seconds_of_the_entries_that_have_them(tmp_path):
    from grpo.train import selection

    cfg = config_from_dict({"grpo": {"selection": {"every": 2}}})
    history = [{"step": 1}, {"step": 2, score_key("ambiguous"): 0.5, selection.SECONDS: 1.5},
               {"step": 3}, {"step": 4, score_key("ambiguous"): 0.75, selection.SECONDS: 2.0}]
    summary = selection.record(cfg, tmp_path, {"ambiguous": 0.25}, history, 8)
    assert summary["seconds"] == 3.5 and [e["step"] for e in summary["evaluations"]] == [2, 4]
    assert json.loads((tmp_path / selection.SELECTION_FILE).read_text())["seconds"] == 3.5
