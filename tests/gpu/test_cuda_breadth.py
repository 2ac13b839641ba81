"""The model families, quantized weights, GGUF files and GPTQ/AWQ checkpoints on CUDA, against transformers on the CPU.

What the CPU suite checks of each on the CPU backends, here on every backend the selection takes
on CUDA (PyTorch's ops; Triton's decode kernel with and without CUDA graphs where it supports the
heads): tiny random checkpoints in float32, the prompt's logits and greedy decode steps against
transformers over the same tokens, and the greedy tokens against transformers' `generate`.
Quantized weights on CUDA run the dequantizing path (no compiled kernel there), so their
reference is transformers over the quantized-then-dequantized weights, as on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.families import FAMILIES, VOCAB_SIZE, make_family
from worker.test_prequantized import CASES as PREQUANTIZED
from worker.test_quant_model import dequantized_reference
from worker.tiny_gguf import MIXED, TYPES, tiny_model, write_tiny_gguf
from worker.tiny_models import make_tiny_llama, reference_greedy
from worker.tiny_prequantized import write_prequantized
from worker_service.backends.linear_quant import DequantizingLinear
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

DEVICE = "cuda"
# float32 on 2-3 layers: the GPU's reductions run in another order than the CPU's; a misplaced
# norm, scale, window or RoPE moves the logits by more than 1e-2.
ATOL = 1e-3
PAGE_SIZE = 4
KV_BYTES = 4 << 20
PROMPT_LEN = 37  # not a multiple of the page size
NUM_STEPS = 12
# Every backend the selection could take on CUDA, Triton with and without CUDA graphs (graphs run
# on one rank of the Triton backend only); each test skips the ones refused for its heads.
PATHS = [("torch", 0), ("triton", 0), ("triton", 16)]
IDS = ["torch", "triton", "triton-graphs"]
# Heads of 64 (Triton's kernel has none of 16), except where the family's layers assume
# heads x head size = hidden size (OLMoE's q/k norms span the hidden size) and for DeepSeek,
# whose cached latent row is 56 + 8 = 64 dims already (its head_dim is its rotated dims).
HEAD_DIM = 64
HIDDEN_SIZED_HEADS = {"olmoe", "deepseek_v2", "deepseek_v3"}


def prompt(seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner_for(model_dir, kernel: str, graphs: int, device: str = DEVICE, **settings) -> ModelRunner:
    """The runner, or a skip naming why the selection refuses `kernel` for this model on `device`."""
    try:
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, device=device, dtype="float32", page_size=PAGE_SIZE,
                                          kv_cache_bytes=KV_BYTES, attention_kernel=kernel,
                                          cuda_graph_max_batch=graphs, **settings))
    except RuntimeError as refusal:
        if f"--attention-kernel {kernel}:" not in str(refusal):
            raise
        pytest.skip(str(refusal).splitlines()[0])
    assert runner.backend.name == kernel
    if graphs and runner.graphs is None:
        # The selection leaves out graphs for a model with ops no kernel has (its reason names them).
        assert "CUDA graphs up to 0 rows" in runner.backend_reason, runner.backend_reason
        pytest.skip(f"no CUDA graphs for this model: {runner.backend_reason}")
    assert (runner.graphs is not None) == (graphs > 0)
    return runner


def greedy_steps(runner: ModelRunner, token_ids: list[int], fed: list[int] | None = None
                 ) -> tuple[list[int], torch.Tensor]:
    """The prompt's logits and NUM_STEPS decode steps' (pages out of order), each step fed our
    own argmax, or `fed`'s tokens where given; returns the argmaxes and the logits."""
    pages = list(range(3, 3 + (len(token_ids) + NUM_STEPS) // PAGE_SIZE + 1))[::-1]
    logits = [runner.forward([ForwardEntry(token_ids, 0, pages, True)])[0].float().cpu()]
    tokens = [int(logits[0].argmax())]
    for step in range(NUM_STEPS):
        feed = tokens[-1] if fed is None else fed[step]
        row = runner.forward([ForwardEntry([feed], len(token_ids) + step, pages, True)])[0]
        logits.append(row.float().cpu())
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def check_against(runner: ModelRunner, reference: torch.nn.Module, token_ids: list[int]
                  ) -> tuple[list[int], torch.Tensor]:
    """The prompt's logits and NUM_STEPS greedy decode steps against `reference` over the same
    tokens, and the greedy tokens against its `generate`; returns the tokens and logits."""
    tokens, logits = greedy_steps(runner, token_ids)
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids + tokens[:-1]])).logits[0, len(token_ids) - 1:]
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(logits, expected, atol=ATOL * scale, rtol=0)
    assert tokens == reference_greedy(reference, token_ids, NUM_STEPS + 1)
    return tokens, logits


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory) -> dict:
    made = {}

    def get(name: str):
        if name not in made:
            heads = {} if name in HIDDEN_SIZED_HEADS else {"head_dim": HEAD_DIM}
            out_dir = make_family(name, tmp_path_factory.mktemp(name), **heads)
            # Eager: transformers' reference attention (soft-capping and windows included).
            made[name] = out_dir, AutoModelForCausalLM.from_pretrained(
                out_dir, dtype=torch.float32, attn_implementation="eager").eval()
        return made[name]
    return get


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_matches_transformers_on_cuda(family, kernel, graphs, family_checkpoints) -> None:
    """Against transformers, and against our own PyTorch path on the CPU fed the same tokens
    (which the CPU suite holds to transformers: a second reference that no version of
    transformers on the GPU machine can move)."""
    model_dir, reference = family_checkpoints(family)
    tokens, on_cuda = check_against(runner_for(model_dir, kernel, graphs), reference, prompt())
    _, on_cpu = greedy_steps(runner_for(model_dir, "torch", 0, device="cpu"), prompt(), fed=tokens)
    torch.testing.assert_close(on_cuda, on_cpu, atol=ATOL * max(1.0, float(on_cpu.abs().max())), rtol=0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_dequantize_on_cuda(tiny_llama, quantization, kernel, graphs) -> None:
    runner = runner_for(tiny_llama, kernel, graphs, quantization=quantization)
    packed = runner.model.layers[0].mlp.down_proj.packed
    assert type(packed) is DequantizingLinear
    assert packed.quantized.values.device.type == DEVICE  # kept quantized on the GPU
    check_against(runner, dequantized_reference(tiny_llama, quantization), prompt(2)[:21])


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gguf")
    return {qtype: write_tiny_gguf(folder / f"tiny-{qtype}.gguf", qtype) for qtype in TYPES}


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_files_as_they_are_on_cuda(gguf_files, qtype, kernel, graphs) -> None:
    path = gguf_files[qtype]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    runner = runner_for(path, kernel, graphs)
    assert runner.info.quantization.startswith("gguf:")
    check_against(runner, reference, list(range(3, 40)))


@pytest.fixture(scope="module")
def prequantized(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("prequantized")
    return {case: write_prequantized(root / case, *PREQUANTIZED[case]) for case in PREQUANTIZED}


@pytest.mark.parametrize("case", sorted(PREQUANTIZED))
def test_gptq_and_awq_checkpoints_on_cuda(prequantized, case) -> None:
    """Their int4 weights kept, on the dequantizing path (heads of 16: PyTorch's attention),
    against transformers on the same weights dequantized into a plain checkpoint."""
    quantized, plain = prequantized[case]
    reference = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    runner = runner_for(quantized, "torch", 0)
    assert runner.info.quantization == f"{PREQUANTIZED[case][0]}:int4-g{PREQUANTIZED[case][1]}"
    check_against(runner, reference, list(range(3, 40)))


def rope(**params) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, **params}}


