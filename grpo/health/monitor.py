"""The health monitor: reads each step's completions and metrics and stops a run that went wrong.

Two families of rules (DESIGN.md "Health"), each with ``threshold``, ``window`` and ``action`` in
params ``monitor``:

- **boundary** (steps ``<= monitor.boundary_steps``): no chat-header token inside a completion, at
  most one end-of-turn (the stop token that ends it: any other end token inside means the model wrote
  on after its turn), no completion that starts with prompt text, mean content length (the stop token
  not counted) and entropy in range. A broken template shows on the very first rollout, so these
  stop at once.
- **collapse** (every step): entropy below a floor, ``frac_reward_zero_std`` near 1 (the reward_std = 0
  deadlock: every group's advantage is 0), lengths frozen, step time dropping to nothing, max
  probability near 1, loss and grad norms exactly 0 -- each for ``window`` consecutive steps.

A rule fires once when its streak of consecutive steps reaches ``window`` and is re-armed when the
condition breaks. A deadlock present from the first step (the SFT policy gives every completion of
a group the same reward) is the same disease as a late one, so it also fires at step ``window``.
``warn`` findings are logged and returned; ``raise_if_stop`` turns ``stop`` findings into
``TrainingStopped``, whose message names the rule, the values over the window and likely causes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from grpo.config import MonitorConfig, RuleConfig
from grpo.errors import GrpoError
from grpo.health.kinds import TRADE_CAUSES, TRADE_RULES, TrendWatch
from grpo.health.metrics import mean_content_length

log = logging.getLogger(__name__)

COLLAPSE_CAUSES = (
    "reward degeneracy: all completions of a group get the same reward (read a few completions and the "
    "reward parser's verdicts)",
    "advantage all zero: nothing to learn from (raise grpo.group_size or the temperature, or set "
    "grpo.dynamic_sampling)",
    "entropy sign: check invariant I7 and the sign of grpo.loss.entropy_coef (negative pushes entropy down)",
    "temperature too low: grpo.sampling.temperature near 0 makes the completions of a group identical",
    "KL too strong or the reference wrong: grpo.loss.beta, and invariant I9 (reference = the SFT policy)",
)
BOUNDARY_CAUSES = (
    "the chat template differs between SFT and rollout (invariant I1: one renderer, grpo/model/chat.py)",
    "completions not cut at the absolute prompt width of the left-padded batch (invariant I4)",
    "a completion mask built from id != pad instead of positions (invariant I5; pad == eos on Llama-3)",
    "the end-of-turn token is not a stop token of generation (model.extra_stop_tokens)",
    "SFT targets without the end-of-turn token, or loss on prompt tokens (invariant I2)",
)
_SPECIAL = re.compile(r"<\|[^<>|]{1,40}\|>")
# Tokens that end a turn or a text in the chat families (Llama-3 <|eot_id|> <|eom_id|> <|end_of_text|>,
# Qwen <|im_end|> <|endoftext|>, Phi-3 <|end|>, Gemma <end_of_turn> <eos>, Llama-2 </s>); not
# <|end_header_id|>, <|vision_end|> and the like, which close a span inside a turn.
_END_TOKEN = re.compile(r"</s>|<\|?(?:eot_id|eom_id|eos|end|im_end|endoftext|end_of_text|end_of_turn)\|?>")


class Finding(NamedTuple):
    """One rule that fired."""

    rule: str
    """Name of the rule (its key under ``monitor`` in params)."""
    action: str
    """``warn`` or ``stop``."""
    step: int
    """Step at which the rule fired (the last step of its window)."""
    message: str
    """What was seen: the condition and the values over the window."""
    since: int | None = None
    """First step of the window: the last checkpoint before it is the last healthy one."""


class MonitorError(GrpoError, ValueError):
    """The monitor was called with inputs that do not fit together."""


class TrainingStopped(GrpoError):
    """A ``stop`` rule fired; the message names the rule, the values and the likely causes."""

    def __init__(self, findings: Sequence[Finding], checkpoints: Sequence[int] | None = None) -> None:
        """``checkpoints``: the steps of the run's complete checkpoints (None: not known)."""
        self.findings = list(findings)
        self.since = min(f.since if f.since is not None else f.step for f in self.findings)
        super().__init__(_stop_message(self.findings, self.since, checkpoints))


