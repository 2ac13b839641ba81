"""The backend seam: whole-layer fusion only for models that declare their layer, decided by the
runner; the backend the worker reports is the one that runs its steps; no two worker modules
import each other."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from worker.tiny_models import VOCAB_SIZE, make_tiny_llama
from worker_service import model_runner, models, native
from worker_service.backends import native_backend
from worker_service.backends.fused_llama import FusedLlamaLayers
from worker_service.backends.native_backend import NativeBackend
from worker_service.backends.selection import Selection
from worker_service.backends.torch_backend import TorchBackend
from worker_service.config import parse_config
from worker_service.distributed import TPGroup
from worker_service.forward_batch import ForwardEntry
from worker_service.kv_pool import KVPool
from worker_service.layers.linear import pack_linear_weights
from worker_service.loader import load_weights
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.server import load_executor

CPU = torch.device("cpu")
WORKER_SERVICE = Path(model_runner.__file__).parent


class UndeclaredLlama(LlamaForCausalLM):
    """Llama's computation in a class that does not declare its layer: it must never be fused."""

    fusable_layer = None


def steps(runner: ModelRunner) -> torch.Tensor:
    """A prompt, then two decode steps of it (decode-sized steps: where fused layers would run)."""
    pages = list(range(1, 9))
    prompt = list(range(3, 14))
    logits = [runner.forward([ForwardEntry(prompt, 0, pages, True)])]
    for position in (len(prompt), len(prompt) + 1):
        token = int(logits[-1][0].argmax())
        logits.append(runner.forward([ForwardEntry([token], position, pages, True)]))
    return torch.cat(logits)


class PassThroughFused:
    """A fused path that runs the model's own layers and counts its steps."""

    def __init__(self, model: torch.nn.Module, calls: list[int]) -> None:
        self.model, self.calls = model, calls

    def applies(self, step) -> bool:
        return True

    def run(self, hidden: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(hidden.shape[0])
        return self.model.run_layers(hidden, step)


@pytest.mark.parametrize("model_cls", [LlamaForCausalLM, UndeclaredLlama], ids=["declared", "undeclared"])
def test_the_runner_takes_a_fused_path_only_for_a_declared_layer(model_cls, tmp_path, monkeypatch) -> None:
    """A backend offering fused Llama layers (the compiled backend's gate: `fusable_layer`): the
    runner runs them for the declared model and never for the undeclared one, with the same logits."""
    calls: list[int] = []

    class FusingBackend(TorchBackend):
        def fused_layers(self, model, pool):
            return PassThroughFused(model, calls) if type(model).fusable_layer == "llama" else None

    def select(choice, device, dtype, *args):
        return Selection(FusingBackend(torch.device(device), dtype), "test")

    model_dir = make_tiny_llama(tmp_path / "model")
    plain = steps(ModelRunner(RunnerConfig(model_dir=model_dir, page_size=4, kv_cache_bytes=1 << 20,
                                           attention_kernel="torch")))
    monkeypatch.setattr(model_runner, "select_backend", select)
    monkeypatch.setitem(models.MODEL_CLASSES, "LlamaForCausalLM", model_cls)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=4, kv_cache_bytes=1 << 20))
    assert type(runner.model) is model_cls
    assert torch.equal(steps(runner), plain)
    assert calls == ([11, 1, 1] if model_cls is LlamaForCausalLM else [])


@pytest.mark.parametrize("model_cls", [LlamaForCausalLM, UndeclaredLlama], ids=["declared", "undeclared"])
def test_the_compiled_backend_builds_fused_layers_only_for_a_declared_layer(model_cls, tmp_path,
                                                                            monkeypatch) -> None:
    """`NativeBackend.fused_layers` asks the model's declaration before anything else (checked with a
    stand-in for the library, so that it runs where the kernels do not build)."""
    built: list[type] = []

    class Kernels:
        gemv_dtypes = frozenset({torch.float32})

    monkeypatch.setitem(native_backend.FUSED_LAYERS, "llama",
                        type("Recorder", (), {"build": staticmethod(lambda k, model, pool: built.append(type(model)))}))
    model_dir = make_tiny_llama(tmp_path / "model")
    backend = TorchBackend(CPU, torch.float32)
    model = model_cls(AutoConfig.from_pretrained(model_dir), TPGroup(0, 1), torch.float32, CPU, backend)
    load_weights(model, model_dir)
    pack_linear_weights(model, backend)
    pool = KVPool(2, 4, 4, model.num_kv_heads, 16, torch.float32, CPU)
    NativeBackend(Kernels(), torch.float32).fused_layers(model, pool)
    assert built == ([model_cls] if model_cls is LlamaForCausalLM else [])


@pytest.mark.skipif(native.load() is None, reason="the compiled kernels do not build here")
@pytest.mark.parametrize("model_cls", [LlamaForCausalLM, UndeclaredLlama], ids=["declared", "undeclared"])
def test_an_undeclared_model_never_runs_the_compiled_fused_layers(model_cls, tmp_path, monkeypatch) -> None:
    calls: list[int] = []
    original = FusedLlamaLayers.run
    monkeypatch.setattr(FusedLlamaLayers, "run",
                        lambda self, hidden, step: calls.append(1) or original(self, hidden, step))
    monkeypatch.setitem(models.MODEL_CLASSES, "LlamaForCausalLM", model_cls)
    runner = ModelRunner(RunnerConfig(model_dir=make_tiny_llama(tmp_path / "model"), page_size=4,
                                      kv_cache_bytes=1 << 20, attention_kernel="native"))
    steps(runner)
    declared = model_cls is LlamaForCausalLM
    assert (runner.fused is not None, bool(calls)) == (declared, declared)


@pytest.mark.parametrize("choice", ["auto", "torch"])
def test_the_reported_backend_is_the_one_that_runs(choice, tmp_path, caplog, monkeypatch) -> None:
    """The worker's log line and its `worker_backend_info` metric name the backend that plans (and
    so runs) its steps; no other backend plans one."""
    ran: list[str] = []
    for cls in (TorchBackend, NativeBackend):  # every backend's `plan` is one of these two
        original = cls.plan
        monkeypatch.setattr(cls, "plan", lambda self, *args, _original=original: ran.append(self.name)
                            or _original(self, *args))
    model_dir = make_tiny_llama(tmp_path / "model")
    config = parse_config(["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--page-size", "4",
                           "--kv-cache-mb", "1", "--attention-kernel", choice], env={})
    with caplog.at_level(logging.INFO, logger="worker_service"):
        executor = load_executor(config)
    name = executor.runner.backend.name
    assert any(f"backend: {name} (" in record.getMessage() for record in caplog.records)
    registry = executor.metrics.registry
    assert registry.get_sample_value("radixserve:worker_backend_info",
                                     {"model_name": model_dir.name, "rank": "0", "backend": name}) == 1
    logits = executor.runner.forward([ForwardEntry([5, 6, 7], 0, [0], True)])
    assert logits.shape == (1, VOCAB_SIZE)
    assert ran == [name]
    if choice == "torch":
        assert name == "torch"


def test_no_two_worker_modules_import_each_other() -> None:
    """Every import of a worker_service module by another, TYPE_CHECKING blocks and function
    bodies included: no pair imports each other (shared types live in leaf modules)."""
    modules = {}
    for path in WORKER_SERVICE.rglob("*.py"):
        parts = path.relative_to(WORKER_SERVICE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        imports[name] = {target for target in found if target in modules and target != name}
    pairs = sorted((a, b) for a, targets in imports.items() for b in targets if a < b and a in imports.get(b, ()))
    assert pairs == []
