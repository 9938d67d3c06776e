"""Stage ``base``: build the base model, then pretrain the embedded one on text from the generators.

A model trained from random weights by SFT alone learns the answer format but not to read the
context: SFT puts its loss on the two or three answer tokens of each conversation, too little signal
to learn to copy a name or a value from the context. Pretraining puts the loss on every token of
``pretrain.records`` freshly generated training-split records: predicting the people of a
disambiguating sentence, the entity of a question and the answer all need tokens copied from earlier
in the text. A record is its plain text (``pretraining_text``) or, for the tasks of
``pretrain.chat_tasks``, the very conversation SFT renders: a small model reads only in the layout it
was pretrained in, so fairness, whose reading must survive into the chat prompt, is pretrained in it.

The embedded tokenizer is trained first, on the training records as the model reads them
(``tokenizer_corpus``), so the prompt's fixed words are whole tokens.

The corpus is drawn from the same generators as ``data/processed/train.jsonl`` with another seed: the
training split's templates and entity names only, never the held-out ones eval asks about. Each
record's question carries ``data.sft_noise`` as in SFT, so pretraining does not remove the bias and
the hallucinations GRPO is there to fix. A preset architecture, a GGUF file or a resolved model is
built as before and not pretrained.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo import paths
from grpo.config import Config
from grpo.data.jsonl import read_records
from grpo.data.prompts import example_messages, sft_target
from grpo.data.schema import LETTERS, Record, make_record
from grpo.data.splits import apply_sft_noise
from grpo.data.synthetic_fairness import generate_fairness
from grpo.data.synthetic_grounded import generate_grounded
from grpo.errors import GrpoError
from grpo.files import write_atomically
from grpo.locks import writes
from grpo.model.base_model import base_inputs, build_base
from grpo.model.chat import SftExample
from grpo.model.device import make_accelerator
from grpo.model.loading import save_model
from grpo.provenance.lineage import make_lineage, write_lineage
from grpo.seeding import derive_seed
from grpo.train.causal_lm import conversation, train_sft


def tokenizer_corpus(cfg: Config) -> Iterator[str]:
    """The embedded tokenizer's training text: every training record as SFT and GRPO show it, the system
    prompt, the user turn (context, question, options, instruction) and the answer.

    The prompt's fixed words come once per record, as often as the model reads them, so the BPE merges
    them into whole words: the default eval prompts are 90–179 tokens instead of 145–227 when the fixed
    words were seen once and spelled letter by letter."""
    train_file = paths.data_file(cfg, "train")
    if train_file.is_file():
        yield from record_texts(read_records(train_file))


def record_texts(records: Iterable[dict]) -> Iterator[str]:
    """Each record's messages and SFT target, the texts ``tokenizer_corpus`` trains the tokenizer on."""
    for record in records:
        yield from (message["content"] for message in example_messages(record))
        yield sft_target(record)


def pretrain_records(cfg: Config) -> list[Record]:
    """``pretrain.records`` generated training-split records, SFT targets filled and noised as in prepare.

    ``pretrain.fairness_fraction`` (else ``data.fairness_fraction``) of them are fairness items,
    ``data.answerable_fraction`` of the rest are answerable; the seed is derived from ``seed``, so the
    corpus differs from the prepared train split.
    """
    n = cfg.pretrain.records
    seed = derive_seed(cfg.seed, ("pretrain", 0))
    fraction = cfg.pretrain.fairness_fraction
    n_fair = round(n * (cfg.data.fairness_fraction if fraction is None else fraction))
    fields = generate_fairness(n_fair, "train", seed)
    fields += generate_grounded(n - n_fair, "train", seed, cfg.data.answerable_fraction)
    return apply_sft_noise([make_record(item, "train") for item in fields], cfg.data.sft_noise, seed)


def pretraining_text(record: dict) -> str:
    """A record as plain text: the context, its question, a fairness item's options, then its SFT target.

    No system prompt, chat headers or instructions: they are the same in every conversation, so they
    would teach nothing and double the tokens (SFT teaches the chat format afterwards)."""
    options = ""
    if record["task"] == "fairness":
        options = "".join(
            f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, record["choices"], strict=True)
        )
    return f"Context: {record['context']}\nQuestion: {record['question']}\n{options}\n\n{sft_target(record)}"


def pretrain_examples(
    records: list[dict], tokenizer: PreTrainedTokenizerBase, cfg: Config
) -> list[SftExample]:
    """Every record with the loss on every token: ``<bos> text <eos>`` of its plain text, or, for the
    tasks of ``pretrain.chat_tasks``, the conversation SFT trains on (``conversation``: the same prompt ids
    SFT and GRPO see, then the target and the end-of-turn token). A record longer than the embedded
    model's ``model.tiny.max_position_embeddings`` is an error, never cut."""
    limit = cfg.model.tiny.max_position_embeddings
    chat_tasks = set(cfg.pretrain.chat_tasks)
    examples = []
    for record in records:
        if record["task"] in chat_tasks:
            ids = conversation(record, tokenizer, cfg.model.chat_template_kwargs).ids
        else:
            text = pretraining_text(record)
            ids = [
                tokenizer.bos_token_id,
                *tokenizer.encode(text, add_special_tokens=False),
                tokenizer.eos_token_id,
            ]
        if len(ids) > limit:
            raise GrpoError(
                f"pretraining record {record.get('id')}: {len(ids)} tokens > "
                f"model.tiny.max_position_embeddings={limit}; raise it or shorten the data"
            )
        examples.append(SftExample(ids, [True] * len(ids)))
    return examples


def pretrain(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> dict:
    """Causal-LM pretraining of ``model`` in place; returns the summary ``metrics/pretrain.json`` holds."""
    records = [record.model_dump() for record in pretrain_records(cfg)]
    examples = pretrain_examples(records, tokenizer, cfg)
    started = time.perf_counter()
    history = train_sft(
        model, examples, tokenizer.pad_token_id, cfg.pretrain, cfg.seed, make_accelerator(), desc="pretrain"
    )
    return {
        "loss_first": history[0]["loss"],
        "loss_final": history[-1]["loss"],
        "token_accuracy_final": history[-1]["token_accuracy"],
        "steps": len(history),
        "examples": len(examples),
        "tokens": sum(len(example.ids) for example in examples),
        "wall_time_s": round(time.perf_counter() - started, 2),
    }


@writes(lambda cfg: paths.model_dir(cfg, "base"))
def run(cfg: Config) -> int:
    out = paths.model_dir(cfg, "base")
    built = build_base(cfg, out, tokenizer_corpus(cfg))
    summary: dict = {"steps": 0}
    if built is not None and cfg.pretrain.records:
        model, tokenizer = built
        summary = pretrain(model, tokenizer, cfg)
        save_model(model.cpu(), tokenizer, out)
        print(
            f"base: pretrained on {summary['examples']} generated records ({summary['tokens']} tokens), "
            f"{summary['steps']} steps in {summary['wall_time_s']:.1f}s, loss {summary['loss_first']:.3f} -> "
            f"{summary['loss_final']:.3f}"
        )
    write_lineage(out, make_lineage("base", cfg, base_inputs(cfg)))
    write_atomically({paths.metrics_file(cfg, "pretrain"): json.dumps(summary, indent=2) + "\n"})
    return 0
