"""A fake model with a real page-table KV pool, to catch router bookkeeping bugs.

Every written token goes to slot `page_table[p // page_size] * page_size + p % page_size` as
(token id, position). The next token is a hash of the whole sequence READ BACK through the
page table, so a router that reuses a page with the wrong content, skips or repeats a position,
or hands one page to two sequences gets different tokens; malformed entries (wrong start
position, a page table too short, a stale cache hit) are rejected like a real worker would.
`expected_tokens` computes the output of a request without any router. Speculative entries are
verified like rank 0 does (a draft is kept while it equals the model's next token), and the next
entry may start back at any draft's position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

VOCAB_SIZE = 64
EOS_TOKEN_ID = 2
FIRST_ORDINARY_ID = 3


class FakeTaskError(Exception):
    """The task was malformed; nothing in it was applied."""


@dataclass(slots=True)
class FakeEntry:
    request_id: str
    token_ids: list[int]
    start_position: int
    page_ids: list[int]
    sample: bool
    new_request: bool = False
    cached_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0


@dataclass(slots=True)
class _FakeRequest:
    page_table: list[int]
    num_written: int
    num_unverified: int = 0


def next_token(sequence: list[int], eos_every: int) -> int:
    """The fake model: a deterministic function of the whole sequence.

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so every process agrees.
    """
    digest = hash(tuple(sequence)) & 0xFFFFFFFF
    if eos_every and digest % eos_every == 0:
        return EOS_TOKEN_ID
    return FIRST_ORDINARY_ID + (digest >> 8) % (VOCAB_SIZE - FIRST_ORDINARY_ID)


def cyclic_next_token(sequence: list[int], eos_every: int = 0) -> int:
    """A fake model that repeats itself (as real models often do): the next token follows
    the last one round a cycle of six, except that every ninth position jumps, so drafts taken
    from earlier output are mostly right and sometimes wrong."""
    jump = len(sequence) // 9
    return FIRST_ORDINARY_ID + (sequence[-1] + 1 + jump) % 6


def expected_tokens(
    prompt: list[int],
    max_tokens: int,
    *,
    eos_every: int,
    stop_token_ids: frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    context_len: int = 1 << 30,
    rule: Callable[[list[int], int], int] = next_token,
) -> list[int]:
    """What a correct router returns for this request (greedy, no KV pool involved)."""
    sequence = list(prompt)
    output: list[int] = []
    while True:
        token = rule(sequence, eos_every)
        sequence.append(token)
        output.append(token)
        if token in stop_token_ids or (token == EOS_TOKEN_ID and not ignore_eos):
            return output
        if len(output) >= max_tokens or len(sequence) >= context_len:
            return output


class FakeModel:
    def __init__(self, num_pages: int, page_size: int, eos_every: int = 0,
                 rule: Callable[[list[int], int], int] = next_token) -> None:
        self.rule = rule
        self.num_pages = num_pages
        self.page_size = page_size
        self.eos_every = eos_every
        self.slot_token = [-1] * (num_pages * page_size)
        self.slot_position = [-1] * (num_pages * page_size)
        self.requests: dict[str, _FakeRequest] = {}
        self.num_tasks = 0
        # Per sampling entry of the last task: how many of its drafts were accepted.
        self.last_accepted: list[int] = []

    def _slot(self, page_table: list[int], position: int) -> int:
        return page_table[position // self.page_size] * self.page_size + position % self.page_size

    def _read(self, page_table: list[int], length: int) -> list[int]:
        """The sequence as stored; a slot holding another position reads as -1."""
        tokens = []
        for position in range(length):
            slot = self._slot(page_table, position)
            ok = self.slot_position[slot] == position
            tokens.append(self.slot_token[slot] if ok else -1)
        return tokens

    def execute(self, reset: bool, release_ids: list[str], entries: list[FakeEntry]) -> list[int]:
        """Run one task; returns one token per sampling entry, or raises `FakeTaskError`."""
        requests = {} if reset else dict(self.requests)
        for request_id in release_ids:
            requests.pop(request_id, None)
        seen: set[str] = set()
        planned: list[tuple[FakeEntry, list[int]]] = []
        for entry in entries:
            if entry.request_id in seen:
                raise FakeTaskError(f"{entry.request_id} twice in one task")
            seen.add(entry.request_id)
            state = requests.get(entry.request_id)
            if entry.new_request:
                if state is not None:
                    raise FakeTaskError(f"{entry.request_id} is already running")
                if len(entry.cached_token_ids) != entry.start_position:
                    raise FakeTaskError("cached_token_ids do not match start_position")
                table = list(entry.page_ids)
                written = entry.start_position
            else:
                if state is None:
                    raise FakeTaskError(f"unknown request {entry.request_id}")
                table = state.page_table + list(entry.page_ids)
                written = state.num_written
            unverified = 0 if entry.new_request else state.num_unverified
            if written - unverified <= entry.start_position <= written:
                written = entry.start_position
            if entry.start_position != written:
                raise FakeTaskError(
                    f"{entry.request_id}: start_position {entry.start_position} != {written}"
                )
            if not entry.token_ids:
                raise FakeTaskError(f"{entry.request_id}: no tokens")
            end = entry.start_position + len(entry.token_ids)
            if len(table) * self.page_size < end:
                raise FakeTaskError(f"{entry.request_id}: page table too short for {end}")
            if any(not 0 <= page < self.num_pages for page in table):
                raise FakeTaskError(f"{entry.request_id}: page id out of range")
            if entry.new_request and self._read(table, written) != entry.cached_token_ids:
                raise FakeTaskError(f"{entry.request_id}: cached pages hold other tokens")
            planned.append((entry, table))
        self.num_tasks += 1
        if reset:
            self.requests = {}
        else:
            for request_id in release_ids:
                self.requests.pop(request_id, None)
        for entry, table in planned:
            for offset, token in enumerate(entry.token_ids):
                slot = self._slot(table, entry.start_position + offset)
                self.slot_token[slot] = token
                self.slot_position[slot] = entry.start_position + offset
            end = entry.start_position + len(entry.token_ids)
            self.requests[entry.request_id] = _FakeRequest(table, end, entry.num_draft_tokens)
        sampled = []
        self.last_accepted = []
        for entry, table in planned:
            if entry.sample:
                end = entry.start_position + len(entry.token_ids)
                first = end - entry.num_draft_tokens  # the sequence before the first draft
                accepted = 0
                token = self.rule(self._read(table, first), self.eos_every)
                while accepted < entry.num_draft_tokens and token == entry.token_ids[-entry.num_draft_tokens + accepted]:
                    accepted += 1
                    token = self.rule(self._read(table, first + accepted), self.eos_every)
                sampled.append(token)
                self.last_accepted.append(accepted)
        return sampled