def _healthy_checkpoint(since: int, checkpoints: Sequence[int] | None) -> str:
    """Which checkpoint to go back to: the last one before the window opened, named only if it exists."""
    before = [step for step in checkpoints or () if step < since]
    if before:
        return f"The checkpoint of step {max(before)}, the last before step {since}, is the last healthy one."
    if checkpoints is None and since > 1:
        return f"The last checkpoint before step {since}, if one was written, is the last healthy one."
    return (
        f"No checkpoint was written before step {since}, so there is no healthy one to go back to: fix "
        "the cause and rerun `grpo train`, which starts again from the SFT model."
    )


def _stop_message(findings: Sequence[Finding], since: int, checkpoints: Sequence[int] | None) -> str:
    boundary = any(f.rule.startswith("boundary_") for f in findings)
    trade = any(f.rule in TRADE_RULES for f in findings)
    causes = BOUNDARY_CAUSES if boundary else TRADE_CAUSES if trade else COLLAPSE_CAUSES
    lines = [f"training stopped at step {findings[0].step} by the health monitor:"]
    lines += [f"  - {f.rule}: {f.message}" for f in findings]
    lines.append("likely causes, most common first:")
    lines += [f"  {i}. {cause}" for i, cause in enumerate(causes, 1)]
    lines.append(
        f"{_healthy_checkpoint(since, checkpoints)} Fix the cause and rerun; to only log this rule set "
        f"monitor.{findings[0].rule}.action: warn in params.yaml."
    )
    return "\n".join(lines)


def raise_if_stop(findings: Sequence[Finding], checkpoints: Callable[[], Sequence[int]] | None = None) -> None:
    """Raise ``TrainingStopped`` when any finding's action is ``stop``; ``checkpoints`` (asked only then)
    gives the steps of the run's complete checkpoints, so the message names the last healthy one."""
    stops = [f for f in findings if f.action == "stop"]
    if stops:
        raise TrainingStopped(stops, None if checkpoints is None else checkpoints())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return repr(value)


# --------------------------------------------------------------------------- metric conditions
# Each returns (condition holds, value to report), or None when the metrics it needs are absent.

Condition = Callable[[Mapping[str, Any], float, Mapping[str, Any] | None], tuple[bool, Any] | None]


def _metric(name: str, test: Callable[[float, float], bool]) -> Condition:
    def condition(metrics, threshold, previous):
        value = metrics.get(name)
        return None if value is None else (test(float(value), threshold), float(value))

    return condition


def _entropy(test: Callable[[float, float], bool]) -> Condition:
    def condition(metrics, threshold, previous):
        value = metrics.get("entropy", metrics.get("policy/entropy"))
        return None if value is None else (test(float(value), threshold), float(value))

    return condition


def _content_length(test: Callable[[float, float], bool]) -> Condition:
    def condition(metrics, threshold, previous):
        value = mean_content_length(metrics)
        return None if value is None else (test(value, threshold), value)

    return condition


def _lengths_frozen(metrics, threshold, previous):
    keys = ("completions/min_length", "completions/max_length", "completions/mean_length")
    if any(key not in metrics for key in keys):
        return None
    low, high, mean = (float(metrics[key]) for key in keys)
    # The first frozen step starts a streak; later ones must repeat the previous frozen lengths.
    was_frozen = (
        previous is not None
        and all(key in previous for key in keys)
        and (float(previous[keys[1]]) - float(previous[keys[0]]) <= threshold)
    )
    unchanged = not was_frozen or float(previous[keys[2]]) == mean
    return (high - low <= threshold and unchanged), (low, high)


def _zero_grad(metrics, threshold, previous):
    values = [
        float(v) for k, v in metrics.items() if k in ("loss", "grad_norm") or k.startswith("grad_norm/")
    ]
    if not values:
        return None
    return all(abs(v) <= threshold for v in values), tuple(values)


_BELOW, _ABOVE, _AT_LEAST = (lambda v, t: v < t), (lambda v, t: v > t), (lambda v, t: v >= t)

