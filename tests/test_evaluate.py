"""Tests of grpo/eval/evaluate.py on a real tiny model folder set (base, SFT == base copy, GRPO adapter),
built by tests/eval_project.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from grpo import paths
from grpo.config import Config
from grpo.data.prompts import example_messages, render_records
from grpo.data.schema import LETTERS
from grpo.data.select import balanced_records, eval_records
from grpo.eval.compare import question_kind
from grpo.eval.evaluate import (
    EvaluationError,
    diversity_metrics,
    entropy_sum,
    evaluate_model,
    plot_run_entropy,
    run,
    task_metrics,
)
from grpo.eval.verdict import verdicts
from grpo.model.chat import end_of_turn_ids, render_prompt
from grpo.model.fast import FastPaths
from grpo.model.loading import load_model, load_tokenizer
from grpo.model.rollout import generate_rollout, stop_ids
from grpo.model.scoring import rollout_inputs, score_inputs
from grpo.provenance.lineage import StaleArtifactError
from grpo.seeding import derive_seed
from tests.eval_project import (
    GROUP,
    MAX_NEW,
    N_FAIR,
    N_HALL,
    SIZES,
    add_grpo_adapter,
    build_project,
    make_records,
    project_cfg,
)
from tests.weights import spread_weights


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Config:
    return build_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def evaluated(project, tmp_path_factory):
    """``grpo evaluate`` run once with all three models present: (cfg, eval.json, eval.md)."""
    root = tmp_path_factory.mktemp("with_grpo")
    for name in ("data", "models"):
        shutil.copytree(Path(getattr(project.paths, f"{name}_dir")), root / name)
    cfg = project_cfg(root)
    add_grpo_adapter(cfg)
    assert run(cfg) == 0
    results = json.loads((Path(cfg.paths.metrics_dir) / "eval.json").read_text())
    return cfg, results, (Path(cfg.paths.reports_dir) / "eval.md").read_text()


# ---------------------------------------------------------------------------- metrics wiring (no model)


def test_the_evaluation_reward_is_the_mean_over_items_and_self_bleu_is_within_each_prompt():
    """``reward`` is the mean over every item (2 fairness items right at +1 and 6 grounded ones wrong at -1:
    -0.5, where the tasks' mean of means would say 0); self-BLEU compares each prompt's samples with each
    other only: two prompts whose two samples share no word score 0, though each sample has a twin in the
    other prompt's."""
    records = make_records("eval", 2, 6, seed=3)
    replies = [f"Answer: {LETTERS[r['label']]}" if r["task"] == "fairness" else "zzz" for r in records]
    got = task_metrics(replies, records, project_cfg(Path("/unused")))
    assert (got["rewards/fairness/mean"], got["rewards/hallucination/mean"]) == (1.0, -1.0)
    assert got["reward"] == pytest.approx(-0.5)
    texts = ["alpha bravo charlie delta", "echo foxtrot golf hotel"] * 2
    assert diversity_metrics(texts, 2)["diversity/self_bleu"] == 0.0


def test_task_metrics_right_and_wrong_answers():
    records = make_records("eval", 4, 4, seed=3)
    right = [f"Answer: {LETTERS[r['label']]}" if r["task"] == "fairness" else r["answer"] for r in records]
    good = task_metrics(right, records, project_cfg(Path("/unused")))
    assert good["fairness/accuracy"] == 1.0 and good["fairness/n"] == 4
    assert good["hallucination/accuracy"] == 1.0 and good["hallucination/hallucination_rate"] == 0.0
    assert good["reward"] == 1.0 and good["rewards/fairness/mean"] == 1.0
    garbage = task_metrics(["zzz"] * len(records), records, project_cfg(Path("/unused")))
    assert garbage["fairness/accuracy"] == 0.0 and garbage["fairness/n_unparseable"] == 4
    assert garbage["reward"] == -1.0
    categories = {r["category"] for r in records if r["task"] == "fairness"}
    assert {f"fairness/by_category/{c}/s_amb" for c in categories} <= set(good)
    grounded = [r for r in records if r["task"] == "hallucination"]
    kinds = {r["template_id"].removeprefix("hallucination.") for r in grounded}
    assert {key.split("/")[2] for key in good if key.startswith("hallucination/by_kind/")} == kinds
    for kind in kinds:  # each kind's row counts that kind's records alone
        answerable = sum(r["answerable"] and question_kind(r) == kind for r in grounded)
        assert good[f"hallucination/by_kind/{kind}/n_answerable"] == answerable
        assert good[f"hallucination/by_kind/{kind}/hallucination_rate"] == 0.0
        assert garbage[f"hallucination/by_kind/{kind}/hallucination_rate"] == 1.0


def test_diversity_metrics_per_group_self_bleu():
    same = diversity_metrics(["a b c", "a b c", "x y", "z w"], group_size=2)
    assert same["diversity/self_bleu"] == pytest.approx(0.5)  # group 1 identical (1.0), group 2 disjoint (0.0)
    assert same["diversity/distinct_1"] == pytest.approx(7 / 10)
    assert same["diversity/distinct_2"] == pytest.approx(4 / 6)  # (a,b) (b,c) twice, (x,y), (z,w)


def test_eval_records_capped_by_max_examples_keep_both_tasks(project):
    capped = project.model_copy(update={"eval": project.eval.model_copy(update={"max_examples": 3})})
    everything = eval_records(project)  # written fairness first, then hallucination
    assert len(everything) == N_FAIR + N_HALL
    fair = [r for r in everything if r["task"] == "fairness"]
    hall = [r for r in everything if r["task"] == "hallucination"]
    assert [r["id"] for r in eval_records(capped)] == [fair[0]["id"], hall[0]["id"], fair[1]["id"]]


def test_balanced_records_alternate_tasks_and_stop_when_empty():
    records = make_records("eval", 3, 1, seed=5)
    assert [r["task"] for r in balanced_records(records, 10)] == ["fairness", "hallucination", "fairness", "fairness"]
    assert balanced_records(records, 0) == []


# ---------------------------------------------------------------------------- generation


def greedy(model, tokenizer, prompts, sampling, eos_ids):
    return generate_rollout(model, tokenizer, prompts, 1, sampling, eos_ids, seed=0, greedy=True, fast=FastPaths())


def test_greedy_rollout_deterministic_and_uses_rollout_processors(project):
    tokenizer = load_tokenizer(paths.model_dir(project, "sft"), project.model)
    model = load_model(paths.model_dir(project, "sft"), project.model).eval()
    prompts = [render_prompt(tokenizer, example_messages(r)) for r in eval_records(project)[:3]]
    eos_ids = end_of_turn_ids(tokenizer)
    first = greedy(model, tokenizer, prompts, project.grpo.sampling, eos_ids)
    again = greedy(model, tokenizer, prompts, project.grpo.sampling, eos_ids)
    assert first.completion_ids.shape[0] == 3 and first.completion_ids.shape[1] <= MAX_NEW
    assert torch.equal(first.completion_ids, again.completion_ids) and first.group_size == 1
    # min_new_tokens == max_new_tokens: the EOS suppressor must keep every completion open to the end.
    no_stop = project.grpo.sampling.model_copy(update={"min_new_tokens": MAX_NEW})
    forced = greedy(model, tokenizer, prompts, no_stop, eos_ids)
    assert forced.truncated.all() and (forced.lengths == MAX_NEW).all()
    assert not torch.isin(forced.completion_ids, torch.tensor(eos_ids)).any()


def test_evaluate_model_stops_on_the_trainers_stop_ids(project, monkeypatch):
    """Eval decodes with ``rollout.stop_ids`` (eos, end-of-turn AND the model's own generation eos
    ids), as training does; the tokenizer's ids alone miss the tiny model's <|end_of_text|>."""
    import grpo.eval.evaluate as evaluate_module

    tokenizer = load_tokenizer(paths.model_dir(project, "sft"), project.model)
    model = load_model(paths.model_dir(project, "sft"), project.model).eval()
    seen = []

    class Seen(Exception):
        pass

    def spy(model, tokenizer, prompts, group_size, sampling, eos_ids, seed, greedy=False, shared_prefill=False, **kwargs):
        seen.append(list(eos_ids))
        raise Seen  # the stop ids are all this test needs

    monkeypatch.setattr(evaluate_module, "generate_rollout", spy)
    with pytest.raises(Seen):
        evaluate_module.evaluate_model(model, tokenizer, eval_records(project)[:1], project, progress=False)
    assert seen == [stop_ids(model, tokenizer, project.model.extra_stop_tokens)]
    assert "<|end_of_text|>" in tokenizer.convert_ids_to_tokens(seen[0])
    assert set(seen[0]) > set(end_of_turn_ids(tokenizer, project.model.extra_stop_tokens))


def test_evaluation_decodes_in_the_rollouts_precision(project, monkeypatch):
    """Under ``grpo.bf16`` every evaluation forward runs in bf16 autocast (where it pays: CUDA or a CPU
    with native bf16), as the training rollout does; without it, in fp32."""
    import grpo.eval.evaluate as evaluate_module
    from grpo.model.precision import autocast_enabled

    tokenizer = load_tokenizer(paths.model_dir(project, "sft"), project.model)
    model = load_model(paths.model_dir(project, "sft"), project.model).eval()
    records = eval_records(project)[:2]
    for bf16 in (False, True):
        cfg = project.model_copy(update={"grpo": project.grpo.model_copy(update={"bf16": bf16})})
        seen: list[bool] = []
        hook = model.get_output_embeddings().register_forward_hook(
            lambda module, args, out, seen=seen: seen.append(torch.is_autocast_enabled("cpu")))
        evaluate_module.evaluate_model(model, tokenizer, records, cfg, progress=False)
        hook.remove()
        assert seen and set(seen) == {bf16 and autocast_enabled(torch.device("cpu"), True)}


def test_sampled_entropy_is_the_scorers_entropy_of_the_sampled_tokens(project):
    """The sampled mode's entropy, taken from the decode loop's own logits, is the token mean of what a
    scoring pass (``score_inputs``: the same ids at the sampling temperature, I3/I10) gives for the
    rollout evaluation sampled; ``entropy_sum`` refuses a rollout sampled without it."""
    tokenizer = load_tokenizer(paths.model_dir(project, "sft"), project.model)
    model = load_model(paths.model_dir(project, "sft"), project.model).eval()
    spread_weights(model, torch.Generator().manual_seed(0))  # completions that stop at different places
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<|eot_id|>")] *= 3
    cfg = project.model_copy(update={"grpo": project.grpo.model_copy(
        update={"sampling": project.grpo.sampling.model_copy(update={"max_new_tokens": 12, "temperature": 0.7})})})
    records = eval_records(cfg)[:3]
    assert len(records) <= cfg.eval.batch_size  # one batch: its seed is the batch index 0's
    got = evaluate_model(model, tokenizer, records, cfg, progress=False)["sampled"]["entropy"]
    prompts = render_records(tokenizer, records, cfg.model.chat_template_kwargs)
    args = (model, tokenizer, prompts, cfg.eval.samples_per_prompt, cfg.grpo.sampling,
            stop_ids(model, tokenizer, cfg.model.extra_stop_tokens), derive_seed(cfg.seed, ("eval_batch", 0)))
    sampled = generate_rollout(*args, shared_prefill=True, fast=FastPaths())
    inputs = rollout_inputs(sampled)
    assert 0 < int(inputs.completion_mask.sum()) < inputs.completion_mask.numel(), "some rows stop early"
    with torch.no_grad():
        entropy = score_inputs(model, inputs).entropy[inputs.completion_mask]
    assert got == pytest.approx(float(entropy.mean()), abs=1e-5) and got > 0.05
    with pytest.raises(EvaluationError, match="with_entropy=True"):
        entropy_sum(sampled)


def test_evaluation_samples_from_its_greedy_pass_with_the_numbers_of_their_own_prefill(project, monkeypatch):
    """Each batch's samples start from its greedy pass over the prompts (``fast.PromptPass``) where that
    is their own prefill's cache bit for bit: the replies, the entropy and every metric are those of an
    evaluation that prefills the samples itself, in fp32 and under the rollout's bf16."""
    tokenizer = load_tokenizer(paths.model_dir(project, "sft"), project.model)
    model = load_model(paths.model_dir(project, "sft"), project.model).eval()
    spread_weights(model, torch.Generator().manual_seed(0))
    records = eval_records(project)[:5]
    import grpo.model.rollout as rollout_module

    prefills = {True: 0, False: 0}
    prefilled_cache, prompt_pass = rollout_module.prefilled_cache, FastPaths.prompt_pass
    for bf16 in (False, True):
        cfg = project.model_copy(update={"grpo": project.grpo.model_copy(update={"bf16": bf16})})
        runs = []
        for share in (True, False):
            monkeypatch.setattr(FastPaths, "prompt_pass", prompt_pass if share else lambda self: None)
            monkeypatch.setattr(rollout_module, "prefilled_cache", lambda *a, share=share: (
                prefills.__setitem__(share, prefills[share] + 1) or prefilled_cache(*a)))
            texts = {}
            runs.append((evaluate_model(model, tokenizer, records, cfg, progress=False, texts=texts), texts))
        assert runs[0] == runs[1], f"bf16={bf16}: sharing the greedy pass changed the evaluation"
    assert prefills[True] < prefills[False], f"a greedy pass stood in for a prefill (a real comparison): {prefills}"


# ---------------------------------------------------------------------------- the stage


def test_evaluate_all_three_models_metrics_in_range(evaluated):
    cfg, results, _ = evaluated
    assert set(results) == {"base", "sft", "grpo"}
    for name, modes in results.items():
        assert set(modes) == {"greedy", "sampled"}, name
        greedy, sampled = modes["greedy"], modes["sampled"]
        assert greedy["fairness/n"] == N_FAIR and sampled["fairness/n"] == N_FAIR * GROUP
        assert greedy["hallucination/n"] == N_HALL and sampled["hallucination/n"] == N_HALL * GROUP
        for mode in (greedy, sampled):
            for key in ("fairness/accuracy", "hallucination/accuracy", "completions/clipped_ratio"):
                assert 0.0 <= mode[key] <= 1.0, (name, key)
            for key in ("fairness/s_dis", "fairness/s_amb", "reward"):
                assert mode[key] is None or -1.0 <= mode[key] <= 1.0, (name, key)
            assert 1.0 <= mode["completions/mean_length"] <= MAX_NEW
        for key in ("diversity/distinct_1", "diversity/distinct_2", "diversity/self_bleu"):
            assert 0.0 <= sampled[key] <= 1.0, (name, key)
        assert 0.0 < sampled["entropy"] <= math.log(SIZES.vocab_size) + 1e-4
    # SFT is a copy of base and sampling is seeded per batch, not per model: identical numbers.
    assert results["base"] == results["sft"]
    # The adapter was loaded and applied: the GRPO policy samples from another distribution.
    assert results["grpo"]["sampled"]["entropy"] != pytest.approx(results["sft"]["sampled"]["entropy"])


def test_evaluate_report_has_three_columns(evaluated):
    _, results, report = evaluated
    assert "| metric | base | SFT | GRPO | GRPO − SFT | SFT − base |" in report
    assert "## greedy" in report and "## sampled" in report
    entropy_row = next(line for line in report.splitlines() if line.startswith("| entropy |"))
    cells = [cell.strip() for cell in entropy_row.strip("|").split("|")]
    assert cells[1:4] == [f"{results[m]['sampled']['entropy']:.3f}" for m in ("base", "sft", "grpo")]
    assert cells[5] == "+0.000"  # SFT - base
    assert "skipped" not in report


def test_evaluate_skips_absent_grpo_with_a_note(project, capsys):
    assert run(project) == 0
    results = json.loads((Path(project.paths.metrics_dir) / "eval.json").read_text())
    report = (Path(project.paths.reports_dir) / "eval.md").read_text()
    assert set(results) == {"base", "sft"}
    assert "- GRPO skipped:" in report and "grpo is absent" in report
    assert "GRPO skipped" in capsys.readouterr().out
    entropy_row = next(line for line in report.splitlines() if line.startswith("| entropy |"))
    assert [c.strip() for c in entropy_row.strip("|").split("|")][3:5] == ["—", "—"]


def test_evaluate_refuses_stale_sft_before_generating(project):
    changed = project.model_copy(update={"sft": project.sft.model_copy(update={"lr": 0.5})})
    with pytest.raises(StaleArtifactError, match=r"params sft\.lr"):
        run(changed)


def test_entropy_plot_from_run_history(project):
    folder = paths.run_dir(project)
    folder.mkdir(parents=True, exist_ok=True)
    assert plot_run_entropy(project) is None  # no history yet: nothing drawn, no error
    (folder / "entropy_history_t.json").write_text(json.dumps([{"step": 1, "entropy": 3.0}, {"step": 2, "entropy": 2.5}]))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.1, "frac_reward_zero_std": 0.5}) + "\n")
    out = plot_run_entropy(project)
    assert out == Path(project.paths.reports_dir) / "entropy.png" and out.stat().st_size > 0


