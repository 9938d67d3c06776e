"""The vLLM rollout engine, colocated with the trainer on the same GPU (``grpo.rollout.engine: vllm``).

Colocated: vLLM runs inside the trainer's process and takes ``gpu_memory_utilization`` of the GPU;
with ``sleep`` it releases its memory between rollouts (``LLM.sleep``/``wake_up``) so the training
phase gets it back. After every optimizer step the trainer calls ``sync_weights``: the LoRA adapter
is merged into a copy of the weights that is streamed into vLLM's model (``load_weights``), then
unmerged, so vLLM always samples from the current policy.

It samples by the same rules as the Hugging Face path (``rollout.generate_rollout``):
- stop tokens: the trainer's ``eos_ids`` (eos, the template's end-of-turn, the model's own);
- presence/frequency penalties: vLLM applies them to generated tokens only (I6), and the repetition
  penalty, which would read the prompt, stays 1.0;
- EOS suppression: ``min_tokens`` bans the stop tokens until that many completion tokens exist, the
  rule of ``sampling.EosSuppressor``;
- the completions go through ``rollout_from_sequences``: cut at the prompt width (I4), masked by
  position up to the first stop token (I5).
The log-probs it reports are vLLM's ``processed_logprobs`` (after temperature, the distribution the
trainer scores, I10); the step compares them with its own scoring (``core/importance.py``). With
``top_p`` < 1 or ``top_k`` they are renormalised over the kept tokens, while the trainer scores the
full softmax: the mismatch metric then shows that gap too.

Needs CUDA and the optional extra: ``pip install -e ".[vllm]"``. Its tests are marked ``gpu``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Hashable, Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import RolloutConfig, SamplingConfig
from grpo.core.batching import left_pad
from grpo.errors import GrpoError
from grpo.model.engine_types import EngineRollout
from grpo.model.rollout import rollout_from_sequences
from grpo.model.sampling import EosSuppressor


class EngineError(GrpoError):
    """The vLLM engine cannot start; the message says what is missing and the fix."""


def _single_process_env() -> None:
    """vLLM's external launcher reads the torch.distributed variables; set them for a lone process."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the policy with any LoRA adapter merged, named as the plain model names them.

    Call inside ``merge_adapter()``/``unmerge_adapter()`` for a peft model; the adapter's own tensors
    and peft's copies of the original modules are skipped.
    """
    for name, param in model.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" in name or "original_module" in name or "modules_to_save" in name:
            continue
        yield name, param.data


class VLLMEngine:
    """vLLM in this process, sharing the GPU with the trainer."""

    name = "vllm"

    def __init__(
        self,
        cfg: RolloutConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int = 4096,
        seed: int = 0,
    ) -> None:
        if not torch.cuda.is_available():
            raise EngineError("grpo.rollout.engine=vllm needs a CUDA GPU; use grpo.rollout.engine=hf on CPU")
        try:
            import vllm
        except ImportError:
            raise EngineError(
                "grpo.rollout.engine=vllm: vLLM is not installed; pip install -e '.[vllm]' "
                "or use grpo.rollout.engine=hf"
            ) from None
        self.vllm, self.cfg, self.tokenizer = vllm, cfg, tokenizer
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model must live in this process
        _single_process_env()
        self._folder = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        self._export(model, self._folder.name)  # vLLM starts from the trainer's current weights
        self.llm = vllm.LLM(
            model=self._folder.name,
            dtype="bfloat16",
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=cfg.sleep,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
        )
        self._asleep = False
        self._sleep()

    def _export(self, model: torch.nn.Module, folder: str) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with _merged(model):
            state = {name: tensor.detach().cpu() for name, tensor in merged_weights(model)}
            base.save_pretrained(folder, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)

    def _runner_model(self) -> torch.nn.Module:
        worker = self.llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model

    def _sleep(self) -> None:
        if self.cfg.sleep and not self._asleep:
            self.llm.sleep(level=1)  # level 1: weights to CPU, KV cache freed
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Stream the merged policy weights into vLLM (after every optimizer step)."""
        self._wake()
        runner = self._runner_model()
        with _merged(model), torch.no_grad():
            for name, tensor in merged_weights(model):
                runner.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._sleep()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        eos_ids: Sequence[int],
        seed: int,
        segments: Sequence[Hashable] | None = None,
        keep_prefill: bool = False,
    ) -> EngineRollout:
        """One request per completion, each seeded by (seed, row), so a run is reproducible. vLLM
        prefills with its own kernels, not the trainer's graph: ``segments`` and ``keep_prefill`` change
        nothing."""
        repeated = [list(p) for p in prompts for _ in range(group_size)]
        requests = [{"prompt_token_ids": ids} for ids in repeated]
        params = [
            self.vllm.SamplingParams(**sampling_kwargs(sampling, eos_ids, seed + row))
            for row in range(len(repeated))
        ]
        self._wake()
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        self._sleep()
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [
            [step[token].logprob for step, token in zip(out.outputs[0].logprobs, ids, strict=True)]
            for out, ids in zip(outputs, completions, strict=True)
        ]
        return assemble(self.tokenizer, repeated, completions, logprobs, eos_ids, sampling, group_size)


def sampling_kwargs(sampling: SamplingConfig, eos_ids: Sequence[int], seed: int) -> dict:
    """The HF path's sampling rules as ``vllm.SamplingParams`` arguments (see the module docstring):
    the trainer's stop ids, stop ids banned until ``min_new_tokens``, penalties on generated tokens
    only (presence/frequency; the prompt-reading repetition penalty off), the sampled token's log-prob."""
    return dict(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_new_tokens,
        min_tokens=sampling.min_new_tokens,
        stop_token_ids=list(eos_ids),
        ignore_eos=False,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=1.0,
        logprobs=0,
        seed=seed,
        skip_special_tokens=False,
        detokenize=False,
    )


def assemble(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    eos_ids: Sequence[int],
    sampling: SamplingConfig,
    group_size: int,
) -> EngineRollout:
    """An engine's per-row token lists -> the same ``Rollout`` the HF path builds (left-padded prompts,
    completions cut at the prompt width and masked by position) plus the sampler log-probs [N, C]."""
    prompt = left_pad(prompts, tokenizer.pad_token_id)
    width = max(1, max(len(c) for c in completions))
    body = torch.full((len(completions), width), tokenizer.pad_token_id, dtype=torch.long)
    sampler = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, (ids, lps) in enumerate(zip(completions, logprobs, strict=True)):
        body[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        sampler[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    sequences = torch.cat([prompt.input_ids, body], dim=1)  # [N, P + C], as generate() returns
    # vLLM applies min_tokens itself and does not count suppressions: the metric reads 0 here.
    suppressor = EosSuppressor(prompt.input_ids.shape[1], eos_ids, sampling.min_new_tokens)
    rollout = rollout_from_sequences(tokenizer, prompt, sequences, eos_ids, suppressor, group_size, sampling)
    return EngineRollout(rollout, sampler * rollout.completion_mask)


class _merged:
    """``with _merged(model):`` LoRA merged into the base weights inside, unmerged after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.peft = hasattr(model, "merge_adapter")

    def __enter__(self) -> None:
        if self.peft:
            self.model.merge_adapter()

    def __exit__(self, *exc) -> None:
        if self.peft:
            self.model.unmerge_adapter()
