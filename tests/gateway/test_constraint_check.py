"""The gateway's constraint check: library errors become InvalidRequest, a compile slower than
the timeout is rejected at the deadline and stays rejected, and valid constraints pass."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from gateway_service.constraint_check import ConstraintChecker
from gateway_service.errors import InvalidRequest
from radixserve.constraints import Constraint, ConstraintKind

# Hundreds of properties with patterns: compiles in milliseconds, far above the tiny timeout.
BIG_SCHEMA = json.dumps({
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"} for i in range(400)},
    "required": [f"field_{i}" for i in range(400)],
})
TINY_TIMEOUT_S = 1e-4


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.timeout(120)
def test_check_passes_valid_and_rejects_invalid(hf_tokenizer) -> None:
    checker = ConstraintChecker(hf_tokenizer, timeout_s=30.0, cache_size=8, num_threads=1)
    try:
        asyncio.run(checker.check(Constraint(ConstraintKind.REGEX, "[0-9]+")))
        asyncio.run(checker.check(None))
        with pytest.raises(InvalidRequest, match="constraint.regex"):
            asyncio.run(checker.check(Constraint(ConstraintKind.REGEX, "(*unclosed")))
        with pytest.raises(InvalidRequest, match="not valid JSON"):
            asyncio.run(checker.check(Constraint(ConstraintKind.JSON_SCHEMA, "{nope")))
    finally:
        checker.close()


@pytest.mark.timeout(120)
def test_slow_compile_is_rejected_at_the_timeout_and_stays_rejected(hf_tokenizer) -> None:
    checker = ConstraintChecker(hf_tokenizer, timeout_s=TINY_TIMEOUT_S, cache_size=8, num_threads=1)
    big = Constraint(ConstraintKind.JSON_SCHEMA, BIG_SCHEMA)
    try:
        checker._compiler.result(timeout=60)  # the tokenizer index is built; time only the compile
        with pytest.raises(InvalidRequest, match="took longer than"):
            asyncio.run(checker.check(big))
        checker._pool.submit(lambda: None).result(timeout=60)  # the abandoned compile has ended
        with pytest.raises(InvalidRequest, match="took longer than"):
            asyncio.run(checker.check(big))
    finally:
        checker.close()