def test_evaluate_report_has_headline_baselines_and_intervals(evaluated):
    cfg, results, report = evaluated
    compare = json.loads((Path(cfg.paths.metrics_dir) / "eval_compare.json").read_text())
    assert "## headline: mean reward on eval items" in report
    assert f"| GRPO | {results['grpo']['greedy']['reward']:.3f} |" in report
    abstain = compare["baselines"]["abstain"]["reward"]
    assert f"| baseline: always abstain / \"unknown\" | {abstain:.3f} | — |" in report
    assert "| baseline: random choice |" in report
    assert "## GRPO − SFT, 95 % bootstrap intervals" in report
    # The verdict and every kind's rows come first, the headline after them (the artifact reads them so).
    assert report.startswith("# Evaluation\n\n## verdict\n")
    assert report.index("## by kind of item") < report.index("## headline")
    assert compare["verdicts"] == verdicts(compare["grpo_minus_sft"])
    for mode in ("greedy", "sampled"):
        for task in ("fairness", "hallucination"):
            verdict = compare["verdicts"][mode][task]["verdict"]
            assert f"| {mode} | {task} | **{verdict}** |" in report
        assert f"| {mode} | fairness | disambiguated | accuracy |" in report
        assert f"| {mode} | hallucination | unanswerable | accuracy (abstains) |" in report
    greedy = compare["grpo_minus_sft"]["greedy"]["reward"]
    assert greedy["diff"] == pytest.approx(results["grpo"]["greedy"]["reward"] - results["sft"]["greedy"]["reward"])
    assert greedy["low"] <= greedy["diff"] <= greedy["high"]


