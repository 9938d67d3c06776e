"""The one table of pipeline stages: what each runs, which params it reads, what it is made from.

``dvc.yaml`` lists, per stage, the params keys below and depends on ``fingerprints/<stage>.json``
(written by ``grpo fingerprint`` from the entry modules below); ``grpo/provenance/lineage.py`` hashes the same
params keys into every artifact's ``lineage.json``. Keeping the three in one table means a stage
cannot be rerun by DVC for one set of keys and guarded by lineage for another.

| stage | command | entry module (function ``run``) | upstream |
| --- | --- | --- | --- |
| prepare | grpo prepare | grpo.data.prepare | - |
| validate | grpo validate | grpo.data.validate | prepare |
| base | grpo base | grpo.train.pretrain | prepare, validate |
| sft | grpo sft | grpo.train.sft | prepare, validate, base |
| preflight | grpo preflight | grpo.checks.preflight (and grpo.train.trainer) | prepare, validate, base, sft |
| grpo | grpo train | grpo.train.trainer | prepare, validate, sft, preflight |
| evaluate | grpo evaluate | grpo.eval.evaluate | prepare, validate, base, sft, grpo |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo.errors import GrpoError

# Modules every stage's fingerprint includes even before the stage's own module exists.
COMMON_MODULES: tuple[str, ...] = ()

# Modules that record and check what built an artifact, never what it contains: stages import them
# to write lineage.json, but an edit to them (say, a new key in this table for `evaluate`) must not
# make every trained model stale. They are left out of every closure, and their imports not followed.
# The grpo.config package is one of them: what it means for a stage is the VALUES it yields (defaults
# included), and those enter every artifact's lineage through the params hash of the validated tree; a
# new field or a better error message in grpo/config/ retrains nothing. (DVC itself sees only the values
# written in params.yaml, which is why params.yaml spells out every key.)
BOOKKEEPING_MODULES: tuple[str, ...] = (
    "grpo.provenance.stages",
    "grpo.provenance.fingerprint",
    "grpo.provenance.lineage",
    "grpo.provenance.file_memo",
    "grpo.provenance.gate",
    "grpo.config",
)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage."""

    name: str
    """Stage name in dvc.yaml, the Prefect task and ``fingerprints/<name>.json``."""
    command: str
    """The ``grpo <command>`` that runs it (``grpo/cli.py`` builds one command per stage)."""
    modules: tuple[str, ...]
    """Entry modules; their static import closure is the code the stage runs."""
    params: tuple[str, ...]
    """Dotted params.yaml keys (or section prefixes) the stage reads."""
    upstream: tuple[str, ...]
    """Stages whose outputs this stage reads."""
    help: str = ""
    """One line for ``grpo --help``."""
    function: str = "run"
    """The entry function in the first entry module: ``function(cfg: Config, **typed options) -> int``."""

    @property
    def entry(self) -> str:
        """``module:function`` of the stage's entry (named, never imported here: this table stays
        below every layer it names)."""
        return f"{self.modules[0]}:{self.function}"

    @property
    def entry_modules(self) -> tuple[str, ...]:
        """The stage's own modules plus those every stage runs."""
        return self.modules + tuple(m for m in COMMON_MODULES if m not in self.modules)


