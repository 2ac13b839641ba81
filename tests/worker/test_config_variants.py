"""Checkpoint settings beyond the family tests' one configuration each: every variant either
computes what transformers computes (prompt and decode logits, float32, the PyTorch backend) or
is refused at load with `UnsupportedModel` naming the setting, which the worker reports in one
line. Never a third outcome: a setting that is neither implemented nor refused is computed some
other way without a word.

The variants are settings real checkpoints carry (or that transformers reads differently per
family, as Gemma 3's attention soft-cap, which it keeps but never applies). The reference runs
transformers' eager attention, the only one that applies every setting it does apply.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.families import make_family
from worker.test_model_families import ATOL, PROMPT_LEN, prompt, runner_for
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.quant import quantizer
from worker_service.unsupported import UnsupportedModel

pytestmark = pytest.mark.timeout(300)
NUM_DECODE_STEPS = 4


def rope(**params) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, **params}}


# (family, settings over the family's, what a refusal must name; None: must match transformers)
VARIANTS = [
    ("gemma3", dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0), None),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None), None),
    ("qwen3", dict(head_dim=32), None),
    ("qwen3", rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), None),
    ("mistral", rope(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2,
                   mscale=0.9, mscale_all_dim=0.5, truncate=False), None),
    ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "attention_factor": 1.3}}), None),
    # NTK-scaled within the model's context: transformers' plain frequencies there.
    ("qwen3", rope(rope_type="dynamic", factor=2.0), None),
    ("mistral", rope(rope_type="dynamic", factor=4.0), None),
    ("qwen3", rope(rope_type="proportional", factor=2.0), "unsupported RoPE type 'proportional'"),
    # Served within its original context (64 here, where Phi-3's config keeps it: the test's
    # sequences are 41 long), with the short factors and the attention factor of 256 / 64.
    ("phi3", {**rope(rope_type="longrope", short_factor=[1.0 + i / 4 for i in range(8)], long_factor=[2.0] * 8),
              "original_max_position_embeddings": 64}, None),
    # Phi-3's class rotates part of each head (Phi-4-mini: 0.75, with longrope); transformers'
    # Llama-family classes rotate whole heads whatever the setting says: refused there.
    ("phi3", rope(rope_type="default", partial_rotary_factor=0.75), None),
    ("phi3", {**rope(rope_type="longrope", partial_rotary_factor=0.75, short_factor=[1.0 + i / 8 for i in range(6)],
                     long_factor=[2.0] * 6), "original_max_position_embeddings": 64}, None),
    ("mistral", rope(rope_type="default", partial_rotary_factor=0.5), r"partial rotary embeddings \(8 of 16 dims\)"),
    ("qwen3", rope(rope_type="default", partial_rotary_factor=0.5), "partial rotary"),
    ("mistral", dict(num_key_value_heads=1), None),
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[]), None),
    ("mixtral", dict(num_experts_per_tok=3), None),
    ("olmoe", dict(norm_topk_prob=True), None),
    ("granite", dict(tie_word_embeddings=True), None),
    ("olmoe", dict(clip_qkv=0.5), "clip_qkv=0.5"),
    ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[]), None),
    ("qwen2_moe", dict(qkv_bias=False), "qkv_bias=False"),
    # OLMo 3's YaRN on its full layers (the form a checkpoint's legacy `rope_scaling` becomes), and
    # a top-level setting beside the per-type ones, which transformers ignores for them.
    ("olmo3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                           "rope_theta": 5e5}}), None),
    ("olmo3", rope(rope_type="yarn", factor=8.0, original_max_position_embeddings=32), None),
    # GLM's interleaved rotation over whole heads, and with YaRN; GLM-4 without q/k/v biases.
    ("glm", rope(rope_type="default", partial_rotary_factor=1.0), None),
    ("glm4", rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, partial_rotary_factor=0.5), None),
    ("glm4", dict(attention_bias=False), "Glm4ForCausalLM with attention_bias=False"),
    ("ernie4_5", dict(use_bias=True), "Ernie4_5ForCausalLM with use_bias=True"),
    ("ernie4_5", rope(rope_type="default", partial_rotary_factor=0.5), r"partial rotary embeddings \(8 of 16 dims\)"),
    ("seed_oss", dict(attention_out_bias=True), "SeedOssForCausalLM with attention_out_bias=True"),
    ("seed_oss", dict(attention_bias=False), "SeedOssForCausalLM with attention_bias=False"),
    ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 3), None),  # 1.2B: all full, all rotate
    ("smollm3", dict(no_rope_layers=[0, 0, 0]), None),
    # GPT-OSS with heads wider than hidden / heads (gpt-oss-20b's 64 x 64 over 2,880), with every
    # layer full, with plain RoPE, and with a clamp too high to bind; Granite-MoE top-1.
    ("gpt_oss", dict(head_dim=32), None),
    ("gpt_oss", dict(layer_types=["full_attention"] * 3), None),
    ("gpt_oss", rope(rope_type="default"), None),
    ("gpt_oss", dict(swiglu_limit=100.0, num_experts_per_tok=1), None),
    ("granite_moe", dict(num_experts_per_tok=1, tie_word_embeddings=True), None),
    # DeepSeek: V2 through a query latent (DeepSeek-V2's q_lora_rank) with greedy routing (V2-Lite's)
    # and plain RoPE; V3 with interleaved RoPE pairs (its release's), every layer sparse, no shared
    # expert, one group; refusals where transformers' class and DeepSeek's code would differ.
    ("deepseek_v2", dict(q_lora_rank=24, topk_method="greedy", n_group=1, topk_group=1, **rope(rope_type="default")),
     None),
    ("deepseek_v3", dict(rope_interleave=True, first_k_dense_replace=0, n_shared_experts=0, n_group=1, topk_group=1),
     None),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias=True"),
    # GLM-4.5 with per-head q/k norms under its partial rotation; every layer sparse, one group.
    ("glm4_moe", dict(use_qk_norm=True), None),
    ("glm4_moe", dict(first_k_dense_replace=0, n_group=1, topk_group=1), None),
    ("glm4_moe", dict(attention_bias=False), "attention_bias=False"),
    # ERNIE 4.5 MoE without shared experts, every layer sparse up to an explicit last index.
    ("ernie4_5_moe", dict(moe_num_shared_experts=0, moe_layer_interval=1, moe_layer_end_index=1), None),
    ("ernie4_5_moe", dict(use_bias=True), "use_bias=True"),
    # Cohere 2 with sliding layers but no window: transformers' class fails on it, so it is refused.
    ("cohere2", dict(sliding_window=None), "sliding_window=None"),
    # Command-R+'s per-head q/k LayerNorms (their weights made random, as every norm's).
    ("cohere", dict(use_qk_norm=True), None),
    # Granite 4.0 without RoPE (position_embedding_type None), and with routed experts beside the
    # shared MLP; its Mamba layers (the -h models) refused.
    ("granite_hybrid", dict(position_embedding_type=None), None),
    ("granite_hybrid", dict(num_local_experts=4, num_experts_per_tok=2), None),
    ("granite_hybrid", dict(layer_types=["attention", "linear_attention"]), r"\['linear_attention'\] layers"),
    # AFMoE without muP scaling or shared experts, every layer sparse.
    ("afmoe", dict(mup_enabled=False, num_shared_experts=0, num_dense_layers=0), None),
    # Apertus with another activation: refused by name.
    ("apertus", dict(hidden_act="silu"), "hidden_act='silu'"),
    # Hunyuan dense with plain RoPE.
    ("hunyuan_dense", rope(rope_type="default"), None),
    # MiniMax-M2 rotating whole heads, top-1.
    ("minimax_m2", dict(rotary_dim=16, num_experts_per_tok=1, **rope(rope_type="default", partial_rotary_factor=1.0)),
     None),
    # Sliding windows (8, under the test's 41 positions) as each family's class applies them: every
    # layer (Mistral v0.1, Phi-3-mini-4k's 2,047 under 4,096, Mixtral, Qwen3-MoE), the layers
    # `layer_types` marks (Qwen3 and SmolLM3 from `max_window_layers` / by their own rule), or not
    # at all (Llama's, Granite's and OLMo 2's classes do not read the setting).
    ("mistral", dict(sliding_window=8), None),
    ("phi3", dict(sliding_window=8), None),
    ("mixtral", dict(sliding_window=8), None),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), None),
    ("smollm3", dict(use_sliding_window=True, sliding_window=8), None),
    ("granite", dict(sliding_window=8), None),
    ("olmo2", dict(sliding_window=8), None),
    ("mistral", dict(sliding_window=-5), "sliding_window=-5 is not a window"),
    # transformers' own Qwen2-MoE fails on a window: no reference to hold one to.
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     r"Qwen2-MoE with sliding-window attention \(sliding_window=8"),
]


def variant_id(family: str, settings: dict) -> str:
    """The family and its settings' names; a RoPE variant by its type (per layer type on Gemma 3)
    and any partial rotation."""
    rope_params = settings.get("rope_parameters", {})
    layers = [p for p in rope_params.values() if isinstance(p, dict)] or [rope_params]
    rope = [f"rope-{p['rope_type']}" for p in layers if p] + ["partial"] * ("partial_rotary_factor" in rope_params)
    return "-".join([family, *(name for name in settings if name != "rope_parameters"), *rope])


@pytest.mark.parametrize(("family", "settings", "refusal"), VARIANTS,
                         ids=[variant_id(f, s) for f, s, _ in VARIANTS])
def test_a_variant_matches_transformers_or_is_refused_by_name(family, settings, refusal, tmp_path: Path) -> None:
    model_dir = make_family(family, tmp_path / "model", **settings)
    if refusal is not None:
        with pytest.raises(UnsupportedModel, match=refusal):
            runner_for(model_dir, "torch")
        return
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    runner = runner_for(model_dir, "torch")
    token_ids, following = prompt(), prompt(7, NUM_DECODE_STEPS)
    pages = list(range(3, 3 + (PROMPT_LEN + NUM_DECODE_STEPS) // 4 + 1))
    logits = [runner.forward([ForwardEntry(token_ids, 0, pages, True)])[0]]
    for step, token in enumerate(following[:-1]):
        logits.append(runner.forward([ForwardEntry([token], PROMPT_LEN + step, pages, True)])[0])
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids + following])).logits[0][PROMPT_LEN - 1:-1]
    torch.testing.assert_close(torch.stack(logits), expected, atol=ATOL, rtol=0)


def test_longrope_is_served_within_its_original_context(tmp_path: Path) -> None:
    """Past its original context longrope switches every position to its long factors, which
    cached keys cannot follow: the worker reports the original context as the model's, so no
    request grows past it (the router and gateway hold every request to it)."""
    model_dir = make_family("phi3", tmp_path / "model", original_max_position_embeddings=64, **rope(
        rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    assert runner_for(model_dir, "torch").info.context_len == 64


def test_a_checkpoint_without_a_tensor_or_with_one_of_another_shape_is_named(tmp_path: Path) -> None:
    """The worker's one line ('rank 0 cannot serve ...'), naming the tensor, not a traceback."""
    from safetensors.torch import load_file, save_file

    from radixserve.model_source import ModelUnreadable

    model_dir = make_family("qwen3", tmp_path / "model")
    tensors = load_file(model_dir / "model.safetensors")
    missing = "model.layers.1.self_attn.k_norm.weight"
    save_file({name: t for name, t in tensors.items() if name != missing}, model_dir / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelUnreadable, match=f"{missing} is not in the checkpoint"):
        runner_for(model_dir, "torch")
    save_file({**tensors, missing: tensors[missing][:8]}, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelUnreadable, match=rf"{missing}: read \(8,\), expected \(16,\)"):
        runner_for(model_dir, "torch")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_partial_rotation_with_weights_quantized_at_load(quantization, tmp_path: Path) -> None:
    """Phi-4-mini's partial rotation under `--quantization`: its q/k rows are reordered at load
    before they are quantized (a row's scales stay its own, so the order commutes with them).
    It was an error at the first step ('Inference tensors do not track version counter': the
    reordered rows were made outside inference mode), as on every backend that does not repack
    them, CUDA's included."""
    model_dir = make_family("phi3", tmp_path / "model", **rope(rope_type="default", partial_rotary_factor=0.75))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantize = quantizer(quantization)
    with torch.no_grad():
        for module in reference.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize(module.weight).dequantize())
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=4, kv_cache_bytes=4 << 20,
                                      quantization=quantization, activation_quantization="none"))
    token_ids = prompt()
    logits = runner.forward([ForwardEntry(token_ids, 0, list(range(3, 3 + PROMPT_LEN // 4 + 1)), True)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_qwen2s_window_from_max_window_layers(tmp_path: Path) -> None:
    """Qwen2 with `use_sliding_window` windows the layers from `max_window_layers` on (its
    `layer_types`): the logits and greedy tokens of transformers' eager attention."""
    from worker.tiny_models import assert_matches_reference, make_tiny_qwen2

    model_dir = make_tiny_qwen2(tmp_path / "model", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=4 << 20, attention_kernel="torch"))
    assert [layer.self_attn.options and layer.self_attn.options.window for layer in runner.model.layers] == [None, 8]
    assert_matches_reference(runner, reference, list(range(3, 40)), 8)