def test_evaluate_without_grpo_has_no_intervals(project):
    assert run(project) == 0
    compare = json.loads((Path(project.paths.metrics_dir) / "eval_compare.json").read_text())
    assert compare["grpo_minus_sft"] is None and set(compare["baselines"]) == {"abstain", "random"}
    report = (Path(project.paths.reports_dir) / "eval.md").read_text()
    assert "bootstrap intervals" not in report and compare["verdicts"] == {}
    assert "No verdict: GRPO skipped (" in report


def test_evaluate_greedy_only_when_no_samples_are_asked(evaluated, tmp_path):
    """``eval.samples_per_prompt: 0``: every model decodes greedily only, with the same greedy figures,
    and the report, the headline and the intervals carry no sampled column."""
    full_cfg, full, _ = evaluated
    for name in ("data", "models"):
        shutil.copytree(Path(getattr(full_cfg.paths, f"{name}_dir")), tmp_path / name)
    cfg = project_cfg(tmp_path, eval={"samples_per_prompt": 0})
    assert run(cfg) == 0
    results = json.loads((Path(cfg.paths.metrics_dir) / "eval.json").read_text())
    compare = json.loads((Path(cfg.paths.metrics_dir) / "eval_compare.json").read_text())
    report = (Path(cfg.paths.reports_dir) / "eval.md").read_text()
    assert {name: set(modes) for name, modes in results.items()} == dict.fromkeys(("base", "sft", "grpo"), {"greedy"})
    assert {name: modes["greedy"] for name, modes in results.items()} == {
        name: modes["greedy"] for name, modes in full.items()}
    assert set(compare["grpo_minus_sft"]) == {"greedy"}
    assert "## greedy" in report and "## sampled" not in report and "sampled" not in report
    assert "greedy decoding only (`eval.samples_per_prompt: 0`)" in report
    assert "| policy | greedy |\n" in report
    assert f"| GRPO | {results['grpo']['greedy']['reward']:.3f} |\n" in report
    assert "| metric | greedy Δ | greedy 95 % CI |\n" in report


