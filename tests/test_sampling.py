"""grpo/model/sampling.py: penalties and EOS suppression look at completion tokens only (I6)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from grpo.config import SamplingConfig
from grpo.core.batching import left_pad
from grpo.errors import GrpoError
from grpo.model import chat
from grpo.model.sampling import CompletionPenalty, EosSuppressor, build_logits_processors

V = 12
EOS = (3, 5)


def _scores(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed))  # [B, V]


# --------------------------------------------------------------------------- penalties


def test_i6_prompt_only_repeated_words_do_not_change_first_step_logits_of_the_processor():
    prompt = torch.full((2, 30), 7)  # [B, P] a prompt that is one word repeated
    scores = _scores()
    penalty = CompletionPenalty(prompt_width=30, presence_penalty=1.5, frequency_penalty=0.7)
    assert torch.equal(penalty(prompt, scores), scores)


def test_penalties_apply_to_repeated_completion_tokens():
    prompt_width = 4
    input_ids = torch.tensor([[7, 7, 7, 7, 1, 1, 2], [7, 7, 7, 7, 9, 1, 9]])  # [B, P + 3]
    scores = _scores()
    out = CompletionPenalty(prompt_width, presence_penalty=1.5, frequency_penalty=0.5)(input_ids, scores)
    counts = torch.zeros(2, V)
    counts[0, 1], counts[0, 2], counts[1, 9], counts[1, 1] = 2, 1, 2, 1
    expected = scores - 0.5 * counts - 1.5 * (counts > 0).float()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert torch.equal(out[:, 7], scores[:, 7])  # the prompt's word stays untouched


def _repeated_word_prompt(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": " ".join(["station"] * 40)}]
    return left_pad([chat.render_prompt(tokenizer, messages)], tokenizer.pad_token_id).input_ids  # [1, P]


def _generate_scores(model, tokenizer, prompt, **kwargs):
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=2,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=chat.end_of_turn_ids(tokenizer),
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out


def test_i6_prompt_only_repeated_words_do_not_change_first_step_logits(tiny_model, tiny_tokenizer):
    prompt = _repeated_word_prompt(tiny_tokenizer)
    width = prompt.shape[1]
    cfg = SamplingConfig(presence_penalty=2.0, frequency_penalty=1.0, min_new_tokens=0)
    processors, _ = build_logits_processors(width, chat.end_of_turn_ids(tiny_tokenizer), cfg)
    plain = _generate_scores(tiny_model, tiny_tokenizer, prompt)
    penalised = _generate_scores(tiny_model, tiny_tokenizer, prompt, logits_processor=processors)
    torch.testing.assert_close(penalised.scores[0], plain.scores[0], atol=1e-5, rtol=1e-5)
    # Step 2 sees the first generated token in the completion: it is penalised once, nothing else is.
    first = int(penalised.sequences[0, width])
    shift = plain.logits[1] - penalised.scores[1]  # [1, V]
    assert shift[0, first].item() == pytest.approx(2.0 + 1.0, abs=1e-5)
    shift[0, first] = 0.0
    assert shift.abs().max().item() < 1e-5
    # The check has power: HF's repetition_penalty counts the prompt and changes step one.
    hf = _generate_scores(tiny_model, tiny_tokenizer, prompt, repetition_penalty=3.0)
    word = tiny_tokenizer.convert_tokens_to_ids("Ġstation")
    assert word in prompt[0].tolist()
    assert not torch.allclose(hf.scores[0][0, word], plain.scores[0][0, word], atol=1e-5)


# --------------------------------------------------------------------------- EOS suppression


def test_eos_suppression_counts_the_completion_only():
    """A prompt longer than min_new_tokens still suppresses at step 0; it stops at min_new_tokens."""
    prompt_width, min_new = 20, 3
    suppressor = EosSuppressor(prompt_width, EOS, min_new)
    scores = _scores()
    for step in range(min_new + 2):
        input_ids = torch.ones(2, prompt_width + step, dtype=torch.long)  # [B, P + step]
        out = suppressor(input_ids, scores)
        eos_logits = out[:, list(EOS)]
        if step < min_new:
            assert torch.isneginf(eos_logits).all(), step
        else:
            assert torch.equal(out, scores), step
    assert suppressor.fired == 2 * min_new


def test_eos_suppression_never_raises_eos_probability_nor_touches_other_logits():
    suppressor = EosSuppressor(prompt_width=4, eos_ids=EOS, min_new_tokens=2)
    for seed in range(5):
        scores = _scores(batch=3, seed=seed) * 5
        out = suppressor(torch.zeros(3, 5, dtype=torch.long), scores)
        before, after = scores.softmax(-1), out.softmax(-1)
        assert (after[:, list(EOS)] <= before[:, list(EOS)]).all()
        others = [i for i in range(V) if i not in EOS]
        assert torch.equal(out[:, others], scores[:, others])


def test_eos_suppressor_fired_counters_and_reset():
    suppressor = EosSuppressor(prompt_width=2, eos_ids=EOS, min_new_tokens=2)
    scores = torch.zeros(3, V)
    scores[0, EOS[0]] = 5.0  # the model wants to stop in row 0 ...
    scores[1, EOS[1]] = 5.0  # ... and in row 1, but not in row 2
    scores[2, 0] = 5.0
    suppressor(torch.zeros(3, 2, dtype=torch.long), scores)
    suppressor(torch.zeros(3, 3, dtype=torch.long), scores)
    suppressor(torch.zeros(3, 4, dtype=torch.long), scores)  # min_new_tokens reached: not counted
    assert (suppressor.fired, suppressor.fired_on_top) == (6, 4)
    assert suppressor.suppressed_frac() == pytest.approx(4 / 6)
    suppressor.reset()
    assert (suppressor.fired, suppressor.fired_on_top, suppressor.suppressed_frac()) == (0, 0, 0.0)


class _EosLover(LogitsProcessor):
    """Stands for a model that wants to stop at once: eos logits raised far above the rest."""

    def __init__(self, eos_ids):
        self.eos_ids = eos_ids

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.eos_ids] += 100.0
        return scores


def test_eos_suppressor_in_real_generate_keeps_min_new_tokens(tiny_model, tiny_tokenizer):
    prompt = _repeated_word_prompt(tiny_tokenizer)  # far longer than min_new_tokens
    cfg = SamplingConfig(min_new_tokens=4, max_new_tokens=6)
    eos_ids = chat.end_of_turn_ids(tiny_tokenizer)
    processors, suppressor = build_logits_processors(prompt.shape[1], eos_ids, cfg)
    processors.insert(0, _EosLover(eos_ids))
    with torch.no_grad():
        sequences = tiny_model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=tiny_tokenizer.pad_token_id,
            eos_token_id=eos_ids,
            logits_processor=processors,
        )
    completion = sequences[0, prompt.shape[1] :].tolist()
    assert len(completion) == cfg.min_new_tokens + 1 and completion[-1] in eos_ids
    assert not set(completion[:-1]) & set(eos_ids)
    assert (suppressor.fired, suppressor.fired_on_top) == (cfg.min_new_tokens, cfg.min_new_tokens)
    assert suppressor.suppressed_frac() == 1.0


def test_processors_reject_input_narrower_than_the_prompt():
    with pytest.raises(GrpoError, match="prompt width"):
        EosSuppressor(10, EOS, 1)(torch.zeros(1, 5, dtype=torch.long), _scores(1))
    with pytest.raises(GrpoError, match="prompt width"):
        CompletionPenalty(10, 1.0, 1.0)(torch.zeros(1, 5, dtype=torch.long), _scores(1))


def test_build_logits_processors_adds_penalty_only_when_set():
    eos = list(EOS)
    processors, suppressor = build_logits_processors(8, eos, SamplingConfig(min_new_tokens=2))
    assert list(processors) == [suppressor] and suppressor.min_new_tokens == 2
    processors, suppressor = build_logits_processors(8, eos, SamplingConfig(presence_penalty=0.5))
    assert isinstance(processors[0], CompletionPenalty) and processors[-1] is suppressor
