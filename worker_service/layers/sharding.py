"""How a tensor-parallel rank's share of heads, features and vocabulary is chosen.

Every split is by contiguous ranges so that a rank can read its part of a checkpoint tensor with
one `get_slice` per piece. Splits need not be even: attention heads go by whole KV groups (a
rank never holds a query head without its KV head), and when there are more ranks than KV heads
the KV heads are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_service.unsupported import UnsupportedModel


def balanced_range(total: int, num_parts: int, part: int) -> range:
    """The `part`-th of `num_parts` contiguous ranges covering `range(total)`, sizes differing by <= 1.

    The first `total % num_parts` parts get one extra element.
    """
    base, extra = divmod(total, num_parts)
    start = part * base + min(part, extra)
    return range(start, start + base + (1 if part < extra else 0))


def aligned_range(total: int, num_parts: int, part: int, align: int) -> range:
    """`balanced_range` over blocks of `align` elements (the last block may be short): every
    range starts on a block boundary and ends on one or at `total` (a quantized format's groups
    of columns stay whole on each rank)."""
    blocks = balanced_range(-(-total // align), num_parts, part)
    return range(min(blocks.start * align, total), min(blocks.stop * align, total))


@dataclass(slots=True, frozen=True)
class HeadShard:
    """The attention heads one rank computes.

    Query heads `q_heads` (global indices) use local KV heads `kv_heads` (global indices); local
    query head i belongs to local KV head `i // (len(q_heads) // len(kv_heads))`.
    """

    q_heads: range
    kv_heads: range

    @property
    def num_q_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def shard_heads(num_q_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Choose rank `rank`'s heads.

    world_size <= num_kv_heads: KV heads are split as evenly as whole heads allow and each rank takes
    the query heads of its KV groups (9 q / 3 kv at TP=2: rank 0 gets 6 q + 2 kv, rank 1 3 q + 1 kv).
    world_size > num_kv_heads: each rank holds one (replicated) KV head and a share of its group's
    query heads; every rank must get at least one query head.
    """
    if num_q_heads % num_kv_heads:
        raise UnsupportedModel(f"{num_q_heads} query heads do not form groups over {num_kv_heads} KV heads")
    group_size = num_q_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv = balanced_range(num_kv_heads, world_size, rank)
        return HeadShard(range(kv.start * group_size, kv.stop * group_size), kv)
    kv_head = rank * num_kv_heads // world_size
    sharing = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    q_in_group = balanced_range(group_size, len(sharing), sharing.index(rank))
    if not q_in_group:
        raise UnsupportedModel(
            f"TP={world_size} leaves rank {rank} without a query head "
            f"({num_q_heads} query heads, {num_kv_heads} KV heads)"
        )
    first_q = kv_head * group_size
    return HeadShard(
        range(first_q + q_in_group.start, first_q + q_in_group.stop), range(kv_head, kv_head + 1)
    )
