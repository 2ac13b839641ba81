"""Tiny random checkpoints of every model family beyond Llama and Qwen2, saved with transformers'
own config and model classes (`save_pretrained`), for the family tests.

Each is 2 layers (3 where a middle layer differs) over hidden 64 with 4 query / 2 KV heads of 16 (TP=2 splits them evenly), a
vocabulary of `VOCAB_SIZE` and weights larger than transformers' default initialisation so that
a wrong step moves the logits visibly. Family-specific parts are made non-trivial: norms' weights
random (not ones), Granite's multipliers away from 1, MoE with 8 experts and top-2 (Qwen3-MoE
with its middle layer dense, as `mlp_only_layers` allows), Gemma with sliding and full layers, a
window (`GEMMA_WINDOW`) far shorter than the test prompts, soft-capping on (Gemma 2) and a scaled
RoPE for the full layers (Gemma 3).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB_SIZE = 256
GEMMA_WINDOW = 8
# Listed by generation_config.json, as real checkpoints list their end-of-turn tokens.
EOS_TOKEN_IDS = [2, 5]


def _common(**overrides) -> dict:
    settings = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS_TOKEN_IDS[0], pad_token_id=0,
        initializer_range=0.1, tie_word_embeddings=False,
    )
    settings.update(overrides)
    return settings


# Family -> (config class, model class, family settings over `_common`).
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # Its middle layer without RoPE (NoPE).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        num_hidden_layers=3, mlp_only_layers=[1])),
    # A shared expert beside the routed ones, its middle layer dense.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    # Sliding and full layers (a window far shorter than the test prompts), each type with its
    # own RoPE base.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        sliding_window=GEMMA_WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # q/k/v biases, gate/up merged, RoPE over half of each head in interleaved pairs; GLM-4 adds
    # norms after attention and after the MLP.
    "glm": ("GlmConfig", "GlmForCausalLM", dict(attention_bias=True)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(attention_bias=True)),
    # Interleaved RoPE pairs over whole heads.
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict()),
    # q/k/v biases (Qwen2's computation).
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_bias=True)),
    # Post-norms, per-head q/k norms; its hybrid attention: sliding layers with RoPE, the full one
    # without.
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        sliding_window=GEMMA_WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Attention sinks, biases on q/k/v/o, sliding and full layers, YaRN; experts in 3-D tensors
    # with biases, a clamp low enough to bind, and top-k logits softmaxed among themselves.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, swiglu_limit=1.0, sliding_window=GEMMA_WINDOW,
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
    # Granite's multipliers; experts in two 3-D tensors, top-k logits softmaxed among themselves.
    "granite_moe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=6.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=4.0)),
    # Multi-head latent attention (a latent of 56 + 8 rotated dims, value heads narrower than the
    # query's), its first layer dense, routed experts in 4 groups of which 2 are kept, shared
    # experts, YaRN with DeepSeek's mscale, an RMSNorm epsilon large enough to show (the latent's
    # norms keep 1e-6). V2: the query from the hidden state, softmax routing unrenormalised.
    # V3: the query through its latent, sigmoid routing with a correction bias, RoPE in halves.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=56, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, num_hidden_layers=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, rms_norm_eps=1e-2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=56, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
        first_k_dense_replace=1, num_hidden_layers=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=False, rms_norm_eps=1e-2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    # GLM-4.5: q/k/v biases, RoPE over half of each head in halves, DeepSeek-V3's routing (made
    # random correction bias, groups) with a shared expert after a dense first layer.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, num_hidden_layers=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True)),
    # MiniMax-M2: full-width q/k norms under a partial rotation (8 of 16 dims, as its 64 of 128),
    # sigmoid routing with a correction bias (made random), experts stored as Mixtral's.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, rotary_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # ERNIE 4.5 MoE: interleaved RoPE pairs, softmax routing with a correction bias (made random)
    # for the choice, shared experts; sparse layers every second one from the first.
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=8, moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1, num_hidden_layers=3,
        moe_layer_start_index=0, moe_layer_interval=2, tie_word_embeddings=True)),
    # Granite 4.0 with attention in every layer (granite-4.0-micro): Granite's multipliers and a
    # shared MLP, no experts (the dense one) or routed experts beside it (Granite-MoE-Shared).
    "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["attention", "attention"], position_embedding_type="rope", num_local_experts=0,
        shared_intermediate_size=80, embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=4.0)),
    "granite_moe_shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=80, embedding_multiplier=6.0,
        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)),
    # AFMoE (Arcee Trinity): gated attention with per-head q/k norms, sliding layers that rotate and
    # a full one that does not, four norms a layer, muP-scaled embeddings, sigmoid routing with an
    # expert bias (made random) and a route scale, shared experts after a dense first layer.
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, num_shared_experts=1, num_dense_layers=1,
        num_hidden_layers=3, sliding_window=GEMMA_WINDOW, route_scale=2.0, mup_enabled=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # dots.llm1: Qwen3's attention (a sliding window in its last layer) with DeepSeek-V3's experts.
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, num_hidden_layers=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, sliding_window=GEMMA_WINDOW, max_window_layers=2)),
    # Hunyuan dense: per-head q/k norms after RoPE, a base stretched by a fixed NTK alpha.
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(
        rope_parameters={"rope_type": "dynamic", "alpha": 8.0, "factor": 1.0, "rope_theta": 10000.0})),
    # Apertus: a non-gated MLP through xIELU (its per-layer parameters made random), per-head
    # q/k norms, Llama 3's RoPE scaling.
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    # A parallel block under one LayerNorm, interleaved RoPE pairs, tied embeddings and scaled
    # logits; Cohere 2 with sliding layers (a window of 8) that rotate and a full one that does not.
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.3, layer_norm_eps=1e-3, tie_word_embeddings=True)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        logit_scale=0.3, layer_norm_eps=1e-3, tie_word_embeddings=True, sliding_window=GEMMA_WINDOW,
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Both layer kinds, a window (8) far shorter than the test prompts, soft-capping on.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
}


def _randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights away from their initial ones, so that a norm applied in the wrong place shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


# Families whose biases (DeepSeek-V3's router correction) and attention sinks transformers initialises to zero or near it: made
# random, so that a bias or sink dropped or misplaced shows.
RANDOM_BIASES = {"gpt_oss", "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe", "afmoe", "dots1"}


def _randomise_activations(model: torch.nn.Module) -> None:
    """xIELU's learned parameters away from their initial ones (Apertus)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".act_fn.alpha_" in name:
                param.uniform_(-0.5, 1.0)


def _randomise_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:  # V3's correction is a buffer
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("sinks"):
                param.uniform_(-1.0, 2.0)


def make_family(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """`family`'s tiny checkpoint (see `FAMILIES`; `overrides` over its settings) saved in
    `out_dir`, with a generation config listing `EOS_TOKEN_IDS`."""
    config_name, model_name, settings = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**_common(**{**settings, **overrides}))
    model = getattr(transformers, model_name)(config).eval()
    _randomise_norms(model)
    _randomise_activations(model)
    if family in RANDOM_BIASES:
        _randomise_biases(model)
    model.generation_config.eos_token_id = EOS_TOKEN_IDS
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


