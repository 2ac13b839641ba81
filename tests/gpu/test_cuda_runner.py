"""The model runner on CUDA against transformers on the same GPU and weights.

Float32: the same greedy tokens and logits within float32 rounding. Bfloat16: logits of the same
tokens (both fed transformers' greedy continuation) within bfloat16's error, and the same argmax
wherever transformers' best token leads by more than that error. Each on both decode attention
paths (the Triton kernel, the pure PyTorch one) and with CUDA graphs on and off.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.backend_params import backend_params
from worker.tiny_models import make_tiny_llama, make_tiny_qwen2
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

DEVICE = "cuda"
NUM_NEW_TOKENS = 24
PROMPT_LEN = 60
KV_BYTES = 256 << 20
FP32_ATOL = 2e-3  # float32 rounding over 30 layers, other kernels than transformers': ~1e-4 measured
# Bfloat16 over 30 layers of random weights (std 0.05): the CPU paths measured 3.4-4.4% of the
# logits' norm and 0.23-0.31 at most against transformers; a wrong layer moves them by ~100%.
BF16_RELATIVE = 0.08
BF16_CLEAR_LEAD = 0.6  # a best token ahead of the second by more than this must be ours too
# (backend, graphs' largest batch) for every backend the selection takes on CUDA for SmolLM2's
# heads (the compiled CPU kernels are refused there): graphs run only on the Triton backend.
PATHS = [pytest.param(param.values[0], graphs, marks=param.marks, id=f"{param.values[0]}-graphs{graphs}")
         for param in backend_params(DEVICE, torch.float32, 64)
         for graphs in ((0, 128) if param.values[0] == "triton" else (0,))]


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return torch.randint(3, 49152, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


def reference(model_dir, dtype: torch.dtype, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation on the GPU and the logits it chose each token from."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=DEVICE), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long,
                                                                              device=DEVICE),
            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=2,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.cat(out.logits).float().cpu()


def runner_for(model_dir, dtype: str, kernel: str, graphs: int) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, device=DEVICE, dtype=dtype, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=kernel, cuda_graph_max_batch=graphs))
    assert runner.backend.name == kernel
    assert (runner.graphs is not None) == (graphs > 0)
    return runner


def shuffled_table(runner: ModelRunner, num_tokens: int, seed: int = 0) -> list[int]:
    """Pages handed out in a scrambled order, as a router with a used-up free list would."""
    order = torch.randperm(runner.info.num_pages, generator=torch.Generator().manual_seed(seed))
    return order[: num_tokens // runner.info.page_size + 1].tolist()


def fed_logits(runner: ModelRunner, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """Our argmax and logits at each step, fed `tokens` (not our own choices) after the prompt."""
    table = shuffled_table(runner, len(prompt_ids) + len(tokens))
    rows = [runner.forward([ForwardEntry(list(prompt_ids), 0, table, True)])[0]]
    for i, token in enumerate(tokens[:-1]):
        rows.append(runner.forward([ForwardEntry([token], len(prompt_ids) + i, table, True)])[0])
    logits = torch.stack(rows).cpu()
    return logits.argmax(-1).tolist(), logits


def greedy(runner: ModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    table = shuffled_table(runner, len(prompt_ids) + num_tokens)
    tokens = [int(runner.forward([ForwardEntry(list(prompt_ids), 0, table, True)])[0].argmax())]
    while len(tokens) < num_tokens:
        logits = runner.forward([ForwardEntry([tokens[-1]], len(prompt_ids) + len(tokens) - 1, table, True)])
        tokens.append(int(logits[0].argmax()))
    return tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kernel", "graphs"), PATHS)
def test_float32_greedy_tokens_and_logits_match_transformers(smollm2_dir, prompt_ids, kernel, graphs) -> None:
    tokens, logits = reference(smollm2_dir, torch.float32, prompt_ids)
    runner = runner_for(smollm2_dir, "float32", kernel, graphs)
    assert greedy(runner, prompt_ids, NUM_NEW_TOKENS) == tokens
    _, ours = fed_logits(runner, prompt_ids, tokens)
    torch.testing.assert_close(ours, logits, atol=FP32_ATOL, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kernel", "graphs"), PATHS)
def test_bfloat16_logits_match_transformers(smollm2_dir, prompt_ids, kernel, graphs) -> None:
    tokens, logits = reference(smollm2_dir, torch.bfloat16, prompt_ids)
    runner = runner_for(smollm2_dir, "bfloat16", kernel, graphs)
    assert runner.info.dtype == "bfloat16"
    chosen, ours = fed_logits(runner, prompt_ids, tokens)
    relative = ((ours - logits).norm() / logits.norm()).item()
    assert relative < BF16_RELATIVE
    top = logits.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > BF16_CLEAR_LEAD
    assert clear.any()
    assert [c for c, is_clear in zip(chosen, clear.tolist()) if is_clear] == \
        [t for t, is_clear in zip(tokens, clear.tolist()) if is_clear]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen2], ids=["llama", "qwen2"])
def test_tiny_models_on_the_torch_path_match_transformers(make, tmp_path) -> None:
    """Head size 16 has no Triton kernel: `auto` takes the PyTorch path on CUDA (GQA, biases,
    scaled RoPE, tied and untied heads)."""
    model_dir = make(tmp_path / "model")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, device=DEVICE, dtype="float32", page_size=4,
                                      kv_cache_bytes=8 << 20, cuda_graph_max_batch=128))
    assert runner.backend.name == "torch" and runner.graphs is None
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=20, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=DEVICE))
    assert greedy(runner, prompt, 20) == out[0, len(prompt):].tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_steps_on_the_triton_kernel_equal_the_torch_path(smollm2_dir, dtype) -> None:
    """One step holding decode rows of several lengths, a prefill from position 0 and a prefill
    after a cached prefix, on both attention paths (and graphs replaying the decode-only steps)."""
    results = []
    for kernel, graphs in (("triton", 128), ("torch", 0)):
        runner = runner_for(smollm2_dir, dtype, kernel, graphs)
        generator = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 16, 17, 40, 33, 70)]
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
        steps = [
            [ForwardEntry(p, 0, t, True) for p, t in zip(prompts[:4], tables)],  # four prompts
            [ForwardEntry(prompts[4][:16], 0, tables[4], False)],  # a cached prefix for row 4
            # decode rows, row 4's rest after its prefix, row 5's whole prompt, in one step
            [ForwardEntry([7 + i], len(p), t, True) for i, (p, t) in enumerate(zip(prompts[:4], tables))]
            + [ForwardEntry(prompts[4][16:], 16, tables[4], True), ForwardEntry(prompts[5], 0, tables[5], True)],
            # decode only: every row (a graph replays it where graphs are on)
            [ForwardEntry([9 + i], len(p) + (i < 4), t, True) for i, (p, t) in enumerate(zip(prompts, tables))],
        ]
        results.append([runner.forward(step).cpu() for step in steps])
        del runner
    for ours, torch_path in zip(*results):
        assert ours.shape == torch_path.shape
        if not ours.numel():  # the step that only caches a prefix samples nothing
            continue
        if dtype == "float32":
            torch.testing.assert_close(ours, torch_path, atol=FP32_ATOL, rtol=0)
        else:
            assert ((ours - torch_path).norm() / torch_path.norm()).item() < BF16_RELATIVE
