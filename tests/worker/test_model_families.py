"""Every model family beyond Llama and Qwen2 against transformers, on tiny random checkpoints
(`families.py`), in float32 on each CPU backend, at TP=1 and TP=2.

Per family and backend: the prompt's logits, then 20 greedy decode steps whose logits are compared
at every position with transformers' over the same sequence, and the greedy tokens compared with
transformers' `generate`. At TP=2 (real rank processes over gloo, `test_tensor_parallel.run_ranks`)
rank 0's logits of the prompt and of every greedy decode step, and its greedy continuation, against
the same references. The checkpoints, their transformers models and greedy references are made
once per module (`Checkpoints`) and shared by the TP=1 and TP=2 checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.families import EOS_TOKEN_IDS, FAMILIES, VOCAB_SIZE, make_family
from worker.tiny_models import reference_greedy
from worker.tp_rank import NUM_NEW_TOKENS
from worker_service.backends.selection import select_backend
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

# float32 on 2 layers: measured differences up to ~1e-6 against transformers; a misplaced norm,
# scale or RoPE moves logits by more than 1e-2.
ATOL = 1e-4
PAGE_SIZE = 4
KV_BYTES = 1 << 20
PROMPT_LEN = 37  # not a multiple of the page size
NUM_DECODE_STEPS = 20
# The selection's choices that run on a CPU. `auto` differs from both where the compiled kernels
# do not build but the grouped-expert product does (AVX2 without AVX-512): there it runs the MoE
# families only, with the PyTorch backend and the compiled experts (`backends/grouped_experts.py`).
CPU_BACKENDS = ("torch", "native", "auto")
MOE_FAMILIES = {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "granite_moe", "deepseek_v2",
                "deepseek_v3", "glm4_moe", "minimax_m2",
                "ernie4_5_moe", "granite_moe_shared", "afmoe", "dots1"}
# The families whose layer is exactly Llama's and so may take its fused path.
LLAMA_LAYERED = {"mistral", "phi3", "glm", "ernie4_5", "seed_oss"}


def require_backend(kernel: str, name: str | None = None) -> None:
    """Skip where `select_backend` refuses `kernel` on this machine (it says why), and `auto`
    where it adds nothing to `torch` and `native` for family `name` (see `CPU_BACKENDS`)."""
    try:
        selection = select_backend(kernel, "cpu", torch.float32, 16)
    except RuntimeError as refusal:
        pytest.skip(str(refusal).splitlines()[0])
    if kernel == "auto" and (selection.backend.name != "torch" or name not in MOE_FAMILIES):
        pytest.skip("auto runs as torch or native here" if name in MOE_FAMILIES else "auto: MoE families only")


def prompt(seed: int = 1, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


class Checkpoints:
    """Each family's checkpoint, its transformers model and transformers' greedy continuation of
    `prompt()`, each made on first use and shared by the module's tests."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.models: dict[str, tuple[Path, torch.nn.Module]] = {}
        self.continuations: dict[str, list[int]] = {}

    def get(self, name: str) -> tuple[Path, torch.nn.Module]:
        if name not in self.models:
            out_dir = make_family(name, self.tmp_path_factory.mktemp(name))
            self.models[name] = out_dir, AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        return self.models[name]

    def greedy(self, name: str, num_tokens: int) -> list[int]:
        """The first `num_tokens` (at most `NUM_NEW_TOKENS`) of `generate`'s greedy continuation
        (greedy decoding's first tokens do not depend on how many follow)."""
        assert num_tokens <= NUM_NEW_TOKENS
        if name not in self.continuations:
            self.continuations[name] = reference_greedy(self.get(name)[1], prompt(), NUM_NEW_TOKENS)
        return self.continuations[name][:num_tokens]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, checkpoints) -> tuple[str, Path, torch.nn.Module]:
    return request.param, *checkpoints.get(request.param)


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def runner_for(model_dir: Path, kernel: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                    attention_kernel=kernel))


