"""The fast paths: code that stands in for a library path to run it faster, behind one switch.

``model.fast_paths: off`` runs the libraries' own paths (``model.generate`` with the project's processors
and stop ids, the model's forward, ``torch.multinomial``, ``F.linear``): the readable reference of how the
project samples and scores. ``auto`` (the default) runs each fast path where its self-check passes, and
says once in the run's log which ones it uses and which fell back and why (``FastPaths.announce``); a
self-check that fails (a torch or transformers release that computes otherwise) falls back with a
``FastPathWarning`` and never changes a number silently.

| fast path | module | stands in for | self-check | numbers |
| --- | --- | --- | --- | --- |
| decode loop | ``decode.py`` | ``model.generate`` (``grpo/model/generation.py``) | ``loop_mismatch``: generate's tokens on a small random Llama | the same tokens |
| lean decode step | ``lean_step.py`` | the model's forward at each one-token step (CPU) | its first step of each kind against the model's forward | bit for bit |
| CUDA graph decode step | ``graph_step.py`` | the model's forward at each one-token step (GPU) | each rollout's first graph step against the model's forward | ``STATIC_BOUND`` of the logits' scale |
| exponential draws | ``multinomial.py`` | ``torch.multinomial``'s serial ``exponential_`` | ``exponential_mismatch``: the same draws, generator state after | the same tokens |
| greedy-pass reuse | ``prompt_pass.py`` | evaluation's own prefill of its samples | every pass: ``PrefixWatch``, ``rows_independent`` | bit for bit |
| oneDNN head product | ``head.py`` | ``F.linear`` in the fp32 head | ``onednn_mismatch``: F.linear's product on a probe | fp32 rounding (1e-6 of the logits' scale) |
| prefill reuse | ``prefill.py`` | the update's own pass over the prompts | its conditions (``prefill_reusable``) | bit for bit |

Callers import this package only (``FastPaths``, and the two hooks the model's own modules call:
``fp32_product`` for the head, ``watch_attention`` for the attention kernel); ``tests/test_layers.py``
holds that, and that nothing in this folder imports the code that calls it.
"""

from grpo.model.fast.head import fp32_product
from grpo.model.fast.paths import FastPaths
from grpo.model.fast.prompt_pass import PromptPass, watch_attention
from grpo.model.fast.warning import FastPathWarning

__all__ = ["FastPathWarning", "FastPaths", "PromptPass", "fp32_product", "watch_attention"]
