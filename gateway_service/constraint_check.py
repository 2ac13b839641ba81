"""The gateway's check of a request's constraint: compile it before the request is routed.

An invalid schema, regex or grammar becomes INVALID_ARGUMENT with the grammar library's message.
Compiling runs on a small thread pool (llguidance drops the GIL), never on the event loop, and
each distinct constraint is compiled once (the compiler caches by its text). A compile that
takes longer than `--constraint-timeout-s` is answered INVALID_ARGUMENT at the deadline and the
constraint is remembered as rejected, so a pathological regex costs its time once and never
holds up other requests.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from gateway_service.errors import InvalidRequest
from radixserve.constraints import Constraint
from radixserve.grammar_compiler import GrammarCompiler, InvalidConstraint

log = logging.getLogger(__name__)


class ConstraintChecker:
    """Builds its compiler in the background at start (about a second for the tokenizer's
    index); the first check waits for it."""

    def __init__(self, hf_tokenizer, timeout_s: float, cache_size: int, num_threads: int) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="constraint")
        self._compiler: Future[GrammarCompiler] = self._pool.submit(
            GrammarCompiler.from_hf, hf_tokenizer, cache_size
        )

    async def check(self, constraint: Constraint | None) -> None:
        """Raise `InvalidRequest` unless `constraint` compiles within the timeout."""
        if constraint is None:
            return
        problems = constraint.problems()
        if problems:
            raise InvalidRequest("; ".join(problems))
        compiler = await asyncio.wrap_future(self._compiler)
        compiling = asyncio.get_running_loop().run_in_executor(self._pool, compiler.compile, constraint)
        try:
            await asyncio.wait_for(compiling, self.timeout_s)
        except InvalidConstraint as exc:
            raise InvalidRequest(str(exc)) from exc
        except asyncio.TimeoutError:
            message = (
                f"constraint.{constraint.kind.value} took longer than {self.timeout_s:g} s to "
                "compile (--constraint-timeout-s)"
            )
            compiler.reject(constraint, message)
            log.warning("rejected %s: %s", constraint.describe(), message)
            raise InvalidRequest(message) from None

    def close(self) -> None:
        """Drop queued compiles; one still running finishes on its own (the library bounds it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