BOUNDARY_METRIC_RULES: dict[str, tuple[str, Condition]] = {
    "boundary_empty": (
        "mean content length (completions/mean_length without the stop token) < {t}",
        _content_length(_BELOW),
    ),
    "boundary_clipped": ("completions/clipped_ratio > {t}", _metric("completions/clipped_ratio", _ABOVE)),
    "boundary_entropy_low": ("entropy < {t}", _entropy(_BELOW)),
    "boundary_entropy_high": ("entropy > {t}", _entropy(_ABOVE)),
}
COLLAPSE_RULES: dict[str, tuple[str, Condition]] = {
    "entropy_floor": ("entropy < {t}", _entropy(_BELOW)),
    "reward_zero_std": ("frac_reward_zero_std >= {t}", _metric("frac_reward_zero_std", _AT_LEAST)),
    "lengths_frozen": ("completion lengths (min, max) within {t} and unchanged", _lengths_frozen),
    "step_time": ("step_time < {t}s", _metric("step_time", _BELOW)),
    "max_prob": ("logits/max_prob >= {t}", _metric("logits/max_prob", _AT_LEAST)),
    "zero_grad": ("|loss| and grad norms <= {t}", _zero_grad),
}


# --------------------------------------------------------------------------- boundary text checks


def _plain(text: str) -> str:
    """Special tokens dropped and whitespace collapsed, so decoded prompt and completion compare."""
    return " ".join(_SPECIAL.sub(" ", text).split())


def _echoes(completion: str, prompt: str, width: int) -> bool:
    """The completion starts with the prompt's first ``width`` chars, or with a suffix of the prompt
    at least ``width`` chars long (what leaks when completions are cut at the wrong width, I4).
    An answer copied from the middle of the context is neither."""
    completion, prompt = _plain(completion), _plain(prompt)
    if len(completion) < width or len(prompt) < width:
        return False
    if completion.startswith(prompt[:width]):
        return True
    tail = prompt[-width:]
    start = completion.find(tail)
    while start != -1:
        if prompt.endswith(completion[: start + width]):
            return True
        start = completion.find(tail, start + 1)
    return False


# --------------------------------------------------------------------------- monitor


