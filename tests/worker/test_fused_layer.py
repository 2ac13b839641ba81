"""Whole decoder layers as one compiled call (`backends/fused_llama.py`) give the same bits as the
layers' own code with the compiled kernels: same kernels, same order, same buffers.

Through the tiny Llama and Qwen2 (q/k/v biases) models in bfloat16, float32 and float16, a prompt
of 3 tokens and then decode steps of 1 to 11 sequences behind a shared prefix, with and without
the fused path: logits equal. Steps of more than `GEMV_MAX_ROWS` tokens and TP ranks of a group
take the module path.
"""

from __future__ import annotations

import pytest
import torch

from worker.tiny_models import VOCAB_SIZE, make_tiny_llama, make_tiny_qwen2
from worker_service import native
from worker_service.forward_batch import ForwardEntry
from worker_service.backends.fused_llama import FusedLlamaLayers
from worker_service.backends.linear_native import GEMV_MAX_ROWS
from worker_service.model_runner import ModelRunner, RunnerConfig

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the fused layer needs the compiled kernels")
DTYPES = [pytest.param(name, marks=pytest.mark.skipif(KERNEL is None or getattr(torch, name) not in KERNEL.gemv_dtypes,
                                                     reason=f"no small-batch linear kernel for {name} here"))
          for name in ("bfloat16", "float32", "float16")]


def runner(model_dir, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, dtype=dtype, page_size=4, kv_cache_bytes=1 << 20))


def decode(run: ModelRunner, use_fused: bool, num_seqs: int, steps: int) -> list[torch.Tensor]:
    """Logits of: an 8-token prefix, each sequence's 3-token prompt behind it (one step: 3 to 12
    tokens, so fused only for one sequence), then `steps` decode steps of all sequences."""
    fused = run.fused
    if not use_fused:
        run.fused = None
    generator = torch.Generator().manual_seed(num_seqs)
    prefix = torch.randint(3, VOCAB_SIZE, (8,), generator=generator).tolist()
    shared = [30, 31]
    run.forward([ForwardEntry(prefix, 0, shared, False)])
    entries = [ForwardEntry(torch.randint(3, VOCAB_SIZE, (3,), generator=generator).tolist(), 8,
                            shared + [40 + 10 * i + j for j in range(6)], True) for i in range(num_seqs)]
    logits = []
    for _ in range(steps + 1):
        out = run.forward(entries)
        logits.append(out)
        entries = [ForwardEntry([token], e.start_position + len(e.token_ids), e.page_table, True)
                   for e, token in zip(entries, out.argmax(-1).tolist())]
    run.fused = fused
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("num_seqs", [1, 2, 4, 11])
def test_fused_layers_give_the_module_paths_bits(tmp_path, dtype, make, num_seqs) -> None:
    model_dir = make(tmp_path)
    with_fused = runner(model_dir, dtype)
    assert with_fused.fused is not None
    fused_logits = decode(with_fused, True, num_seqs, 5)
    plain_logits = decode(runner(model_dir, dtype), False, num_seqs, 5)
    for fused, plain in zip(fused_logits, plain_logits):
        assert torch.equal(fused, plain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_run_only_where_every_kernel_does(tmp_path, dtype) -> None:
    model_dir = make_tiny_llama(tmp_path)
    bf16 = runner(model_dir, dtype)
    fused = bf16.fused
    calls = []
    original = FusedLlamaLayers.run
    try:
        FusedLlamaLayers.run = lambda self, hidden, step: calls.append(hidden.shape[0]) or original(self, hidden, step)
        tokens = torch.randint(3, VOCAB_SIZE, (GEMV_MAX_ROWS + 1,)).tolist()
        pages = list(range(1, (GEMV_MAX_ROWS + 2) // 4 + 2))
        bf16.forward([ForwardEntry(tokens, 0, pages, True)])  # more tokens than it takes: the module path
        bf16.forward([ForwardEntry([tokens[0]], len(tokens), pages, True)])  # one decode row: fused
    finally:
        FusedLlamaLayers.run = original
    assert calls == [1] and fused is bf16.fused
