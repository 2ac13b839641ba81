"""Rank 0's acceptance rule with a real (tiny, random) model: speculative entries give exactly the
tokens of one-token-per-step decoding, for greedy, seeded sampling with penalties and
truncation, and constrained requests, alone and batched.

Drafts here come from an oracle (the reference output) with one token in four corrupted, so
every entry both accepts and rejects drafts; that is a harder test of the rule than n-gram drafts
on a random model, which are rarely right.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from constrained_model import make_constrained_model
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.sampling import SamplingParams
from worker.executor_fakes import entry, error_of, new_request, task
from radixserve.v1 import worker_pb2
from worker_service.executor import Executor
from worker_service.grammar import ConstraintMasks
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service import native
from worker_service.sampling import Sampler

EOS = 2
MAX_TOKENS = 24
MAX_DRAFTS = 6
KV_CACHE_BYTES = 32 << 20
PAGES_EACH = 8  # 128 positions of 16
LOGPROB_TOLERANCE = 1e-3
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.1, seed=1234)
UNCONSTRAINED = None
PEAKED_INIT = 0.5


@dataclass
class Live:
    request_id: str
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    done: bool = False


class SpecDriver:
    """A minimal router: prefill, then one entry per request per step, with oracle drafts."""

    def __init__(self, executor: Executor, vocab_size: int = 49152) -> None:
        self.executor, self.task_id, self.next_id = executor, 0, 0
        self.vocab_size = vocab_size  # wrong drafts stay inside the vocabulary
        self.num_drafted = self.num_accepted = 0

    def run(self, prompts: list[list[int]], params: list[SamplingParams], constraints: list[Constraint | None],
            oracle: list[list[int]] | None, rng: random.Random) -> list[Live]:
        lives = [Live(f"s{self.next_id + i}") for i in range(len(prompts))]
        self.next_id += len(prompts)
        entries = [
            entry(live.request_id, prompt, 0, list(range(i * PAGES_EACH, (i + 1) * PAGES_EACH)), True,
                  new_request(p, [], len(prompt), c))
            for i, (live, prompt, p, c) in enumerate(zip(lives, prompts, params, constraints))
        ]
        for live, prompt in zip(lives, prompts):
            live.num_computed = len(prompt)
        starts = {live.request_id: len(prompt) for live, prompt in zip(lives, prompts)}
        while entries:
            drafted = {e.request_id: list(e.token_ids)[len(e.token_ids) - e.num_draft_tokens:] for e in entries}
            for token in self._execute(entries):
                live = next(live for live in lives if live.request_id == token.request_id)
                drafts = drafted[live.request_id]
                if drafts:
                    self.num_drafted += len(drafts)
                    self.num_accepted += token.num_accepted_drafts
                accepted = drafts[: token.num_accepted_drafts]
                logprobs = [lp.logprob for lp in token.accepted_logprobs] or [math.nan] * len(accepted)
                for token_id, logprob in [*zip(accepted, logprobs), (token.token_id, token.logprob)]:
                    if live.done:
                        break
                    live.output.append(token_id)
                    live.logprobs.append(logprob)
                    live.done = token_id == EOS or len(live.output) >= MAX_TOKENS
            entries = []
            for index, live in enumerate(lives):
                if live.done:
                    continue
                start = starts[live.request_id] + len(live.output) - 1
                drafts = self._drafts(oracle[index] if oracle else [], len(live.output), rng)
                message = entry(live.request_id, [live.output[-1], *drafts], start, [], True)
                message.num_draft_tokens = len(drafts)
                entries.append(message)
        self._execute([], release=[live.request_id for live in lives])
        return lives

    def _drafts(self, reference: list[int], num_output: int, rng: random.Random) -> list[int]:
        room = min(MAX_DRAFTS, MAX_TOKENS - num_output - 1)
        drafts = list(reference[num_output : num_output + max(room, 0)])
        for index in range(len(drafts)):
            if rng.random() < 0.25:
                drafts[index] = (drafts[index] + 1) % self.vocab_size  # a wrong draft
        if EOS in drafts:
            drafts = drafts[: drafts.index(EOS) + 1]  # nothing follows a stop, as the router does
        return drafts

    def _execute(self, entries: list[worker_pb2.TaskEntry], release: list[str] = ()):
        self.task_id += 1
        result = self.executor.execute(task(self.task_id, entries, release_request_ids=list(release)))
        assert error_of(result) is None, result.error
        return result.tokens


KERNELS = native.load()


# Both samplers: the compiled one reads draft rows' histories as prefixes of the state's own copy.
@pytest.fixture(scope="module", params=[
    "torch", pytest.param("kernel", marks=pytest.mark.skipif(KERNELS is None, reason="the kernels do not build here"))])
def driver(request, tmp_path_factory, smollm2_dir) -> SpecDriver:
    # Large weights make the random model's distributions peaked like a trained model's, so
    # top_p is decided among a few candidates (a flat one makes the sampler sort the vocabulary).
    model_dir = make_constrained_model(tmp_path_factory.mktemp("spec"), smollm2_dir, initializer_range=PEAKED_INIT)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=KV_CACHE_BYTES))
    masks = ConstraintMasks.load(model_dir, runner.info.vocab_size, list(runner.info.eos_token_ids), 16, 1)
    assert masks is not None
    kernels = KERNELS if request.param == "kernel" else None
    return SpecDriver(Executor(runner, Sampler(seed=0, kernels=kernels), constraints=masks))


def requests(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams], list[Constraint | None]]:
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    params = [
        SamplingParams(logprobs=True),
        SEEDED,
        SamplingParams(temperature=1.0, top_k=50, frequency_penalty=0.3, seed=99, logprobs=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
    ]
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{2,8}( [a-z]{2,8}){3,9}\.")
    return prompts, params, [UNCONSTRAINED, UNCONSTRAINED, UNCONSTRAINED, regex]


def test_speculative_entries_give_the_tokens_of_plain_decoding_alone_and_batched(driver) -> None:
    rng = random.Random(3)
    prompts, params, constraints = requests(rng)
    alone = [driver.run([p], [s], [c], None, rng)[0] for p, s, c in zip(prompts, params, constraints)]
    batched = driver.run(prompts, params, constraints, None, rng)
    for plain_alone, plain_batched in zip(alone, batched):
        assert plain_alone.output == plain_batched.output  # the seeded sampler's own promise
    references = [live.output for live in alone]
    spec_alone = driver.run([prompts[1]], [params[1]], [constraints[1]], [references[1]], rng)[0]
    assert spec_alone.output == references[1]
    spec_batched = driver.run(prompts, params, constraints, references, rng)
    assert [live.output for live in spec_batched] == references
    assert spec_batched[0].logprobs == pytest.approx(alone[0].logprobs, abs=LOGPROB_TOLERANCE)
    assert spec_batched[2].logprobs == pytest.approx(alone[2].logprobs, abs=LOGPROB_TOLERANCE)
    assert 0 < driver.num_accepted < driver.num_drafted


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_speculative_greedy_tokens_equal_plain_decoding_on_new_families(family, tmp_path) -> None:
    """Qwen3 (per-head q/k norms) and Gemma 3 (sliding-window layers whose window, 8, is shorter
    than the prompts; their attention takes the windowed path): draft entries give the greedy
    tokens of one-token-per-step decoding, alone and batched."""
    from worker.families import VOCAB_SIZE, make_family

    runner = ModelRunner(RunnerConfig(model_dir=make_family(family, tmp_path / family), kv_cache_bytes=KV_CACHE_BYTES))
    driver = SpecDriver(Executor(runner, Sampler(seed=0)), vocab_size=VOCAB_SIZE)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(12, 30))] for _ in range(3)]
    greedy, unconstrained = [SamplingParams()] * len(prompts), [UNCONSTRAINED] * len(prompts)
    references = [driver.run([p], greedy[:1], unconstrained[:1], None, rng)[0].output for p in prompts]
    assert [live.output for live in driver.run(prompts, greedy, unconstrained, None, rng)] == references
    spec_alone = driver.run(prompts[:1], greedy[:1], unconstrained[:1], references[:1], rng)[0]
    assert spec_alone.output == references[0]
    assert [live.output for live in driver.run(prompts, greedy, unconstrained, references, rng)] == references
    assert 0 < driver.num_accepted < driver.num_drafted


def drafting(request_id: str, token_ids: list[int], start: int, num_drafts: int, sample: bool = True):
    message = entry(request_id, token_ids, start, [], sample)
    message.num_draft_tokens = num_drafts
    return message


def test_a_rank_accepts_any_start_within_the_last_drafts_and_nothing_before(driver) -> None:
    executor = driver.executor
    rid = "v0"

    def run(task_id: int, *entries, release=()):
        return executor.execute(task(task_id, list(entries), release_request_ids=list(release)))

    first = entry(rid, [5, 6, 7], 0, list(range(PAGES_EACH)), True, new_request(SamplingParams(), [], 3))
    assert error_of(run(900, first)) is None
    result = run(901, drafting(rid, [8, 9, 10, 11], 3, 3))
    assert error_of(result) is None and len(result.tokens) == 1
    too_early = run(902, entry(rid, [8], 3, [], True))
    assert error_of(too_early) is not None and "3 of them drafts" in too_early.error.message
    assert error_of(run(903, entry(rid, [9], 5, [], True))) is None
    assert executor.requests.get(rid).token_ids == [5, 6, 7, 8, 9, 9]
    no_sample = run(904, drafting(rid, [1, 2], 6, 1, sample=False))
    assert error_of(no_sample) is not None and "sample is false" in no_sample.error.message
    all_drafts = run(905, drafting(rid, [1, 2], 6, 2))
    assert error_of(all_drafts) is not None and "num_draft_tokens" in all_drafts.error.message
    run(906, release=[rid])