def test_a_sampled_item_is_resampled_with_all_its_samples(tmp_path):
    """The bootstrap's unit is the eval item: a record's samples are drawn together, not as independent items
    (which would shrink the intervals by about the square root of the samples per prompt). With every sample
    equal to the greedy reply, the sampled intervals are the greedy ones exactly."""
    from grpo.core.advantages import per_row
    from grpo.eval.evaluate import grpo_intervals
    from tests.test_eval_compare import _right, _wrong

    records = make_records("eval", 8, 8, seed=4)
    cfg = project_cfg(tmp_path, eval={"samples_per_prompt": 4, "bootstrap": 200})
    right, wrong = _right(records), _wrong(records)
    grpo = [r if i % 3 else w for i, (r, w) in enumerate(zip(right, wrong, strict=True))]
    sft = [w if i % 2 else r for i, (r, w) in enumerate(zip(right, wrong, strict=True))]
    texts = {name: {"greedy": replies, "sampled": per_row(replies, 4)} for name, replies in (("grpo", grpo),
                                                                                            ("sft", sft))}
    intervals = grpo_intervals(texts, records, cfg)
    assert intervals["sampled"] == intervals["greedy"]
    assert intervals["greedy"]["reward"]["low"] < intervals["greedy"]["reward"]["high"]  # a real spread