class Monitor:
    """Stateful reader of the per-step stream; one instance per run (or per resumed run)."""

    def __init__(self, cfg: MonitorConfig, history: Sequence[Mapping[str, Any]] = ()) -> None:
        """``history``: the steps a resumed run restored (``{"step", **metrics}``), which the trend rules
        (``grpo/health/kinds.py``) read their window from and the metric rules are replayed over, silently:
        a collapse under way at the checkpoint keeps its streak, so a resumed run stops at the very step
        the uninterrupted run would have (and a rule that fired before the checkpoint does not fire again)."""
        self.cfg = cfg
        self._trends = TrendWatch({rule: getattr(cfg, rule) for rule in TRADE_RULES}, history)
        self._streaks: dict[str, list[tuple[int, Any]]] = {}
        self._previous: Mapping[str, Any] | None = None
        self._missing_warned: set[str] = set()
        self._replaying = True
        for past in history:
            metrics = {k: v for k, v in past.items() if k != "step"}
            self._observe_metrics(int(past["step"]), metrics)
        self._replaying = False

    def in_boundary(self, step: int) -> bool:
        """Whether ``step`` is one of the first steps whose chat boundary is checked."""
        return step <= self.cfg.boundary_steps

    def _update(self, rule: str, step: int, holds: bool, value: Any, describe: str) -> list[Finding]:
        """Extend or break the rule's streak; a finding when the streak reaches ``window``."""
        rule_cfg: RuleConfig = getattr(self.cfg, rule)
        streak = self._streaks.setdefault(rule, [])
        if not holds:
            streak.clear()
            return []
        streak.append((step, value))
        if len(streak) != rule_cfg.window:
            return []
        if self._replaying:
            return []
        values = ", ".join(_fmt(v) for _, v in streak)
        since = streak[0][0]
        span = f"step {step}" if since == step else f"{rule_cfg.window} steps ({since}-{step})"
        message = f"{describe} for {span}: {values}"
        finding = Finding(rule, rule_cfg.action, step, message, since)
        (log.error if finding.action == "stop" else log.warning)(
            "monitor: %s at step %d: %s", rule, step, message
        )
        return [finding]

    def _run_rules(self, step: int, metrics: Mapping[str, Any], rules: dict) -> list[Finding]:
        findings = []
        for rule, (describe, condition) in rules.items():
            if getattr(self.cfg, rule).action == "off":
                continue
            result = condition(metrics, getattr(self.cfg, rule).threshold, self._previous)
            if result is None:
                self._streaks.pop(rule, None)  # unknown is not "holds": never fire on absent data
                if rule not in self._missing_warned and not self._replaying:
                    self._missing_warned.add(rule)
                    log.warning("monitor: step %d has no metric for rule %s; it cannot run", step, rule)
                continue
            threshold = _fmt(float(getattr(self.cfg, rule).threshold))
            findings += self._update(rule, step, result[0], result[1], describe.format(t=threshold))
        return findings

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Finding]:
        """Apply the collapse and trend rules (and, on the first steps, the boundary metric rules) to one step."""
        findings = self._observe_metrics(step, metrics)
        for found in self._trends.observe(step, metrics):
            finding = Finding(*found)
            (log.error if finding.action == "stop" else log.warning)(
                "monitor: %s at step %d: %s", finding.rule, step, finding.message
            )
            findings.append(finding)
        return findings

    def _observe_metrics(self, step: int, metrics: Mapping[str, Any]) -> list[Finding]:
        """The metric rules' findings of one step (the boundary ones on the first steps); the step becomes
        the previous one ``lengths_frozen`` compares with."""
        findings = self._run_rules(step, metrics, BOUNDARY_METRIC_RULES) if self.in_boundary(step) else []
        findings += self._run_rules(step, metrics, COLLAPSE_RULES)
        self._previous = dict(metrics)
        return findings

    def check_boundary(
        self,
        step: int,
        completions: Sequence[str],
        prompts: Sequence[str],
        header_tokens: Sequence[str],
        end_of_turn_tokens: Sequence[str],
    ) -> list[Finding]:
        """Text checks of one step's completions (decoded WITH special tokens, cut after their first
        stop token) against their prompts (one per completion). ``header_tokens``: the special tokens
        that are neither stop nor pad tokens; ``end_of_turn_tokens``: the stop tokens. Nothing is
        checked after the first ``boundary_steps`` steps."""
        if not self.in_boundary(step) or not completions:
            return []
        if len(prompts) != len(completions):
            raise MonitorError(
                f"check_boundary got {len(completions)} completions and {len(prompts)} prompts: pass the "
                "prompt of every completion (repeat each prompt group_size times)"
            )
        findings = []
        for rule, check in (
            ("boundary_header", self._headers),
            ("boundary_end_of_turn", self._end_of_turn),
            ("boundary_prompt_echo", self._echo),
        ):
            if getattr(self.cfg, rule).action != "off":
                holds, value, describe = check(completions, prompts, header_tokens, end_of_turn_tokens)
                findings += self._update(rule, step, holds, value, describe)
        return findings

    def _headers(self, completions, prompts, header_tokens, end_of_turn_tokens):
        tokens = [t for t in header_tokens if t]
        bad = [c for c in completions if any(t in c for t in tokens)]
        share = len(bad) / len(completions)
        example = f"; e.g. {bad[0][:120]!r}" if bad else ""
        threshold = self.cfg.boundary_header.threshold
        describe = (
            f"share of completions holding a chat-header token {tokens[:6]} > {_fmt(threshold)}{example}"
        )
        return share > threshold, share, describe

    def _end_of_turn(self, completions, prompts, header_tokens, end_of_turn_tokens):
        # Generation stops at the first stop token and the completion is cut there, so a stop token
        # ends a completion but never sits inside one. A model that wrote on after its turn ended
        # shows an end token that is not a stop token (Llama-3's <|eom_id|> or <|end_of_text|> where
        # the stop ids list only <|eot_id|>), or a stop token's text spelled in ordinary tokens.
        stops = [t for t in end_of_turn_tokens if t]
        tokens = stops + [t for t in header_tokens if t not in stops and _END_TOKEN.fullmatch(t)]
        counts = [sum(c.count(t) for t in tokens) for c in completions]
        worst = max(range(len(counts)), key=counts.__getitem__)
        threshold = self.cfg.boundary_end_of_turn.threshold
        describe = (
            f"end-of-turn tokens {tokens} in one completion (with the stop token that ends it) > "
            f"{_fmt(threshold)}; e.g. {completions[worst][:120]!r}"
        )
        return counts[worst] > threshold, counts[worst], describe

    def _echo(self, completions, prompts, header_tokens, end_of_turn_tokens):
        width = int(self.cfg.boundary_prompt_echo.threshold)
        bad = [c for c, p in zip(completions, prompts, strict=True) if _echoes(c, p, width)]
        example = f"; e.g. {bad[0][:120]!r}" if bad else ""
        return bool(bad), len(bad), f"completions starting with prompt text ({width} chars or more){example}"