# Settings the CPU suite holds to transformers (test_config_variants.py), here with heads of 64
# so Triton's row kernel applies their tables too: YaRN (with DeepSeek's mscale), Gemma 3's
# per-layer YaRN, Phi-3's longrope within its original context and its partial rotation
# (Phi-4-mini's 0.75, rotary dims first after the load's reordering of q/k rows); and sliding
# windows, one the prompt outgrows (the windowed path) and one no step outgrows (the backend's
# own attention).
PHI3_WIDE = dict(hidden_size=256)  # Phi-3's heads are hidden / heads wide, whatever head_dim says
CONFIG_VARIANTS = {
    "mistral-window-outgrown": ("mistral", dict(sliding_window=8)),
    "phi3-window-not-outgrown": ("phi3", dict(sliding_window=PROMPT_LEN + NUM_STEPS + 4, **PHI3_WIDE)),
    "qwen3-yarn": ("qwen3", rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "mistral-yarn-mscale": ("mistral", rope(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                                            beta_fast=16, beta_slow=2, mscale=0.9, mscale_all_dim=0.5,
                                            truncate=False)),
    "gemma3-yarn-full-layers": ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "attention_factor": 1.3}})),
    "phi3-longrope": ("phi3", {**rope(rope_type="longrope", short_factor=[1.0 + i / 16 for i in range(32)],
                                      long_factor=[2.0] * 32), "original_max_position_embeddings": 64,
                                **PHI3_WIDE}),
    "phi3-partial-longrope": ("phi3", {**rope(rope_type="longrope", partial_rotary_factor=0.75,
                                              short_factor=[1.0 + i / 16 for i in range(24)], long_factor=[2.0] * 24),
                                       "original_max_position_embeddings": 64, **PHI3_WIDE}),
}


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_config_variants_match_transformers_on_cuda(variant, kernel, graphs, tmp_path) -> None:
    family, settings = CONFIG_VARIANTS[variant]
    model_dir = make_family(family, tmp_path / variant, head_dim=HEAD_DIM, **settings)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    check_against(runner_for(model_dir, kernel, graphs), reference, prompt(3))


