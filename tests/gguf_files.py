"""Test helper: write the embedded tiny Llama and its tokenizer to a small GGUF file.

The file is laid out the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama model with a GPT-2-style
(byte-level BPE) tokenizer, so tests can load it back with
``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` / ``AutoModelForCausalLM.from_pretrained(...)`` and
check what survives the round trip (weights do; transformers' conversion of the special tokens does not).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

ARCH = gguf.MODEL_ARCH.LLAMA
Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q8_0_BLOCK = gguf.GGML_QUANT_SIZES[Q8_0][0]  # values per block: a row must be a multiple of it


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half q/k rows into llama.cpp's interleaved
    pairs. transformers' GGUF loader reverses exactly this, so it must match (n_head_kv is used for k)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_tokenizer(
    writer: gguf.GGUFWriter,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    eos_token: str | None,
    pad_token: str | None,
    add_bos_token: bool | None,
    omit: Collection[str],
) -> None:
    """The ``tokenizer.*`` keys convert_hf_to_gguf.py writes for a GPT-2-style BPE vocab (but ``omit``'s)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    # llama.cpp pads the list to the model's vocab_size with unused placeholders (embedding rows with no token).
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]  # tokenizers >=0.20 stores pairs

    writer.add_tokenizer_model("gpt2")
    # The pre-tokenizer llama.cpp would pick for this regex (HF ByteLevel's GPT-2 pattern); transformers
    # ignores this key and always uses ByteLevel for a "gpt2" vocab under the llama architecture.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids(tokenizer.bos_token))
    if "eos_token_id" not in omit:
        writer.add_eos_token_id(tokenizer.convert_tokens_to_ids(eos_token or tokenizer.eos_token))
    pad = pad_token or tokenizer.pad_token
    if pad is not None:
        writer.add_pad_token_id(tokenizer.convert_tokens_to_ids(pad))
    if "add_bos_token" not in omit:
        writer.add_add_bos_token(add_bos_token)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    *,
    quantize: bool = False,
    eos_token: str | None = None,
    pad_token: str | None = None,
    add_bos_token: bool = False,
    drop: Collection[str] = (),
    omit: Collection[str] = (),
) -> Path:
    """Write ``model`` (a Llama) and ``tokenizer`` (byte-level BPE) to the GGUF file ``path``; return it.

    F32 tensors, or with ``quantize`` the 2D weights as Q8_0 (norms stay F32). ``eos_token``/``pad_token``
    override the tokenizer's; ``add_bos_token`` sets ``tokenizer.ggml.add_bos_token``. ``drop``: names
    (Hugging Face's) of weights left out of the file, as an incomplete conversion would; ``omit``: keys of
    ``tokenizer.ggml.*`` left out (``eos_token_id``, ``add_bos_token``), as older or broken converters do.
    """
    cfg = model.config
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_head, n_head_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH])
    writer.add_name("grpo-tiny-llama")  # transformers reads "mistral" in the name as another architecture
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.vocab_size)
    _write_tokenizer(writer, tokenizer, cfg.vocab_size, eos_token, pad_token, add_bos_token, omit)

    names = gguf.get_tensor_name_map(ARCH, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name in drop or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # tied: no `output` tensor (how transformers detects tie_word_embeddings)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF llama name for {hf_name}")
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if name.endswith("attn_q.weight"):
            data = _permute(data, n_head, n_head)
        elif name.endswith("attn_k.weight"):
            data = _permute(data, n_head, n_head_kv)
        if quantize and data.ndim == 2 and data.shape[-1] % Q8_0_BLOCK == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
