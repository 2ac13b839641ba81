"""The gateway's check of a request's constraint: compile it before the request is routed.

An invalid schema, regex or grammar becomes INVALID_ARGUMENT with the grammar library's message.
Compiles run in child processes (`compile_processes`), never on the event loop, and cannot be
starved by one client:

- a compile past `--constraint-timeout-s` is stopped (its process killed) and answered
  INVALID_ARGUMENT; that verdict is not remembered, since the machine may have been slow;
- only the library's own verdicts are cached (they depend on the text alone), so a valid
  constraint accepted once is accepted again, whatever happened meanwhile;
- one text is compiled once at a time (later requests for it wait for that compile);
- a client (API token, else peer address) may have `compiles_per_client` compiles at once,
  more are RESOURCE_EXHAUSTED, so with more processes than that someone else always finds one;
- a request that finds every process busy for the timeout is RESOURCE_EXHAUSTED (retry later).
"""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from gateway_service.compile_processes import CompileFailed, CompileProcesses, CompilersBusy
from gateway_service.errors import GatewayError, InvalidRequest
from radixserve.constraints import Constraint

log = logging.getLogger(__name__)


class ConstraintsBusy(GatewayError):
    """Too many compiles now (this client's, or everyone's): retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ConstraintChecker:
    """`start` brings up the compile processes; `check` validates one constraint."""

    def __init__(
        self, hf_tokenizer, timeout_s: float, cache_size: int, num_processes: int,
        compiles_per_client: int, max_chars: int, start_timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._compiles_per_client = compiles_per_client
        self._max_chars = max_chars
        self._processes = CompileProcesses(hf_tokenizer, num_processes, start_timeout_s)
        # The library's verdicts, least recently used first: None compiles, else its message.
        self._verdicts: collections.OrderedDict[Constraint, str | None] = collections.OrderedDict()
        self._compiling: dict[Constraint, asyncio.Task] = {}
        self._per_client: collections.Counter[str] = collections.Counter()

    async def start(self) -> None:
        await self._processes.start()

    async def check(self, constraint: Constraint | None, client: str = "") -> None:
        """Raise `InvalidRequest` unless `constraint` compiles within the timeout, and
        `ConstraintsBusy` when this client (or everyone) has too many compiles running."""
        if constraint is None:
            return
        problems = constraint.problems()
        if len(constraint.text) > self._max_chars or sum(map(len, constraint.choices)) > self._max_chars:
            problems.append(f"constraint.{constraint.kind.value} is longer than {self._max_chars} "
                            "characters (--max-constraint-chars)")
        if problems:
            raise InvalidRequest("; ".join(problems))
        if constraint in self._verdicts:
            self._verdicts.move_to_end(constraint)
            verdict = self._verdicts[constraint]
        else:
            compiling = self._compiling.get(constraint)
            if compiling is None:
                compiling = self._start_compile(constraint, client)
            # The compile belongs to the checker: a caller that leaves does not stop it (its
            # verdict is cached for the next), and its client's slot is held until it ends.
            verdict = await asyncio.shield(compiling)
        if verdict is not None:
            raise InvalidRequest(verdict)

    def _start_compile(self, constraint: Constraint, client: str) -> asyncio.Task:
        if self._per_client[client] >= self._compiles_per_client:
            raise ConstraintsBusy(
                f"at most {self._compiles_per_client} constraint compiles at once per client; "
                "retry when one has finished")
        self._per_client[client] += 1
        task = asyncio.create_task(self._compile(constraint))

        def ended(done: asyncio.Task) -> None:
            if not done.cancelled():
                done.exception()  # every waiter may have left: the verdict is not lost, only unread
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
            del self._compiling[constraint]

        task.add_done_callback(ended)
        self._compiling[constraint] = task
        return task

    async def _compile(self, constraint: Constraint) -> str | None:
        try:
            verdict = await self._processes.compile(constraint, self.timeout_s, self.timeout_s)
        except CompileFailed as exc:
            message = f"constraint.{constraint.kind.value} {exc} (--constraint-timeout-s)"
            log.warning("rejected %s: %s", constraint.describe(), message)
            raise InvalidRequest(message) from None
        except CompilersBusy:
            raise ConstraintsBusy("every constraint compiler is busy; retry later") from None
        self._verdicts[constraint] = verdict
        while len(self._verdicts) > self._cache_size:
            self._verdicts.popitem(last=False)
        return verdict

    async def close(self) -> None:
        for task in list(self._compiling.values()):
            task.cancel()
        await asyncio.gather(*self._compiling.values(), return_exceptions=True)
        await self._processes.close()