@pytest.mark.parametrize("kernel", CPU_BACKENDS)
def test_prefill_and_decode_logits_match_transformers(family, kernel, checkpoints) -> None:
    name, model_dir, reference = family
    require_backend(kernel, name)
    runner = runner_for(model_dir, kernel)
    token_ids = prompt()
    pages = list(range(3, 3 + (PROMPT_LEN + NUM_DECODE_STEPS) // PAGE_SIZE + 1))[::-1]  # not in order
    logits = [runner.forward([ForwardEntry(token_ids, 0, pages, True)])[0]]
    tokens = [int(logits[0].argmax())]
    for step in range(NUM_DECODE_STEPS):
        logits.append(runner.forward([ForwardEntry(tokens[-1:], PROMPT_LEN + step, pages, True)])[0])
        tokens.append(int(logits[-1].argmax()))
    expected = reference_logits(reference, token_ids + tokens[:-1])[PROMPT_LEN - 1:]
    torch.testing.assert_close(torch.stack(logits), expected, atol=ATOL, rtol=0)
    assert tokens == checkpoints.greedy(name, NUM_DECODE_STEPS + 1), name


@pytest.mark.parametrize("kernel", CPU_BACKENDS)
def test_batched_prefill_chunks_and_decode_rows_match_transformers(family, kernel) -> None:
    """A chunked prefill (second chunk from the pool) beside decode rows of another sequence."""
    name, model_dir, reference = family
    require_backend(kernel, name)
    runner = runner_for(model_dir, kernel)
    first, second = prompt(2, 21), prompt(3, 30)
    runner.forward([ForwardEntry(first[:-1], 0, list(range(10)), False),
                    ForwardEntry(second[:13], 0, list(range(20, 30)), False)])
    logits = runner.forward([ForwardEntry(first[-1:], len(first) - 1, list(range(10)), True),
                             ForwardEntry(second[13:], 13, list(range(20, 30)), True)])
    torch.testing.assert_close(logits[0], reference_logits(reference, first)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(reference, second)[-1], atol=ATOL, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", ("torch", "native"))
def test_tp2_matches_transformers_for_every_family(kernel, checkpoints, tmp_path) -> None:
    """Every family at TP=2, one after another in one pair of rank processes (a process start
    per family would cost more than the families' own steps): rank 0's logits of the prompt and
    of each of its greedy steps, and its tokens, against transformers'. (`auto`'s compiled
    grouped experts at TP=2: each rank's slice is checked in test_grouped_experts.py, and the
    families at TP=1 above; a third rank pair here would cost the suite ~13 s.)"""
    from worker.test_tensor_parallel import run_ranks

    require_backend(kernel, "qwen3_moe")
    names = sorted(FAMILIES)
    token_ids = prompt()
    per_rank = run_ranks([checkpoints.get(name)[0] for name in names], token_ids, 2, tmp_path, kernel,
                         timeout_s=540)
    for name, first, second in zip(names, *per_rank):
        reference = checkpoints.get(name)[1]
        tokens = checkpoints.greedy(name, NUM_NEW_TOKENS)
        assert first["tokens"] == tokens, name
        expected = reference_logits(reference, token_ids + tokens[:-1])[PROMPT_LEN - 1:]
        torch.testing.assert_close(first["prompt_logits"][0], expected[0], atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(first["step_logits"], expected, atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}, greedy steps: {m}")
        assert second["prompt_logits"] is None and second["step_logits"] is None, name


def test_eos_ids_and_fusable_layer(family) -> None:
    """Every end-of-turn id the generation config lists stops a request; only a layer that is
    exactly Llama's declares Llama's fused path."""
    name, model_dir, _ = family
    runner = runner_for(model_dir, "torch")
    assert runner.info.eos_token_ids == EOS_TOKEN_IDS
    assert type(runner.model).fusable_layer == ("llama" if name in LLAMA_LAYERED else None)


def _edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_a_short_sliding_window_is_followed_in_every_layer(tmp_path) -> None:
    """Mistral v0.1's window (every layer; its logits against transformers' are a config
    variant). A window as long as the context never masks a key: no window at all."""
    model_dir = make_family("mistral", tmp_path / "model")
    _edit_config(model_dir, sliding_window=8)
    runner = runner_for(model_dir, "torch")
    assert [layer.self_attn.options.window for layer in runner.model.layers] == [8, 8]
    assert "sliding-window attention" in type(runner.model).ops_without_kernels(runner.hf_config)
    _edit_config(model_dir, sliding_window=256)
    runner = runner_for(model_dir, "torch")
    assert [layer.self_attn.options for layer in runner.model.layers] == [None, None]
    assert runner.model.shortest_window is None and runner.info.context_len == 256


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path) -> None:
    model_dir = make_family("qwen3", tmp_path / "model")
    _edit_config(model_dir, architectures=["NoSuchForCausalLM"])
    with pytest.raises(ValueError, match=r"NoSuchForCausalLM.*supported: .*'Qwen3ForCausalLM'"):
        runner_for(model_dir, "torch")


def test_a_window_shorter_than_the_prompt_changes_what_gemma_sees(tmp_path) -> None:
    """The Gemma checkpoints' window is short enough to matter: without it transformers' own
    logits differ, so matching them above means the window was applied."""
    from worker.families import GEMMA_WINDOW

    model_dir = make_family("gemma3", tmp_path / "model")
    windowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _edit_config(model_dir, sliding_window=1024)
    unwindowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    token_ids = prompt(5)
    assert PROMPT_LEN > GEMMA_WINDOW
    difference = reference_logits(windowed, token_ids)[-1] - reference_logits(unwindowed, token_ids)[-1]
    assert difference.abs().max() > 100 * ATOL


def test_selection_names_what_runs_in_pytorch_ops() -> None:
    """A model needing operations no compiled kernel has still gets the compiled backend, whose
    reason names those operations; the PyTorch backend's reason is unchanged."""
    ops = ("GELU-tanh gating", "sliding-window attention")
    assert select_backend("torch", "cpu", torch.float32, 16, ops_without_kernels=ops).reason == "asked for (torch)"
    require_backend("native")
    selection = select_backend("native", "cpu", torch.float32, 16, ops_without_kernels=ops)
    assert selection.backend.name == "native"
    assert "GELU-tanh gating, sliding-window attention in PyTorch's ops" in selection.reason


def test_moe_families_name_their_routing_among_ops_without_kernels(checkpoints) -> None:
    """Their routing reads per-expert counts back to the host: named, so that the selection
    leaves CUDA graphs out for them (a capture of such a step fails)."""
    from transformers import AutoConfig

    from worker_service.models import model_class
    from worker_service.models.moe import MOE_ROUTING

    for name in sorted(FAMILIES):
        config = AutoConfig.from_pretrained(checkpoints.get(name)[0])
        assert (MOE_ROUTING in model_class(config).ops_without_kernels(config)) == (name in MOE_FAMILIES), name


def test_the_registry_is_the_launchers_list_of_architectures():
    """`radixserve up` refuses a folder by `radixserve.architectures` before starting a worker:
    the worker's registry must be exactly that list."""
    from radixserve.architectures import SUPPORTED_ARCHITECTURES
    from worker_service.models import MODEL_CLASSES

    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("kernel", ("torch", "native"))
def test_a_window_no_sequence_outgrows_takes_the_backends_own_paths(kernel, tmp_path, monkeypatch) -> None:
    """A step whose sequences all fit the window (Phi-3-mini-4k's 2,047 binds only past that
    length) attends with the backend's own attention, and on the compiled backend runs the fused
    Llama layers, not the per-sequence windowed path; a step with one sequence past it takes the
    windowed path for all. Both give transformers' logits."""
    from worker_service.attention import windowed
    from worker_service.backends import row_kernels, torch_backend

    require_backend(kernel)
    calls = []
    for module in (torch_backend, row_kernels):
        monkeypatch.setattr(module, "windowed_attention",
                            lambda *args, **kwargs: calls.append(1) or windowed.windowed_attention(*args, **kwargs))
    window = PROMPT_LEN + 4
    model_dir = make_family("mistral", tmp_path / "model", sliding_window=window)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    runner = runner_for(model_dir, kernel)
    fused_runs = []
    if kernel == "native":
        assert runner.fused is not None
        run = runner.fused.run
        monkeypatch.setattr(runner.fused, "run", lambda *args: fused_runs.append(1) or run(*args))
    short, long = prompt(3, window - 2), prompt(4, window + 9)
    pages = [list(range(3, 3 + window // PAGE_SIZE + 2)), list(range(40, 40 + (window + 9) // PAGE_SIZE + 2))]
    within = runner.forward([ForwardEntry(short, 0, pages[0], True)])[0]
    assert calls == []
    torch.testing.assert_close(within, reference_logits(reference, short)[-1], atol=ATOL, rtol=0)
    following = runner.forward([ForwardEntry([int(within.argmax())], len(short), pages[0], True)])[0]  # decode
    torch.testing.assert_close(following, reference_logits(reference, short + [int(within.argmax())])[-1],
                               atol=ATOL, rtol=0)
    assert len(fused_runs) == (2 if kernel == "native" else 0)  # both steps in the fused layers
    both = runner.forward([ForwardEntry(short, 0, pages[0], True), ForwardEntry(long, 0, pages[1], True)])
    assert len(calls) == 2  # the windowed path, one call per layer
    assert len(fused_runs) == (2 if kernel == "native" else 0)
    torch.testing.assert_close(both[0], reference_logits(reference, short)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], reference_logits(reference, long)[-1], atol=ATOL, rtol=0)
