"""Seeded sampling through the executor: the same tokens alone, batched, chunked and across
retraction, with the fake runner and with a real tiny model."""

from __future__ import annotations

from radixserve.sampling import SamplingParams
from worker.executor_fakes import NUM_PAGES, PAGE_SIZE, Driver, error_of, first, step, task
from worker.tiny_models import make_tiny_llama
from worker_service.executor import Executor
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.sampling import Sampler


SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=2024)


def seeded_run(prompt: list[int], num_tokens: int, chunk: int, companions: bool) -> list[int]:
    """Generate from `prompt` with SEEDED, prefilling `chunk` tokens a step, maybe with others."""
    driver = Driver()
    driver.executor.sampler = Sampler()  # a fresh shared generator with an unknown seed
    pages = list(range(NUM_PAGES - 1, NUM_PAGES - 1 - 8, -1))
    extras = [first(f"x{i}", [i + 1] * (i + 2), [i], params=SamplingParams(temperature=1.3)) for i in range(3)]
    tokens: list[int] = []
    position = 0
    while len(tokens) < num_tokens:
        if position < len(prompt):
            token_ids = prompt[position : position + chunk]
            done = position + len(token_ids) == len(prompt)
        else:
            token_ids, done = [tokens[-1]], True
        needed = -(-(position + len(token_ids)) // PAGE_SIZE) - -(-position // PAGE_SIZE)
        new_pages, pages = pages[:needed], pages[needed:]
        if position == 0:
            entry = first("s", token_ids, new_pages, params=SEEDED, num_prompt=len(prompt), sample=done)
        else:
            entry = step("s", token_ids, position, new_pages, sample=done)
        batch = [*extras, entry] if companions and position == 0 else [entry]
        result = driver.ok(*batch)
        if done:
            tokens.append(result[-1])
        position += len(token_ids)
    return tokens


def test_seeded_request_reproduces_alone_batched_and_chunked() -> None:
    prompt = [5, 17, 33, 2, 8, 60, 11]
    alone = seeded_run(prompt, 8, chunk=len(prompt), companions=False)
    assert seeded_run(prompt, 8, chunk=3, companions=True) == alone
    assert seeded_run(prompt, 8, chunk=1, companions=False) == alone
    assert len(set(alone)) > 1


def test_seeded_request_survives_retraction() -> None:
    prompt = [5, 17, 33, 2, 8, 60, 11]
    straight = seeded_run(prompt, 6, chunk=len(prompt), companions=False)
    driver = Driver()
    tokens = driver.ok(first("s", prompt, [0, 1], params=SEEDED))
    tokens += driver.ok(step("s", [tokens[-1]], 7))
    tokens += driver.ok(step("s", [tokens[-1]], 8, [2]))
    # Retracted, then resumed: only page 0 (prompt[:4]) survived in the prefix cache, so the rest of
    # the prompt and the three output tokens are computed again on fresh pages.
    resumed = first("s", prompt[4:] + tokens, [0, 5, 6], params=SEEDED, cached=prompt[:4], num_prompt=len(prompt))
    tokens += driver.ok(resumed, release=["s"])
    assert driver.executor.requests.get("s").num_output_tokens == 3
    while len(tokens) < 6:
        tokens += driver.ok(step("s", [tokens[-1]], len(prompt) + len(tokens) - 1))
    assert tokens == straight


def test_seeded_tokens_with_a_real_model_do_not_depend_on_the_batch(tmp_path) -> None:
    runner = ModelRunner(RunnerConfig(make_tiny_llama(tmp_path / "llama"), page_size=4, kv_cache_bytes=1 << 20))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    prompt = [5, 17, 33, 2, 8, 60, 11]

    def generate(companions: bool, chunk: int) -> list[int]:
        executor = Executor(runner, Sampler())
        extras = [first(f"x{i}", [9 + i] * (3 + i), [20 + 3 * i, 21 + 3 * i, 22 + 3 * i], params=SamplingParams(temperature=0.9))
                  for i in range(2)] if companions else []
        head = first("s", prompt[:chunk], [0], params=params, num_prompt=len(prompt), sample=False)
        assert error_of(executor.execute(task(1, [*extras, head], reset=True))) is None
        result = executor.execute(task(2, [step("s", prompt[chunk:], chunk, [1, 2])]))
        tokens = [result.tokens[0].token_id]
        extra_positions = {f"x{i}": 3 + i for i in range(2)} if companions else {}
        for task_id in range(3, 8):
            entries = [step("s", [tokens[-1]], len(prompt) + len(tokens) - 1)]
            for request_id, position in extra_positions.items():
                entries.insert(0, step(request_id, [1], position))
                extra_positions[request_id] += 1
            result = executor.execute(task(task_id, entries))
            assert error_of(result) is None, result.error
            tokens.append(result.tokens[-1].token_id)
        return tokens

    alone = generate(companions=False, chunk=4)
    assert generate(companions=True, chunk=2) == alone
    assert len(set(alone)) > 1
