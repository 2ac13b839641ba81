"""Constraint compiles in child processes, so that a compile past its deadline can be stopped.

A thread cannot be stopped, and llguidance's own limits do not bound every construction in
time (some regexes run for seconds whatever the lexer fuel), so the gateway compiles in
`num_processes` long-lived children, each holding the tokenizer's llguidance index. A compile
that runs past its timeout, or whose child dies, costs that child: it is killed and a fresh one
started before `compile` returns, so whoever sent the slow constraint waits for the
replacement, and the other children stay free for everyone else.

Children come from the `forkserver` start method: never forked from the gateway's own
threaded process. They only answer verdicts (the gateway never samples): None for a
constraint that compiles, the library's message for one it rejects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
from multiprocessing.connection import Connection

from radixserve.constraints import Constraint
from radixserve.grammar_compiler import InvalidConstraint, build_matcher, tokenizer_from_hf

log = logging.getLogger(__name__)

_CONTEXT = multiprocessing.get_context("forkserver")
# The forkserver imports the grammar library once; each child starts from that image.
_CONTEXT.set_forkserver_preload(["radixserve.grammar_compiler"])
_READY = "ready"
# A child that failed to start is tried again after this pause (a broken install would
# otherwise spin); each try is bounded by `start_timeout_s`.
RESTART_PAUSE_S = 1.0


class CompileFailed(Exception):
    """The compile was stopped (past its timeout) or its process died: the text may be at
    fault, or the machine too busy, so this verdict is never cached."""


class CompilersBusy(Exception):
    """No child became free within the wait allowed."""


def _child_main(conn: Connection, hf_tokenizer) -> None:
    tokenizer = tokenizer_from_hf(hf_tokenizer)
    conn.send(_READY)
    while True:
        try:
            constraint = conn.recv()
        except EOFError:  # the gateway closed its end: it stops
            return
        try:
            build_matcher(tokenizer, constraint)
            verdict = None
        except InvalidConstraint as exc:
            verdict = str(exc)
        conn.send(verdict)


class _Child:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    async def start(cls, hf_tokenizer, timeout_s: float) -> "_Child":
        parent, child_end = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_child_main, args=(child_end, hf_tokenizer), daemon=True,
                                   name="constraint-compiler")
        await asyncio.to_thread(process.start)
        child_end.close()
        child = cls(process, parent)
        try:
            if await asyncio.wait_for(child.receive(), timeout_s) != _READY:
                raise RuntimeError("the compile process did not report ready")
        except BaseException:
            await child.kill()
            raise
        return child

    async def receive(self):
        """The child's next message; raises EOFError when it died."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        return self.conn.recv()

    async def compile(self, constraint: Constraint, timeout_s: float) -> str | None:
        self.conn.send(constraint)  # the child waits in recv: it takes the message at once
        return await asyncio.wait_for(self.receive(), timeout_s)

    async def kill(self) -> None:
        self.process.kill()
        self.conn.close()
        await asyncio.to_thread(self.process.join)


async def warm_up() -> None:
    """Start the forkserver (a fresh interpreter importing the grammar library) ahead of the
    first child, e.g. while the gateway loads its tokenizer."""
    await asyncio.to_thread(multiprocessing.forkserver.ensure_running)


class CompileProcesses:
    """`num_processes` children; `start` brings them up, `compile` takes a free one."""

    def __init__(self, hf_tokenizer, num_processes: int, start_timeout_s: float) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._num_processes = num_processes
        self._start_timeout_s = start_timeout_s
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()  # idle or busy
        self._replacing: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Returns once every child is ready (each within `start_timeout_s`)."""
        children = await asyncio.gather(*(
            _Child.start(self._hf_tokenizer, self._start_timeout_s) for _ in range(self._num_processes)))
        for child in children:
            self._children.add(child)
            self._idle.put_nowait(child)

    async def compile(self, constraint: Constraint, timeout_s: float, wait_s: float) -> str | None:
        """The verdict (None: it compiles; else the library's message).

        Raises `CompilersBusy` when no child is free within `wait_s`, `CompileFailed` when the
        compile ran past `timeout_s` or its child died (the child is replaced before this returns).
        """
        try:
            child = await asyncio.wait_for(self._idle.get(), wait_s)
        except asyncio.TimeoutError:
            raise CompilersBusy("every constraint compiler is busy") from None
        try:
            verdict = await child.compile(constraint, timeout_s)
        except asyncio.TimeoutError:
            await self._replace(child)
            raise CompileFailed(f"took longer than {timeout_s:g} s to compile") from None
        except (EOFError, OSError):
            await self._replace(child)
            raise CompileFailed("stopped the compiler process") from None
        except asyncio.CancelledError:
            # The answer may still come and would be read as the next compile's: start afresh.
            self._replace_later(child)
            raise
        self._idle.put_nowait(child)
        return verdict

    async def _replace(self, child: _Child) -> None:
        self._children.discard(child)
        await child.kill()
        while not self._closed:
            try:
                fresh = await _Child.start(self._hf_tokenizer, self._start_timeout_s)
                self._children.add(fresh)
                self._idle.put_nowait(fresh)
                return
            except Exception:
                log.exception("a constraint compile process failed to start; trying again")
                await asyncio.sleep(RESTART_PAUSE_S)

    def _replace_later(self, child: _Child) -> None:
        task = asyncio.create_task(self._replace(child))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def close(self) -> None:
        """Kill every child, busy ones too."""
        self._closed = True
        for task in list(self._replacing):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._replacing, return_exceptions=True)
        await asyncio.gather(*(child.kill() for child in self._children))
        self._children.clear()
