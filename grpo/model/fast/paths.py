"""``FastPaths``: which fast paths a run uses, resolved once from ``model.fast_paths``; the callers ask it.

The rollout asks it how to decode (``decode``), evaluation whether its samples may start from the greedy
pass (``prompt_pass``), the step whether the update reuses the rollout's prefill (``reuses_prefill``), the
fp32 head whether its product runs through oneDNN (``head_onednn``). Under ``off`` every answer is the
library's path; under ``auto`` each fast path runs where its self-check passes. A new fast path is one
more ``FastPath`` in ``PATHS`` and one more answer here: the callers do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo.config import FastPathsSetting, GrpoConfig
from grpo.model.fast import decode as loop
from grpo.model.fast.head import onednn_mismatch, onednn_product
from grpo.model.fast.multinomial import exponential_mismatch
from grpo.model.fast.prefill import prefill_reusable
from grpo.model.fast.prompt_pass import PromptPass
from grpo.model.generation import generate_sequences


@dataclass(frozen=True)
class FastPath:
    """One fast path: what it is called in the log, the library path it stands in for, its self-check
    (``None``: checked where it runs, at each use; else a function that says why not, or ``None``), and
    the one kind of device it runs on, if it runs on one only."""

    name: str
    replaces: str
    mismatch: Callable[[], str | None] | None = None
    inside_loop: bool = False  # it runs only inside the decode loop
    device: str | None = None  # "cpu" or "cuda": the only device type it runs on; None: any


DECODE_LOOP = FastPath("decode loop", "model.generate", loop.loop_mismatch)
LEAN_STEP = FastPath("lean decode step", "the model's forward per token", inside_loop=True, device="cpu")
GRAPH_STEP = FastPath("CUDA graph decode step", "the model's forward per token", inside_loop=True, device="cuda")
DRAWS = FastPath("exponential draws", "torch.multinomial", exponential_mismatch, inside_loop=True)
PROMPT_PASS = FastPath("greedy-pass reuse", "evaluation's own prefill of its samples", inside_loop=True)
HEAD = FastPath("oneDNN head product", "F.linear in the fp32 head", onednn_mismatch, device="cpu")
PREFILL = FastPath("prefill reuse", "the update's own pass over the prompts")
PATHS: tuple[FastPath, ...] = (DECODE_LOOP, LEAN_STEP, GRAPH_STEP, DRAWS, PROMPT_PASS, HEAD, PREFILL)

_ANNOUNCED: set[str] = set()


def run_device() -> str:
    """The device type a run in this process trains on: its GPU where there is one, as
    ``device.make_accelerator`` decides."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class FastPaths:
    """The fast paths in force for a run (``model.fast_paths``) on its device type. Cheap to make; the
    self-checks run once per process, at the first question that needs them."""

    setting: FastPathsSetting = "auto"
    device: str = field(default_factory=run_device)  # "cpu" or "cuda"

    @classmethod
    def resolve(cls, setting: FastPathsSetting) -> FastPaths:
        """The run's fast paths; says once per process in the run's log which are in use (``announce``)."""
        fast = cls(setting)
        fast.announce()
        return fast

    def why_not(self, path: FastPath) -> str | None:
        """Why ``path`` is not in use (``None``: it is)."""
        if self.setting == "off":
            return "model.fast_paths is off"
        if not self.serves(path):
            return f"it runs on {path.device} only, the run on {self.device}"
        if path.inside_loop and path is not DECODE_LOOP and self.why_not(DECODE_LOOP) is not None:
            return "the decode loop is not in use"
        return None if path.mismatch is None else path.mismatch()

    def uses(self, path: FastPath) -> bool:
        return self.why_not(path) is None

    def serves(self, path: FastPath) -> bool:
        """Whether ``path`` is one of this run's device type's (the others are never in question)."""
        return path.device is None or path.device == self.device

    def report(self) -> str:
        """One line: the fast paths of the run's device type in use and those that fell back, each with why
        (a path of another device type is not named)."""
        paths = [p for p in PATHS if self.serves(p)]
        if self.setting == "off":
            return (f"model.fast_paths: off ({self.device}); the library paths run: "
                    + ", ".join(dict.fromkeys(p.replaces for p in paths)))
        used = [f"{p.name} (for {p.replaces})" for p in paths if self.uses(p)]
        fell = [f"{p.name} ({self.why_not(p)})" for p in paths if not self.uses(p)]
        return (f"model.fast_paths: auto ({self.device}); in use: {', '.join(used) or 'none'}; "
                f"fell back: {', '.join(fell) or 'none'}")

    def announce(self) -> None:
        """Print ``report`` unless this process printed the same line already."""
        line = f"fast paths: {self.report()}"
        if line not in _ANNOUNCED:
            _ANNOUNCED.add(line)
            print(line)

    # ------------------------------------------------------------------ what the callers ask

    def decode(self, *args, prompt_pass: PromptPass | None = None, **kwargs) -> torch.Tensor:
        """Sequences ``[N, P + C]``: the decode loop's (``fast.decode.decode(*args, prompt_pass=...,
        **kwargs)``) where it is in use, else ``generation.generate_sequences(*args, **kwargs)``
        (``model.generate``; the same arguments, the same tokens). ``prompt_pass`` comes from
        ``self.prompt_pass()``, so it is ``None`` where the loop is not in use."""
        if self.uses(DECODE_LOOP):
            return loop.decode(*args, prompt_pass=prompt_pass, **kwargs)
        return generate_sequences(*args, **kwargs)

    def prompt_pass(self) -> PromptPass | None:
        """A ``PromptPass`` for a greedy decode whose samples follow (evaluation), or ``None`` where the
        samples run their own prefill."""
        return PromptPass() if self.uses(PROMPT_PASS) else None

    def head_onednn(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the fp32 head multiplies ``hidden`` by ``weight`` through oneDNN (``fast/head.py``)."""
        return onednn_product(hidden, weight) and self.uses(HEAD)

    def reuses_prefill(
        self, grpo: GrpoConfig, model: torch.nn.Module, *, shares_prefix: bool, samples_on_model: bool,
        one_process: bool,
    ) -> bool:
        """Whether the update's policy pass reuses the rollout's prefill (``fast/prefill.py``)."""
        return self.uses(PREFILL) and prefill_reusable(
            grpo, model, shares_prefix=shares_prefix, samples_on_model=samples_on_model, one_process=one_process
        )
