"""GGUF files served as they are: each kept block type maps exactly onto our layouts, and a tiny
random Llama written by the `gguf` package in each type gives transformers' logits and greedy
tokens (transformers dequantizing the same file), its linear weights kept quantized; so do
Qwen2 and Qwen3 files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from radixserve.model_source import ModelNotFound, resolve_model
from worker.tiny_gguf import (CONTEXT, HEAD_DIM, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, MIXED,
                              RANDOM_BLOCK_HALVES, TIED_EMBEDDING_TYPES, TYPES, random_blocks,
                              tiny_model, write_tiny_gguf)
from worker.tiny_models import assert_matches_reference
from worker_service.backends.linear_quant import GEMV_MAX_ROWS, DequantizingLinear
from worker_service.quant.gguf_types import KEPT_TYPES, to_quantized

PROMPT_IDS = list(range(3, 40))
NUM_NEW_TOKENS = 8


def _random_rows(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_BLOCK_HALVES:
        return random_blocks((rows, cols), qtype, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_each_kept_type_stands_for_exactly_the_weights_gguf_dequantizes(qtype) -> None:
    rows, cols = 7, 768  # odd rows, three K-quant super-blocks
    raw = _random_rows(qtype, rows, cols)
    weight = to_quantized(raw, qtype, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(weight.dequantize(), expected)
    # A row-parallel shard on a group boundary is the same columns of the same weights.
    start = 256
    assert torch.equal(weight.cols(range(start, cols)).dequantize(), expected[:, start:])
    assert torch.equal(weight.rows(range(2, 5)).dequantize(), expected[2:5])


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {qtype: write_tiny_gguf(folder / f"tiny-{qtype}.gguf", qtype) for qtype in TYPES}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("qtype", TYPES)
def test_tiny_gguf_matches_transformers_reading_the_same_file(gguf_files, qtype) -> None:
    from transformers import AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    path = gguf_files[qtype]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    # Float32 activations: the exact products (the default rounds a GGUF file's to 8 bits: below).
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20, activation_quantization="none"))
    kept = {"Q4_K", "Q6_K"} if qtype == MIXED else {qtype}
    if qtype in TIED_EMBEDDING_TYPES:
        kept.add(TIED_EMBEDDING_TYPES[qtype].name)
    assert runner.info.quantization == "gguf:" + "+".join(sorted(kept))
    assert runner.info.model_name == path.stem
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)
    _assert_head_kept_quantized(runner)
    # The decoder's linear weights stayed quantized: well under their float32 bytes.
    linear_params = LAYERS * ((2 * HIDDEN + 2 * KV_HEADS * HEAD_DIM) * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    dense_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert runner.weight_bytes() < dense_bytes - linear_params * 4 * 0.6


def _assert_head_kept_quantized(runner) -> None:
    """The LM head multiplies with the file's quantized values. Tied, it keeps the embeddings'
    plain weight beside them, and its product is the one over the weights that copy holds
    (transformers' dequantized ones); untied, it holds only the quantized values."""
    head = runner.model.lm_head
    assert isinstance(head.packed, DequantizingLinear)  # the compiled kernel's class too
    if not head.tied:
        assert head.copy_bytes == 0 and head.weight.data_ptr() == head.packed.weight.data_ptr()
        return
    assert head.copy_bytes == head.packed.quantized.values.nbytes < head.weight.nbytes / 2
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5, GEMV_MAX_ROWS + 1, 300):
        x = torch.randn(rows, HIDDEN, generator=generator)
        expected = torch.nn.functional.linear(x.double(), head.weight.double()).float()
        torch.testing.assert_close(head.packed(x), expected, rtol=1e-5, atol=1e-4)


def test_model_source_finds_the_gguf_file(gguf_files, tmp_path) -> None:
    path = gguf_files["Q8_0"]
    assert resolve_model(path).gguf_path == path
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.gguf").symlink_to(path)
    assert resolve_model(single).gguf_file == "model.gguf"
    (single / "other.gguf").symlink_to(path)
    with pytest.raises(ModelNotFound, match="several GGUF files"):
        resolve_model(single)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")



