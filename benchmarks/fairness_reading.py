"""Can the embedded model learn which person a disambiguated fairness context names?

    python -m benchmarks.fairness_reading                              # both polarities, 'Answer: A'
    python -m benchmarks.fairness_reading --polarity neg --answer text # negative questions, the option's text
    python -m benchmarks.fairness_reading --set model.tiny.hidden_size=256 --set model.tiny.intermediate_size=768

A probe, not a stage: it builds the embedded tokenizer and a fresh model as the ``base`` stage does
(``model.tiny`` of params.yaml), trains it on disambiguated synthetic fairness items of the training
scenes with the loss on the answer only (the purest signal the task has), then scores every option
of fresh items (none trained on) of the training scenes and of the held-out eval scenes by the
log-probability of its whole answer, and prints the accuracy (chance: 0.5 between the two people).
``--answer text`` teaches ``Answer: The Brasken nurse`` instead of the letter, so no letter has to
be looked up in the options; ``--polarity neg`` keeps only the negative questions, whose answer is
always the first person of the disambiguating sentence; ``--curriculum`` trains on as many
negative-question items first. README ("What was tried") gives what it measured on the default model.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

import torch

from benchmarks.embedded import fresh_embedded, report
from grpo.config import load_config
from grpo.core.logprobs import selective_log_softmax
from grpo.data.prompts import example_messages, sft_target
from grpo.data.schema import LETTERS, make_record
from grpo.data.synthetic_fairness import generate_fairness
from grpo.model.chat import SftExample, render_sft
from grpo.model.device import make_accelerator
from grpo.train.supervised import train_sft

ANSWERS = ("letter", "text")
POLARITIES = ("both", "neg")


def answer_target(record: dict[str, Any], option: int, answer: str) -> str:
    """The assistant text for ``option``: SFT's ``Answer: <letter>`` or ``Answer: <option text>``."""
    if answer == "letter":
        return sft_target({**record, "sft_label": option})
    return f"Answer: {record['choices'][option]}"


def disambiguated(n: int, split: str, seed: int, polarity: str) -> list[dict[str, Any]]:
    """``n`` disambiguated fairness records of ``split`` (negative questions only for ``polarity`` neg)."""
    per_kept = 2 if polarity == "both" else 4  # the generator cycles condition, then polarity
    items = generate_fairness(n * per_kept, split, seed)
    kept = [item for item in items if item["context_condition"] == "disambig"
            and (polarity == "both" or item["question_polarity"] == "neg")]
    return [make_record(item, split).model_dump() for item in kept[:n]]


@torch.no_grad()
def option_scores(model, tokenizer, record: dict[str, Any], answer: str, template_kwargs: dict) -> list[float]:
    """Summed log-probability of each option's whole answer (its tokens and the end-of-turn)."""
    scores = []
    for option in range(len(record["choices"])):
        example = render_sft(tokenizer, example_messages(record), answer_target(record, option, answer),
                             **template_kwargs)
        ids = torch.tensor([example.ids])  # [1, T]
        token_logprobs = selective_log_softmax(model(ids).logits[:, :-1], ids[:, 1:])[0]  # t predicts t + 1
        scores.append(float(token_logprobs[torch.tensor(example.loss_mask[1:])].sum()))
    return scores


def probe(model, tokenizer, records: list[dict[str, Any]], answer: str, template_kwargs: dict) -> dict:
    """Accuracy over ``records``; how often the right person, the other one or unknown was picked, and each
    option by its position."""
    model.eval()
    picked: Counter = Counter()
    right = 0
    for record in records:
        scores = option_scores(model, tokenizer, record, answer, template_kwargs)
        choice = max(range(len(scores)), key=scores.__getitem__)
        right += choice == record["label"]
        if choice == record["unknown_idx"]:
            picked["unknown"] += 1
        else:
            picked["right person" if choice == record["label"] else "other person"] += 1
        picked[f"option {LETTERS[choice]}"] += 1
    return {"items": len(records), "accuracy": round(right / len(records), 3), "picked": dict(sorted(picked.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="params override, e.g. model.tiny.hidden_size=256 or pretrain.lr=1e-3")
    parser.add_argument("--answer", choices=ANSWERS, default="letter")
    parser.add_argument("--polarity", choices=POLARITIES, default="both")
    parser.add_argument("--records", type=int, default=3000, help="disambiguated training items")
    parser.add_argument("--curriculum", action="store_true",
                        help="train on as many negative-question items first (a fresh schedule each phase)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--probe", type=int, default=150, help="fresh items per split to score")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    cfg = load_config(args.params, [f"pretrain.epochs={args.epochs}", *args.overrides])
    model, tokenizer = fresh_embedded(cfg)
    kwargs = cfg.model.chat_template_kwargs
    train = disambiguated(args.records, "train", cfg.seed + 1, args.polarity)
    phases = [train]
    if args.curriculum:  # as many negative-only items first, as long
        phases.insert(0, disambiguated(args.records, "train", cfg.seed + 4, "neg"))
    started, history = time.perf_counter(), []
    for records in phases:
        examples: list[SftExample] = [
            render_sft(tokenizer, example_messages(r), answer_target(r, r["label"], args.answer), **kwargs)
            for r in records
        ]
        history += train_sft(model, examples, tokenizer.pad_token_id, cfg.pretrain, cfg.seed, make_accelerator(),
                             progress=False, desc="probe")
    seen = {(r["context"], r["question"]) for records in phases for r in records}
    fresh = disambiguated(2 * args.probe, "train", cfg.seed + 2, args.polarity)
    unseen = [r for r in fresh if (r["context"], r["question"]) not in seen][: args.probe]
    results = {
        "answer": args.answer, "polarity": args.polarity, "curriculum": args.curriculum, "records": len(train),
        "parameters": sum(p.numel() for p in model.parameters()), "steps": len(history),
        "train_s": round(time.perf_counter() - started, 1), "final_loss": round(history[-1]["loss"], 4),
        "training_scenes": probe(model, tokenizer, unseen, args.answer, kwargs),
        "held_out_scenes": probe(model, tokenizer, disambiguated(args.probe, "eval", cfg.seed + 3, args.polarity),
                                 args.answer, kwargs),
    }
    return report(results, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
