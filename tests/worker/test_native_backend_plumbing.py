"""The compiled-kernels backend's Python side, on machines where the kernels do not build too.

`NativeBackend` is given a stand-in for the library with the same calls in plain PyTorch (attention
computed row by row from the page tables it is handed, RoPE with the K/V write, the row-wise ops,
the small-batch linear layer): a tiny model on it must give transformers' logits, so every
argument the backend passes (plan rows and prefill spans, RoPE tables, slots, packed weights) is
the right one. The real kernels against the PyTorch backend are in `test_native_attention.py`,
`test_native_layer_ops.py` and `test_fused_layer.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from worker.tiny_models import VOCAB_SIZE, make_tiny_llama, make_tiny_qwen2
from worker_service import model_runner
from worker_service.backends.native_backend import NativeBackend
from worker_service.backends.selection import Selection
from worker_service.backends.torch_backend import TorchBackend
from worker_service.forward_batch import ForwardEntry
from worker_service.layers.rotary import apply_rotary
from worker_service.model_runner import ModelRunner, RunnerConfig

PAGE_SIZE = 4
ATOL = 1e-4  # float32 against transformers, as test_model_tiny


class StandInPlan:
    """`NativeKernels.plan`'s result: every row attends over its own pages (K/V already stored)."""

    def __init__(self, tables, context_lens, page_size, groups, spans) -> None:
        assert all(len(rows) > 1 and pages > 0 for rows, pages in groups)
        self.rows = [(row, table, length) for row, (table, length) in enumerate(zip(tables, context_lens))]
        for first_row, num_rows, start, pages in spans:
            self.rows += [(first_row + j, pages, start + j + 1) for j in range(num_rows)]
        self.page_size = page_size

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert q.shape[0] == len(self.rows) and sinks is None  # the families here have no sinks
        num_kv_heads, head_dim = k_slots.shape[0], q.shape[2]
        out = torch.empty_like(q)
        for row, pages, length in self.rows:
            slots = (torch.tensor(pages).unsqueeze(1) * self.page_size + torch.arange(self.page_size)).flatten()
            keys, values = k_slots[:, slots[:length]], v_slots[:, slots[:length]]
            queries = q[row].reshape(num_kv_heads, -1, head_dim)
            weights = (queries @ keys.transpose(1, 2) * head_dim ** -0.5).softmax(-1)
            out[row] = (weights @ values).reshape(-1, head_dim)
        return out


class StandInKernels:
    """The calls `NativeBackend` makes of `NativeKernels`, in PyTorch; no fused layers (empty
    `gemv_dtypes`: the fused path needs the real library)."""

    gemv_dtypes = frozenset()

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.reference = TorchBackend(torch.device("cpu"), torch.float32)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def plan(self, *args) -> StandInPlan:
        self._count("plan")
        return StandInPlan(*args)

    def rms_norm(self, x, weight, eps):
        self._count("rms_norm")
        return self.reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, x, weight, eps):
        self._count("add_rms_norm")
        residual.add_(x)
        return self.reference.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up):
        self._count("silu_mul")
        return self.reference.silu_mul(gate_up)

    def rope_store(self, qkv, num_q_heads, positions, cos, sin, k_slots, v_slots, write_slots) -> None:
        self._count("rope_store")
        num_kv_heads = k_slots.shape[0]
        rotated = apply_rotary(qkv[:, : num_q_heads + num_kv_heads], cos[positions].unsqueeze(1),
                               sin[positions].unsqueeze(1))
        qkv[:, : num_q_heads + num_kv_heads] = rotated
        k_slots[:, write_slots] = qkv[:, num_q_heads: num_q_heads + num_kv_heads].transpose(0, 1)
        v_slots[:, write_slots] = qkv[:, num_q_heads + num_kv_heads:].transpose(0, 1)

    def pack_gemv(self, weight):
        return weight.clone()

    def gemv(self, x, weight, bias=None):
        self._count("gemv")
        return F.linear(x, weight, bias)


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen2], ids=["llama", "qwen2"])
def test_the_native_backends_calls_give_transformers_logits(make, tmp_path, monkeypatch) -> None:
    kernels = StandInKernels()
    monkeypatch.setattr(model_runner, "select_backend",
                        lambda choice, device, dtype, *args: Selection(NativeBackend(kernels, dtype), "stand-in"))
    model_dir = make(tmp_path / "model")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 20))
    assert runner.backend.name == "native" and runner.fused is None
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB_SIZE, (9,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, VOCAB_SIZE, (2 + i,), generator=generator).tolist() for i in range(3)]
    shared = [20, 7]  # the prefix's two whole pages, shared by every sequence's table
    tables = [shared + [30 + 5 * i + j for j in range(5)] for i in range(3)]
    # The prefix once, then the rest of each prompt as a chunk starting mid-sequence, then decode
    # steps of all three together (rows sharing leading pages) beside a new prompt's prefill.
    runner.forward([ForwardEntry(prefix, 0, shared + [1], False)])
    out = runner.forward([ForwardEntry(p[8:], 8, t, True) for p, t in zip(prompts, tables)])
    sequences = [list(p) for p in prompts]
    for _ in range(3):
        tokens = out.argmax(-1).tolist()[:3]
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        entries = [ForwardEntry([s[-1]], len(s) - 1, t, True) for s, t in zip(sequences, tables)]
        out = runner.forward(entries + [ForwardEntry(prompts[0][:5], 0, [60, 61], True)])
        with torch.no_grad():
            for row, sequence in enumerate(sequences + [prompts[0][:5]]):
                expected = reference(torch.tensor([sequence])).logits[0, -1]
                torch.testing.assert_close(out[row], expected, atol=ATOL, rtol=0)
    assert {"plan", "rope_store", "rms_norm", "add_rms_norm", "silu_mul", "gemv"} <= kernels.calls.keys()