# GGUF architectures beyond llama, and what a file says that transformers' reading leaves out (its
# RoPE scaling, Gemma's norms, soft-caps and query scale, MoE widths, Mixtral's experts): a float32
# file against the checkpoint it was written from.
GGUF_CASES = {
    **{arch: (arch, None) for arch in ("qwen3", "qwen3moe", "qwen2moe", "phi3", "gemma2", "gemma3", "mixtral")},
    "llama3-rope_freqs": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "phi3-partial": ("phi3", {"rope_type": "default", "partial_rotary_factor": 0.75}),
}


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_architectures_give_the_checkpoints_logits_on_cuda(case, kernel, graphs, tmp_path) -> None:
    arch, rope_params = GGUF_CASES[case]
    path = write_tiny_gguf(tmp_path / f"{case}.gguf", "F32", arch=arch, rope=rope_params)
    checkpoint = tiny_model(arch, rope=rope_params)
    checkpoint.config._attn_implementation = "eager"  # Gemma 2's soft-cap is applied by eager alone
    check_against(runner_for(path, kernel, graphs), checkpoint, list(range(3, 40)))


def test_quantized_moe_and_partial_rotation_files_on_cuda(tmp_path) -> None:
    """A Q4_K_M qwen3moe file's experts and a Q4_K_M phi3 file's reordered q/k rows, kept quantized
    on the GPU, against transformers reading each file with what its reading leaves out put back."""
    from transformers import AutoConfig

    from worker.tiny_gguf import EXPERT_WIDTH
    for arch, rope_params in [("qwen3moe", None), ("phi3", {"rope_type": "default", "partial_rotary_factor": 0.75})]:
        folder = tmp_path / arch
        folder.mkdir()
        path = write_tiny_gguf(folder / f"{arch}.gguf", MIXED, arch=arch, rope=rope_params)
        config = AutoConfig.from_pretrained(str(folder), gguf_file=path.name)
        config.pad_token_id = 0
        if arch == "qwen3moe":
            config.moe_intermediate_size = EXPERT_WIDTH
        else:
            config.rope_parameters = {**config.rope_parameters, **rope_params}
        reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, config=config,
                                                         dtype=torch.float32).eval()
        runner = runner_for(path, "torch", 0, activation_quantization="none")
        assert runner.info.quantization == "gguf:Q4_K+Q6_K"
        check_against(runner, reference, list(range(3, 40)))


@pytest.mark.parametrize(("kernel", "graphs"), PATHS, ids=IDS)
def test_an_mxfp4_gpt_oss_checkpoint_on_cuda(kernel, graphs, tmp_path) -> None:
    """GPT-OSS as released (experts in MXFP4, kept as int8 on the dequantizing path; sinks and the
    sliding layers by PyTorch's ops), against transformers reading the same file."""
    from transformers import Mxfp4Config

    from worker.mxfp4_checkpoint import make_mxfp4_gpt_oss

    model_dir = make_mxfp4_gpt_oss(tmp_path / "gpt-oss", head_dim=HEAD_DIM)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     quantization_config=Mxfp4Config(dequantize=True)).eval()
    runner = runner_for(model_dir, kernel, graphs)
    assert runner.info.quantization == "mxfp4:int8-g32"
    check_against(runner, reference, prompt())
