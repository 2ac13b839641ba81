"""One generation request as the scheduler sees it: token ids, pages and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.constraints import Constraint
from radixserve.sampling import SamplingParams
from router_service.core.radix_cache import RadixNode
from router_service.core.speculation import DraftState


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token id (it is part of the output)
    LENGTH = "length"  # max_tokens or the context length, nothing else
    CANCELLED = "cancelled"
    FAILED = "failed"  # the workers failed, or the router found its own bookkeeping broken


class Pooling(enum.Enum):
    """An embedding request's pooling (see worker.proto `PoolingMode`)."""

    LAST = "last"  # the last prompt position's hidden state: a cached prefix is fine
    MEAN = "mean"  # the mean over every prompt position: each one must be computed


@dataclass(slots=True, eq=False)
class Request:
    """A request's state. `token_ids` is prompt + output so far and only ever grows.

    Invariants while running:
    - `num_computed` tokens have their K/V written on the workers (positions `[0, num_computed)`);
      the last sampled token is never among them until it is fed back.
    - `page_table` covers at least `num_computed` tokens; its first `num_tree_pages` pages are
      the radix cache's (locked through `last_node`), the rest belong to this request.
      `num_tree_pages` grows while the request runs: each whole page it writes enters the cache
      at once (so that others can match it), unless another request cached the same tokens
      first; then the request keeps its own copies until it ends.
    - `num_pages_sent` pages of `page_table` are known to the workers (0 until the request's
      first entry after admission, which carries `new_request`).
    - Overlap scheduling (see `lookahead`): `num_computed` counts the positions of every step
      sent, `num_in_flight` those of steps whose result is not back yet, so `num_written` are
      certainly written (only those may enter the cache). `num_unresolved` tokens were sampled
      in steps still in flight: they follow `token_ids`, value unknown, and the next decode
      entry refers to the first of them instead of carrying it.
    An embedding request (`pooling` set) is a prompt with `max_tokens` 1 whose one "token" is
    the workers' vector: it never decodes, and its whole prompt pages are cached like any.
    """

    request_id: str  # unique per router: it names the request on the workers
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    constraint: Constraint | None = None  # structured output: carried to rank 0, never read here
    arrival: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_output: int = 0
    page_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: RadixNode | None = None
    num_computed: int = 0
    num_pages_sent: int = 0
    on_workers: bool = False
    num_in_flight: int = 0
    num_unresolved: int = 0
    admitted_at: int = -1  # admission order while running; -1 while waiting
    num_cached_tokens: int = -1  # prompt tokens served from the cache, set at first admission
    finish_reason: FinishReason | None = None
    # Speculative decoding: its n-gram lookup state, acceptance and draft counters.
    draft: DraftState = field(default_factory=DraftState)
    # Embedding requests only: how the workers pool the prompt, and whether they normalise.
    pooling: Pooling | None = None
    normalize: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    def cacheable_prefix(self) -> list[int]:
        """The tokens the prefix cache may serve: all but the last (whose logits or hidden state
        are needed), none for mean pooling (which needs every position's hidden state)."""
        if self.pooling is Pooling.MEAN:
            return []
        return self.token_ids[: len(self.token_ids) - 1]

    @property
    def num_pending(self) -> int:
        """Tokens known (or sampled in a step in flight) but not yet computed (1 while decoding)."""
        return len(self.token_ids) + self.num_unresolved - self.num_computed

    @property
    def num_written(self) -> int:
        """Positions whose K/V steps already answered have written."""
        return self.num_computed - self.num_in_flight

    def ends_when_resolved(self, context_len: int) -> bool:
        """The tokens sampled in flight certainly end it (`max_tokens` or the context), so no
        step may compute past them: the pool need not hold that position (see `Scheduler.add`)."""
        if not self.num_unresolved:
            return False
        return (
            self.num_output + self.num_unresolved >= self.max_tokens
            or len(self.token_ids) + self.num_unresolved >= context_len
        )

    def append_token(self, token_id: int, eos_token_ids: frozenset[int], context_len: int) -> None:
        """Add a sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        self.num_output += 1
        if token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_token_ids):
            self.finish_reason = FinishReason.STOP
        elif self.num_output >= self.max_tokens or len(self.token_ids) >= context_len:
            self.finish_reason = FinishReason.LENGTH