@pytest.mark.timeout(120)
@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", MIXED), ("qwen3", MIXED), ("qwen3", "Q4_1"), ("phi3", MIXED)])
def test_qwen_and_phi3_files_match_transformers_reading_them(arch, qtype, tmp_path) -> None:
    """`qwen2` (q/k/v biases), `qwen3` (per-head q/k norms) and `phi3` (merged q/k/v and gate/up)
    files, their q/k rows as they are, with a tied head, as llama.cpp writes them: transformers'
    logits and greedy tokens, the linear weights kept as the file's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    path = write_tiny_gguf(tmp_path / f"{arch}-{qtype}.gguf", qtype, arch=arch)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.pad_token_id = 0  # Phi-3's default, 32,000, is outside the tiny vocabulary
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20, activation_quantization="none"))
    assert type(runner.model).__name__ == type(reference).__name__
    assert runner.info.quantization == ("gguf:Q4_K+Q6_K" if qtype == MIXED else "gguf:Q4_1+Q8_0")
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("arch", "rope"), [
    ("llama", LLAMA3_ROPE),
    ("llama", {"rope_type": "linear", "factor": 3.0}),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("phi3", {"rope_type": "longrope", "short_factor": [1.0 + i / 32 for i in range(32)], "long_factor": [2.0] * 32,
              "original_max_position_embeddings": 128}),
    ("phi3", {"rope_type": "default", "partial_rotary_factor": 0.75}),
], ids=["llama3-rope_freqs", "linear", "yarn", "phi3-longrope", "phi3-partial"])
def test_a_files_rope_scaling_gives_the_checkpoints_logits(arch, rope, tmp_path) -> None:
    """RoPE scaling as llama.cpp's converter writes it (Llama 3's as a `rope_freqs` tensor, linear
    and YaRN as metadata, Phi-3's longrope as two tensors of factors, Phi-4-mini's partial rotation
    as `rope.dimension_count`), all of which transformers' reading of the file leaves out:
    served, the float32 file gives the logits and greedy tokens of the checkpoint it was written
    from (longrope within its original context, which the worker reports as the model's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    path = write_tiny_gguf(tmp_path / "scaled.gguf", "F32", arch=arch, rope=rope)
    checkpoint = tiny_model(arch, rope=rope)
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20))
    assert runner.info.quantization == "gguf:none"
    assert runner.info.context_len == (rope["original_max_position_embeddings"] if rope["rope_type"] == "longrope"
                                       else CONTEXT)
    assert_matches_reference(runner, checkpoint, PROMPT_IDS, NUM_NEW_TOKENS)
    # What transformers reads of the file (plain RoPE) is another model: the scaling matters here.
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.pad_token_id = 0  # Phi-3's default is outside the tiny vocabulary
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT_IDS])
        assert (plain(ids).logits - checkpoint(ids).logits).abs().max() > 1e-2


@pytest.mark.timeout(120)
def test_a_qwen3_file_whose_heads_are_not_128_wide(tmp_path) -> None:
    """Heads of `attention.key_length` where transformers' reading of a `qwen3` file takes its
    default, 128: the checkpoint's logits and greedy tokens."""
    from worker_service.model_runner import ModelRunner, RunnerConfig

    path = write_tiny_gguf(tmp_path / "qwen3-64.gguf", "F32", arch="qwen3", head_dim=64)
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20))
    assert runner.hf_config.head_dim == 64
    assert_matches_reference(runner, tiny_model("qwen3", head_dim=64), PROMPT_IDS, NUM_NEW_TOKENS)


@pytest.mark.parametrize(("arch", "settings", "refusal"), [
    ("llama", dict(rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "gguf_attn_factor": 0.7}), "YaRN attn_factor 0.7"),
], ids=["yarn-attn-factor"])
def test_what_a_file_says_and_the_worker_cannot_follow_is_refused(arch, settings, refusal, tmp_path) -> None:
    """A YaRN attn_factor (llama.cpp's own temperature) is refused by name: never served as
    plain RoPE."""
    from worker_service.model_runner import ModelRunner, RunnerConfig
    from worker_service.unsupported import UnsupportedModel

    path = write_tiny_gguf(tmp_path / "refused.gguf", "Q8_0", arch=arch, **settings)
    with pytest.raises(UnsupportedModel, match=refusal):
        ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20))


