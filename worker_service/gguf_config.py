"""What a GGUF file says about the model that transformers' reading of it leaves out.

The worker's config is transformers' reading of the file's metadata (radixserve/model_source.py),
which for these architectures drops settings llama.cpp reads; served from it, the file would be
another model than the checkpoint it was made from. `complete_config` puts them back:

- **RoPE scaling**, written by llama.cpp's converter in two ways:
  - a `rope_freqs` tensor of per-frequency divisors (Llama 3.x: its `llama3` scaling, computed
    once by the converter): each inverse frequency is divided by its factor, as llama.cpp does;
  - `<arch>.rope.scaling.*` metadata: `linear` (factor) and `yarn` (factor, the original context,
    and the betas where given) map onto the same settings of a Hugging Face config. A YaRN
    `attn_factor` other than 1 (llama.cpp's own scaling of the attention temperature) and other
    types are refused by name, never served as plain RoPE;
  - Phi-3's longrope as `rope_factors_short/long` tensors, with the original context and the
    attention factor in the metadata: served within the original context, as a config's longrope
    is (`rotary.served_context`).
- **A sliding window** (`attention.sliding_window`), which transformers reads for Gemma only:
  set on the config, so that the family applies it as transformers' class does (Phi-3's 2,047
  under a 4,096 context, in every layer) or refuses it by name, rather than attending to
  everything;
- **A partial rotation** (`rope.dimension_count` under the head size: Phi-4-mini's 96 of 128),
  which transformers leaves out for `phi3`;
- **The head size** (`attention.key_length`), which transformers takes as its config's default
  for `qwen3` and `qwen3moe` files, 128 (a file of other heads would not load);
- **Gemma's settings**: its soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`),
  its query scale (`query_pre_attn_scalar`, which no key holds: llama.cpp's rule, the head size
  but hidden / heads for the 27B models), and Gemma 3's RoPE per layer type (the file's scaling
  for the full layers, its SWA base for the sliding ones, as llama.cpp applies them);
  transformers leaves all of them at its defaults;
- **Mixtral**, which llama.cpp writes as a `llama` file with experts (`expert_count`,
  `expert_used_count`) and transformers reads as a Llama without them: served as Mixtral;
- **Mixture-of-experts widths**: the experts' and the shared expert's
  (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), which transformers leaves
  at its config's defaults (Qwen3-MoE's 768, Qwen2-MoE's 1,408 and 5,632: any other model's
  file would not load).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from worker_service.layers.rotary import rope_parameters
from worker_service.unsupported import UnsupportedModel

ROPE_FREQS = "rope_freqs.weight"
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
LONGROPE_FACTORS = {LONG_FACTORS, SHORT_FACTORS}
# `<arch>.<key>` -> the config setting it sizes.
MOE_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
             "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
GEMMA = ("gemma2", "gemma3")
# llama.cpp scales a Gemma 27B's queries by hidden / heads, every other Gemma's by the head size
# (as their configs' query_pre_attn_scalar say); it tells the 27B models by their layer count.
WIDE_QUERY_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
# `<arch>.rope.scaling.<key>` -> the Hugging Face rope parameter it sets, for YaRN.
YARN_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
             "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def complete_config(reader: GGUFReader, architecture: str, config: Any) -> None:
    """Set on `config` (transformers' reading of the file) what the file says and it left out."""
    fields = reader.fields
    key_length = f"{architecture}.attention.key_length"
    if key_length in fields and hasattr(config, "head_dim"):
        config.head_dim = int(_value(reader, key_length))
    window = f"{architecture}.attention.sliding_window"
    if window in fields and hasattr(config, "sliding_window"):  # the family follows it or refuses it
        config.sliding_window = int(_value(reader, window))
    rope_dims = f"{architecture}.rope.dimension_count"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_dims in fields and int(_value(reader, rope_dims)) < head_dim:  # a partial rotation (Phi-4-mini)
        config.rope_parameters = {**rope_parameters(config),
                                  "partial_rotary_factor": int(_value(reader, rope_dims)) / head_dim}
    if architecture in GEMMA:
        _complete_gemma(reader, architecture, config)
    else:
        config.rope_parameters = rope_parameters_of(reader, architecture, rope_parameters(config))
    for key, setting in MOE_SIZES.items():
        if f"{architecture}.{key}" in fields and hasattr(config, setting):
            setattr(config, setting, int(_value(reader, f"{architecture}.{key}")))
    experts = f"{architecture}.expert_count"
    if architecture == "llama" and int(_value(reader, experts) if experts in fields else 0) > 0:
        # Mixtral, which llama.cpp writes as a Llama with experts (of `feed_forward_length`)
        config.architectures = ["MixtralForCausalLM"]
        config.num_local_experts = int(_value(reader, experts))
        config.num_experts_per_tok = int(_value(reader, f"{architecture}.expert_used_count"))


def _complete_gemma(reader: GGUFReader, architecture: str, config: Any) -> None:
    """Gemma's soft-caps, its query scale as llama.cpp derives it, and (Gemma 3) each layer
    type's RoPE: the file's scaling for the full layers, its SWA base for the sliding ones."""
    fields = reader.fields
    for setting in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{architecture}.{setting}" in fields:
            setattr(config, setting, float(_value(reader, f"{architecture}.{setting}")))
    wide = config.num_hidden_layers == WIDE_QUERY_SCALE_LAYERS[architecture]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if wide else config.head_dim
    by_type = config.rope_parameters
    if not all(isinstance(params, dict) for params in by_type.values()):  # Gemma 2: one RoPE
        config.rope_parameters = rope_parameters_of(reader, architecture, rope_parameters(config))
        return
    sliding = dict(by_type["sliding_attention"])  # the full layers' base transformers does read
    if f"{architecture}.rope.freq_base_swa" in fields:
        sliding["rope_theta"] = float(_value(reader, f"{architecture}.rope.freq_base_swa"))
    config.rope_parameters = {"sliding_attention": sliding,
                              "full_attention": rope_parameters_of(reader, architecture,
                                                                   dict(by_type["full_attention"]))}


def rope_parameters_of(reader: GGUFReader, architecture: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` (the config's flat `rope_parameters`) with what the file says about RoPE scaling."""
    params = dict(params)
    prefix = f"{architecture}.rope.scaling."
    scaling = {key[len(prefix):]: _value(reader, key) for key in reader.fields if key.startswith(prefix)}
    kind = scaling.pop("type", "none")
    if kind == "linear":
        params.update(rope_type="linear", factor=float(scaling["factor"]))
    elif kind == "yarn":
        if float(scaling.get("attn_factor", 1.0)) != 1.0:
            raise UnsupportedModel(f"a GGUF file's YaRN attn_factor {float(scaling['attn_factor']):g} (llama.cpp's own "
                                   "attention scaling) is not supported")
        params.update(rope_type="yarn", **{ours: float(scaling[key]) for key, ours in YARN_KEYS.items()
                                           if key in scaling})
        if "original_max_position_embeddings" in params:
            params["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    elif kind not in ("none", "longrope") and float(scaling.get("factor", 1.0)) != 1.0:
        raise UnsupportedModel(f"a GGUF file's RoPE scaling type {kind!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if LONGROPE_FACTORS <= tensors.keys():  # Phi-3's longrope, served within its original context
        params.update(rope_type="longrope", short_factor=_floats(tensors[SHORT_FACTORS]),
                      long_factor=_floats(tensors[LONG_FACTORS]))
        if "original_context_length" in scaling:
            params["original_max_position_embeddings"] = int(scaling["original_context_length"])
        if "attn_factor" in scaling:
            params["attention_factor"] = float(scaling["attn_factor"])
    tensor = tensors.get(ROPE_FREQS)
    if tensor is not None:
        params["freq_factors"] = _floats(tensor)
    return params


def _floats(tensor) -> list[float]:
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1).tolist()


def _value(reader: GGUFReader, key: str) -> Any:
    value = reader.fields[key].contents()
    return value.decode() if isinstance(value, bytes) else value
