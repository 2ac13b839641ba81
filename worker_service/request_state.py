"""Per-request bookkeeping on one rank.

Every rank keeps the same states, because every rank applies the same tasks in the same order.
Invariants a state keeps:
  - `num_written == len(token_ids)`: every token in the history has its K/V in the pages
    (while a step runs, its tokens are already appended; a failed step cuts them off again);
    the last `num_unverified` of them are drafts whose fate only rank 0 and the router know, so
    the next entry may start at any of their positions (dropping them and what follows);
  - `len(page_table) * page_size >= num_written`; `page_set` holds the same ids as `page_table`;
  - page ids are router-owned; the worker never allocates or frees them, it only remembers
    which ones hold this request's sequence.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from worker_service.grammar import RequestMatcher


@dataclass(slots=True)
class RequestState:
    """What one rank remembers about one request between steps.

    `token_ids` is the request's sequence so far: the cached prefix it arrived with plus every
    token computed since (prompt chunks, then the sampled tokens fed back as decode tokens).
    Positions `[0, num_prompt_tokens)` are prompt; the rest are output, which the presence and
    frequency penalties count and which step the seeded generator is on. The lists grow in
    place, so a step costs its new tokens and pages, not the request's length. `token_array`
    holds the same ids as int32, kept in step with `token_ids` by every method here: the sampler's
    compiled penalties read it in place (no conversion of the whole sequence per step).
    """

    request_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    page_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # The ids of `page_table`, so that a step checks its new pages without scanning the table.
    page_set: set[int] = field(default_factory=set)
    # Rank 0, constrained requests only: the constraint's matcher (see grammar.py).
    matcher: RequestMatcher | None = None
    # Drafts at the end of `token_ids` from the last entry (speculative decoding).
    num_unverified: int = 0
    token_array: array = field(default_factory=lambda: array("i"))
    # An embedding request's `worker_pb2.PoolingMode` (0: generation) and whether to normalise;
    # rank 0, MEAN: the sum of the final hidden states over the positions computed so far.
    pooling: int = 0
    normalize: bool = False
    pooled_sum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.token_array) != len(self.token_ids):
            self.token_array = array("i", self.token_ids)

    @property
    def num_written(self) -> int:
        """Tokens whose K/V is in the pages; the next entry must start here."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens computed so far: the seeded generator's step number."""
        return max(0, len(self.token_ids) - self.num_prompt_tokens)

    def append(self, token_ids: Iterable[int], page_ids: Iterable[int]) -> None:
        """Record tokens whose K/V this step writes and the pages that were added for them."""
        self.page_table.extend(page_ids)
        self.page_set.update(self.page_table[len(self.page_set):])
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        self.token_array.extend(self.token_ids[start:])

    def append_entry(self, start_position: int, token_ids: Iterable[int], page_ids: Iterable[int],
                     num_drafts: int) -> StepMark:
        """`append` an entry that starts at `start_position`, first dropping the unverified
        drafts from there on (rejected ones); returns what `restore` needs to undo it."""
        mark = StepMark(len(self.token_ids), len(self.page_table), self.token_ids[start_position:],
                        self.num_unverified)
        del self.token_ids[start_position:]
        del self.token_array[start_position:]
        self.append(token_ids, page_ids)
        self.num_unverified = num_drafts
        return mark

    def restore(self, mark: StepMark) -> None:
        """Undo `append_entry` (a failed step): the state is as it was before it."""
        self.truncate(mark.num_tokens - len(mark.dropped), mark.num_pages)
        self.token_ids.extend(mark.dropped)
        self.token_array.extend(mark.dropped)
        self.num_unverified = mark.num_unverified

    def truncate(self, num_tokens: int, num_pages: int) -> None:
        """Undo `append`s back to `num_tokens` tokens and `num_pages` pages (a failed step)."""
        self.page_set.difference_update(self.page_table[num_pages:])
        del self.page_table[num_pages:]
        del self.token_ids[num_tokens:]
        del self.token_array[num_tokens:]


# Not frozen, as SampleRow (sampling/rows.py): one for every row of every step.
@dataclass(slots=True)
class StepMark:
    """A state's size before a step, and the unverified drafts the step dropped."""

    num_tokens: int
    num_pages: int
    dropped: list[int]
    num_unverified: int


class RequestTable:
    """The requests a rank knows, keyed by request id."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def add(self, state: RequestState) -> None:
        if state.request_id in self._states:
            raise KeyError(f"request {state.request_id!r} is already known")
        self._states[state.request_id] = state

    def release(self, request_ids: list[str]) -> None:
        """Forget these requests; unknown ids are ignored (a release may follow a reset)."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def clear(self) -> None:
        self._states.clear()
