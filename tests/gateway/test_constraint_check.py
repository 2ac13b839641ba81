"""The gateway's constraint check: library errors become InvalidRequest; a compile slower than
the timeout is stopped at the deadline (its process replaced) and not remembered; one client
cannot hold more than its share of the compile processes; texts over the size limit are
refused before compiling."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from gateway_service.constraint_check import ConstraintChecker, ConstraintsBusy
from gateway_service.errors import InvalidRequest
from radixserve.constraints import Constraint, ConstraintKind

# ~60 KB of starred groups: llguidance's lexer construction runs for seconds on it whatever
# its fuel limit (it fails in the end), so only stopping the process bounds it.
SLOW_REGEX = "".join(f"(a|b{i % 10})*" for i in range(6000))
# Well under the time SLOW_REGEX takes to fail on its own: llguidance gives up on its lexer (out
# of fuel, "lexer precomputation failed") after ~0.9 s on a fast machine, so with a 1 s timeout
# the timeout did not always come first. A valid constraint compiles in ~1-2 ms.
TIMEOUT_S = 0.25
# Stopping a compile includes starting its replacement process.
STOPPED_WITHIN_S = TIMEOUT_S + 20
VALID = Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))
MAX_CHARS = 100_000


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def checker_for(hf_tokenizer, num_processes: int = 1) -> ConstraintChecker:
    return ConstraintChecker(hf_tokenizer, timeout_s=TIMEOUT_S, cache_size=8, num_processes=num_processes,
                             compiles_per_client=1, max_chars=MAX_CHARS, start_timeout_s=60)


def slow(seed: int) -> Constraint:
    return Constraint(ConstraintKind.REGEX, f"(a|c{seed})*" + SLOW_REGEX)


@pytest.mark.timeout(180)
def test_check_passes_valid_and_rejects_invalid(hf_tokenizer) -> None:
    async def run() -> None:
        checker = checker_for(hf_tokenizer)
        await checker.start()
        try:
            await checker.check(Constraint(ConstraintKind.REGEX, "[0-9]+"))
            await checker.check(None)
            with pytest.raises(InvalidRequest, match="constraint.regex"):
                await checker.check(Constraint(ConstraintKind.REGEX, "(*unclosed"))
            with pytest.raises(InvalidRequest, match="not valid JSON"):
                await checker.check(Constraint(ConstraintKind.JSON_SCHEMA, "{nope"))
            with pytest.raises(InvalidRequest, match="--max-constraint-chars"):
                await checker.check(Constraint(ConstraintKind.REGEX, "a" * (MAX_CHARS + 1)))
        finally:
            await checker.close()

    asyncio.run(run())


@pytest.mark.timeout(180)
def test_slow_compile_is_stopped_and_not_remembered(hf_tokenizer) -> None:
    async def run() -> None:
        checker = checker_for(hf_tokenizer)
        await checker.start()
        try:
            for _ in range(2):  # not cached: the second time is compiled (and stopped) again
                start = time.monotonic()
                with pytest.raises(InvalidRequest, match="took longer than"):
                    await checker.check(slow(0), "attacker")
                assert time.monotonic() - start < STOPPED_WITHIN_S
            # The one process was replaced: a valid constraint compiles at once.
            start = time.monotonic()
            await checker.check(VALID, "victim")
            assert time.monotonic() - start < TIMEOUT_S
        finally:
            await checker.close()

    asyncio.run(run())


@pytest.mark.timeout(180)
def test_one_client_holds_at_most_its_share(hf_tokenizer) -> None:
    async def run() -> None:
        checker = checker_for(hf_tokenizer, num_processes=2)
        await checker.start()
        try:
            first = asyncio.create_task(checker.check(slow(1), "attacker"))
            await asyncio.sleep(0.05)  # well inside its TIMEOUT_S: it is still compiling
            with pytest.raises(ConstraintsBusy):
                await checker.check(slow(2), "attacker")
            start = time.monotonic()
            await checker.check(VALID, "victim")  # the other process is free
            assert time.monotonic() - start < TIMEOUT_S
            with pytest.raises(InvalidRequest, match="took longer than"):
                await first
        finally:
            await checker.close()

    asyncio.run(run())