# The model keys the base stage reads: the whole section but `model.lora`, which only SFT (with
# `sft.lora`), pre-flight and GRPO apply. A new adapter setting then reruns no pretraining. Every other
# field of ModelConfig is here (tests/test_stages.py holds the two together).
BASE_MODEL_KEYS: tuple[str, ...] = tuple(
    f"model.{field}"
    for field in (
        "name_or_path",
        "allow_download",
        "trust_remote_code",
        "dtype",
        "pad_token",
        "extra_stop_tokens",
        "chat_template_kwargs",
        "tiny",
        "architecture",
        "architecture_overrides",
        "tokenizers_dir",
        "attn_implementation",
        "gradient_checkpointing",
        "fast_paths",
    )
)
# The grpo keys pre-flight reads: the checks drive the step itself, so its precision, scoring path, loss,
# gradient modes and sampling are all here. Left out: how long and how fast the run trains, which
# prompts it draws and which checkpoint it keeps (steps, lr, warmup_steps, prompts_per_step,
# fairness_fraction, kind_share, selection), so a new step count or learning rate needs no new
# pre-flight (tests/test_stages.py holds this to GrpoConfig).
PREFLIGHT_GRPO_KEYS: tuple[str, ...] = tuple(
    f"grpo.{field}"
    for field in (
        "group_size",
        "max_grad_norm",
        "num_iterations",
        "grad_accum",
        "dynamic_sampling",
        "max_resample",
        "bf16",
        "shared_prefix",
        "full_logits",
        "reuse_prefill",
        "sampling",
        "rollout",
        "loss",
        "multitask",
    )
)

# Validate gates the data: every stage that reads the processed data lists it upstream, so bad data
# stops the pipeline before the tokenizer or any model is rebuilt from it (DESIGN.md "Reliability").
STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec(
            "prepare",
            "prepare",
            ("grpo.data.prepare",),
            ("seed", "data", "paths"),
            (),
            "generate or load the dataset into data/processed",
        ),
        StageSpec(
            "validate",
            "validate",
            ("grpo.data.validate",),
            ("data", "paths"),
            ("prepare",),
            "Great Expectations gate over the processed data",
        ),
        # The pretraining corpus is generated with the data section's mix and SFT noise.
        StageSpec(
            "base",
            "base",
            ("grpo.train.pretrain",),
            (
                "seed",
                *BASE_MODEL_KEYS,
                "pretrain",
                "data.fairness_fraction",
                "data.answerable_fraction",
                "data.sft_noise",
                "paths",
            ),
            ("prepare", "validate"),
            "build the base model; pretrain the embedded one on generated text",
        ),
        StageSpec(
            "sft",
            "sft",
            ("grpo.train.sft",),
            ("seed", "model", "sft", "data.grpo_holdout", "paths"),
            ("prepare", "validate", "base"),
            "supervised fine-tuning with the one chat renderer",
        ),
        StageSpec(
            "preflight",
            "preflight",
            # The trainer's own module too: a change to how it wires the step makes the gate's report stale.
            ("grpo.checks.preflight", "grpo.train.trainer"),
            # Only what the checks use (PREFLIGHT_GRPO_KEYS; the rewards score the probe's completions).
            (
                "seed",
                "model",
                "sft.max_length",
                "data.grpo_holdout",
                "preflight",
                *PREFLIGHT_GRPO_KEYS,
                "rewards",
                "paths",
            ),
            ("prepare", "validate", "base", "sft"),
            "check invariants I1-I12 on the configured model",
        ),
        StageSpec(
            "grpo",
            "train",
            ("grpo.train.trainer",),
            (
                "seed",
                "experiment",
                "model",
                "grpo",
                "data.grpo_holdout",
                "rewards",
                "monitor",
                "checkpoint",
                "tracking",
                "paths",
            ),
            ("prepare", "validate", "sft", "preflight"),
            "GRPO on both reward tasks",
        ),
        StageSpec(
            "evaluate",
            "evaluate",
            ("grpo.eval.evaluate",),
            ("seed", "experiment", "model", "grpo", "rewards", "eval", "paths"),
            ("prepare", "validate", "base", "sft", "grpo"),
            "evaluate base, SFT and GRPO models side by side",
        ),
    )
}


class UnknownStageError(GrpoError):
    """A stage name that is not in the table."""


def get_stage(name: str) -> StageSpec:
    """The stage called ``name``; an unknown name is an error that lists the known ones."""
    if name not in STAGES:
        raise UnknownStageError(
            f"unknown stage {name!r}: expected one of {', '.join(STAGES)} (the table in grpo/provenance/stages.py)"
        )
    return STAGES[name]


def lookup(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(found, value)`` of a dotted key in a nested dict (``"grpo.loss.beta"``)."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node
