"""``model``: which model and tokenizer the pipeline trains, and GRPO's LoRA adapter (``grpo/model/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo.config.base import Section
from grpo.offline import model_source_problem

FastPathsSetting = Literal["auto", "off"]
"""``model.fast_paths``: ``auto`` runs each CPU fast path where its self-check passes, ``off`` the libraries'."""

Architecture = Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"]
"""The published architectures ``model.architecture`` can build (``grpo/model/architectures.py``)."""


class TinyModelConfig(Section):
    vocab_size: int = Field(600, ge=300)
    """BPE vocabulary size of the embedded tokenizer (special tokens included). A small vocabulary splits
    entity names into pieces, so names held out of training are spelled from pieces the model knows."""
    hidden_size: int = Field(128, ge=8)
    """Width of the embedded Llama model."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width of the embedded Llama model."""
    num_hidden_layers: int = Field(4, ge=1)
    """Decoder layers of the embedded Llama model."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads of the embedded Llama model (a divisor of hidden_size)."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention) of the embedded Llama model (a divisor of the heads)."""
    max_position_embeddings: int = Field(1024, ge=64)
    """Longest sequence the embedded model accepts."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self


class LoraConfig(Section):
    enabled: bool = True
    """GRPO trains a LoRA adapter on the SFT weights (reference: the adapter disabled); false: GRPO
    trains every weight (full fine-tuning) and the reference is a frozen copy of the SFT model (I9)."""
    r: int = Field(8, ge=1)
    """LoRA rank."""
    alpha: int = Field(16, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch, in [0, 1)."""
    target_modules: list[str] = Field(default_factory=lambda: ["v_proj", "o_proj"])
    """Module names that get an adapter. On the value and output projections only, the query and key
    weights that decide where attention looks stay as SFT left them; add q_proj, k_proj (and the MLP's
    gate_proj, up_proj, down_proj) for a larger adapter."""


class ModelConfig(Section):
    allow_download: bool = False
    """Let Hugging Face fetch a hub id that is not in the local cache; off: nothing goes online."""
    name_or_path: str | None = None
    """null builds the embedded tiny model; else a local model folder, a hub id already in the local cache,
    a ``.gguf`` file, or a named source (``smollm2-135m-instruct``: ``grpo/sources.py``). A GGUF file is
    converted once by the ``base`` stage."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint to run; off unless you trust its source."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype at load time (keep float32 for training: bf16 weights round every small update)."""
    pad_token: str | None = None
    """Pad token to set when the tokenizer has none (e.g. ``<|finetune_right_pad_id|>``); null uses eos."""
    extra_stop_tokens: list[str] = Field(default_factory=list)
    """Tokens that end a completion besides eos and the template's end-of-turn token."""
    chat_template_kwargs: dict[str, str] = Field(default_factory=dict)
    """Extra chat-template variables, e.g. ``{date_string: 26 Jul 2024}`` for a reproducible Llama-3.2 prompt."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Sizes of the embedded default model."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter settings."""
    architecture: Architecture | None = None
    """A published architecture built with random weights and its real tokenizer (``grpo/model/architectures.py``)."""
    architecture_overrides: dict[str, int] = Field(default_factory=dict)
    """Preset numbers to change, e.g. ``{num_hidden_layers: 2}`` for a fast shrunk copy of the architecture."""
    tokenizers_dir: str | None = None
    """Folder of the real tokenizers the architecture presets read (a subfolder each, e.g.
    ``qwen2.5-0.5b-instruct/``); needed only with ``architecture``."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel: PyTorch SDPA (flash/memory-efficient kernels on CUDA; loaded as ``sdpa_grouped``,
    ``grpo/model/kernels.py``), eager, or flash-attn 2 (its package)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of SFT and GRPO: less memory for about a third more compute."""
    fast_paths: FastPathsSetting = "auto"
    """``auto``: the CPU fast paths (own decode loop, lean decode step, exponential draws, oneDNN head, reuse
    of prefills) run where their self-checks pass; ``off``: the libraries' own ``generate``, forward,
    ``multinomial`` and ``F.linear`` (docs/performance.md "Fast paths")."""

    @model_validator(mode="after")
    def _one_model_source(self) -> ModelConfig:
        if self.architecture is not None and self.name_or_path is not None:
            raise ValueError(
                f"architecture ({self.architecture!r}) and name_or_path ({self.name_or_path!r}) are both "
                "set: architecture builds random weights, name_or_path loads trained ones; set one to null"
            )
        if self.architecture is not None and self.tokenizers_dir is None:
            raise ValueError(
                f"architecture {self.architecture!r} reads its real tokenizer from model.tokenizers_dir, which "
                "is null: set it to a folder holding the preset's tokenizer folder (e.g. llama-3.2-instruct/)"
            )
        return self

    @field_validator("fast_paths", mode="before")
    @classmethod
    def _off_as_written(cls, value: object) -> object:
        """YAML reads a bare ``off`` as false (and ``on`` as true): take them as the words they were."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("name_or_path")
    @classmethod
    def _loadable_offline(cls, value: str | None, info: ValidationInfo) -> str | None:
        allow = bool(info.data.get("allow_download", False))  # declared above, so validated first
        problem = None if value is None else model_source_problem(value, allow)
        if problem is not None:
            raise ValueError(problem)
        return value