@pytest.mark.timeout(120)
def test_a_phi3_files_sliding_window_is_followed(tmp_path) -> None:
    """Phi-3-mini-4k's window (2,047 under 4,096) is in the file's metadata, which transformers'
    reading leaves out: every layer attends through it, so a float32 file with a window of 8
    gives the logits and greedy tokens of the checkpoint with that window."""
    from worker_service.model_runner import ModelRunner, RunnerConfig

    path = write_tiny_gguf(tmp_path / "phi3-window.gguf", "F32", arch="phi3", sliding_window=8)
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20))
    assert [layer.self_attn.options.window for layer in runner.model.layers] == [8] * LAYERS
    checkpoint = tiny_model("phi3")
    checkpoint.config.sliding_window = 8  # read as each step's mask is made
    checkpoint.config._attn_implementation = "eager"
    assert_matches_reference(runner, checkpoint, PROMPT_IDS, NUM_NEW_TOKENS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_moe_files_give_the_checkpoints_logits_with_their_experts_kept(arch, tmp_path) -> None:
    """Qwen3-MoE and Qwen2-MoE files as llama.cpp writes them (a layer's experts in one 3-D tensor
    per projection, routers in float32, Qwen2-MoE's shared expert and its one-row gate as a
    vector). transformers' reading of such a file leaves out the experts' widths (gguf_config.py):
    a float32 file gives the logits and greedy tokens of the checkpoint it was written from
    (Qwen3-MoE's renormalised top-k included, as llama.cpp applies it), and a Q4_K_M file those of
    transformers reading it with the widths put back, its experts kept quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker.tiny_gguf import EXPERT_WIDTH
    from worker_service.model_runner import ModelRunner, RunnerConfig

    plain = write_tiny_gguf(tmp_path / f"{arch}-F32.gguf", "F32", arch=arch)
    runner = ModelRunner(RunnerConfig(model_dir=plain, kv_cache_bytes=16 << 20))
    assert_matches_reference(runner, tiny_model(arch), PROMPT_IDS, NUM_NEW_TOKENS)

    path = write_tiny_gguf(tmp_path / f"{arch}-{MIXED}.gguf", MIXED, arch=arch)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.moe_intermediate_size = EXPERT_WIDTH
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = EXPERT_WIDTH
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20, activation_quantization="none"))
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)
    experts = runner.model.layers[0].mlp  # each expert multiplies with the file's quantized values
    assert all(isinstance(linear.packed, DequantizingLinear) for linear in [*experts.gate_up, *experts.down])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_files_give_the_checkpoints_logits(arch, tmp_path) -> None:
    """Gemma files as llama.cpp writes them: norms as 1 + w, a sliding window shorter than the
    prompt, Gemma 2's soft-caps in the metadata, Gemma 3's full-layer RoPE base as the file's base
    and its sliding layers' as the SWA base, and no key for the query scale (llama.cpp's rule: the
    head size). transformers' reading leaves all but the window at its defaults (gguf_config.py):
    a float32 file gives the checkpoint's logits and greedy tokens, and a Q4_K_M file those of
    transformers reading it with the checkpoint's settings put back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    checkpoint = tiny_model(arch)
    checkpoint.config._attn_implementation = "eager"  # the attention that applies Gemma 2's soft-cap
    plain = write_tiny_gguf(tmp_path / f"{arch}-F32.gguf", "F32", arch=arch)
    runner = ModelRunner(RunnerConfig(model_dir=plain, kv_cache_bytes=16 << 20))
    assert_matches_reference(runner, checkpoint, PROMPT_IDS, NUM_NEW_TOKENS)

    path = write_tiny_gguf(tmp_path / f"{arch}-{MIXED}.gguf", MIXED, arch=arch)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    for setting in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters"):
        setattr(config, setting, getattr(checkpoint.config, setting))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20, activation_quantization="none"))
    assert runner.info.quantization == "gguf:Q4_K+Q6_K"
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)


def test_a_tokenizer_larger_than_the_model_is_named(smollm2_dir, tmp_path) -> None:
    """transformers' Gemma tokenizer adds a `<mask>` token a file's vocabulary may lack (this
    one, which carries a 512-token BPE under a 512-row model): the worker's one line says so,
    where the grammar library's 'vocab size too small' came with a traceback."""
    from radixserve.model_source import ModelUnreadable
    from worker_service.grammar import ConstraintMasks

    path = write_tiny_gguf(tmp_path / "gemma3-tokenizer.gguf", "Q8_0", tokenizer_dir=smollm2_dir, arch="gemma3")
    with pytest.raises(ModelUnreadable, match="the tokenizer has 513 tokens, more than the model's vocabulary of 512"):
        ConstraintMasks.load(path, 512, [2], 16, 1)


@pytest.mark.timeout(120)
def test_a_mixtral_file_is_served_as_mixtral(tmp_path) -> None:
    """llama.cpp writes Mixtral as a `llama` file with experts, which transformers reads as a
    Llama without them: served as Mixtral (gguf_config.py), a float32 file gives the checkpoint's
    logits and greedy tokens, and a Q4_K_M file's experts are multiplied quantized."""
    from worker_service.model_runner import ModelRunner, RunnerConfig

    plain = write_tiny_gguf(tmp_path / "mixtral-F32.gguf", "F32", arch="mixtral")
    runner = ModelRunner(RunnerConfig(model_dir=plain, kv_cache_bytes=16 << 20))
    assert type(runner.model).__name__ == "MixtralForCausalLM"
    assert_matches_reference(runner, tiny_model("mixtral"), PROMPT_IDS, NUM_NEW_TOKENS)
    path = write_tiny_gguf(tmp_path / f"mixtral-{MIXED}.gguf", MIXED, arch="mixtral")
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20))
    experts = runner.model.layers[0].mlp
    assert runner.info.quantization.startswith("gguf:Q4_K+Q6_K")
    assert all(isinstance(linear.packed, DequantizingLinear) for linear in [*experts.gate_up, *experts.down])


@pytest.mark.timeout(120)
def test_a_phi3_file_with_a_partial_rotation_keeps_its_quantized_rows(tmp_path) -> None:
    """Phi-4-mini's partial rotation (`rope.dimension_count` 3/4 of its heads) over a Q4_K_M
    file: the quantized q/k rows are put in the rotation's order as they are (each row whole),
    giving transformers' logits and greedy tokens for the file read with that rotation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    rope = {"rope_type": "default", "partial_rotary_factor": 0.75}
    path = write_tiny_gguf(tmp_path / "phi3-partial.gguf", MIXED, arch="phi3", rope=rope)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.pad_token_id = 0
    config.rope_parameters = {**config.rope_parameters, **rope}
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=path, kv_cache_bytes=16 << 20, activation_quantization="none"))
    assert runner.info.quantization == "gguf:Q4_K+Q6_K"
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.packed, DequantizingLinear)
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)
