"""How one step's decode tokens attend, decided once per step from their page tables alone.

Shared prefixes are found where they are visible to a worker: the router's radix cache puts a
prefix that several requests share into the same physical pages, so equal leading page ids in two
decode entries' page tables ARE a shared prefix (same tokens at the same positions, K/V written
once). Only whole pages strictly before the page of an entry's newest token count: those are
complete and are not written in this step.

The plan splits each decode entry's keys into at most two disjoint parts:
- a shared prefix (`SharedPrefix`): the first `len(pages)` pages, common to every row of a group,
  attended ONCE for the whole group (all its query heads against the prefix's K/V);
- its own suffix (the pages after the prefix up to its newest token), attended in length buckets
  (`SuffixBucket`): rows with similar suffix lengths are padded only to their bucket's longest.
The two results are merged exactly by log-sum-exp (`kernels.merge_by_lse`).

Grouping is greedy over the rows sorted by page table: a row joins the current group while the
pages saved by sharing (group size - 1) x common pages do not shrink; otherwise it starts a new
group. Which physical ids the pages have does not change any result, only which K/V rows are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention.masks import additive_mask

# A row joins a length bucket while its suffix is at most this factor longer than the bucket's
# shortest: padding costs at most this fraction of extra reads, and each bucket costs one kernel call.
BUCKET_PADDING_FACTOR = 1.25


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows `rows` ([G]) share positions 0 .. len(pages) * page_size - 1, held in `pages` ([P])."""

    rows: torch.Tensor
    pages: torch.Tensor


@dataclass(slots=True)
class SuffixBucket:
    """Decode rows `rows` ([b]; None: every decode row, in order) attend to their own `pages` [b, P].

    `mask` ([b, 1, P * page_size], additive float32: it broadcasts over the head-major scores
    `[kv_heads, b, group, keys]`) hides padding past each row's suffix; None when every row fills
    its pages exactly.
    """

    rows: torch.Tensor | None
    pages: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodePlan:
    num_rows: int
    buckets: list[SuffixBucket]
    prefixes: list[SharedPrefix]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common leading run of `a` and `b`."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:  # the common case (same prefix pages) in one C-level comparison
        return limit
    n = 0
    while a[n] == b[n]:
        n += 1
    return n


def shared_prefixes(tables: list[list[int]], context_lens: list[int], page_size: int) -> list[tuple[list[int], int]]:
    """Groups of rows and the number of leading pages each group shares (groups of two or more)."""
    # Only complete pages before the newest token's page may be shared (see the module doc).
    shareable = [table[: (length - 1) // page_size] for table, length in zip(tables, context_lens)]
    order = sorted(range(len(tables)), key=shareable.__getitem__)
    groups: list[tuple[list[int], int]] = []
    members: list[int] = []
    common: list[int] = []
    for row in order:
        if members:
            shared = common_prefix_len(common, shareable[row])
            if shared and len(members) * shared >= (len(members) - 1) * len(common):
                members.append(row)
                common = common[:shared]
                continue
            if len(members) > 1:
                groups.append((members, len(common)))
        members, common = [row], shareable[row]
    if len(members) > 1 and common:
        groups.append((members, len(common)))
    return groups


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Rows grouped by similar length (each bucket sorted by length; buckets cover every row)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    for row in order:
        if buckets and lengths[row] <= BUCKET_PADDING_FACTOR * lengths[buckets[-1][0]]:
            buckets[-1].append(row)
        else:
            buckets.append([row])
    return buckets


def plan_decode(
    tables: list[list[int]], context_lens: list[int], page_size: int, device: torch.device,
) -> DecodePlan:
    """The decode plan for rows with page tables `tables` and contexts `context_lens` (newest token included)."""
    num_rows = len(tables)
    prefix_pages = [0] * num_rows
    prefixes: list[SharedPrefix] = []
    for rows, num_pages in shared_prefixes(tables, context_lens, page_size):
        for row in rows:
            prefix_pages[row] = num_pages
        prefixes.append(SharedPrefix(torch.tensor(rows, device=device),
                                     torch.tensor(tables[rows[0]][:num_pages], device=device)))

    suffix_lens = [length - pages * page_size for length, pages in zip(context_lens, prefix_pages)]
    buckets: list[SuffixBucket] = []
    for rows in length_buckets(suffix_lens):
        num_pages = (suffix_lens[rows[-1]] + page_size - 1) // page_size
        pages = [(tables[r][prefix_pages[r]:] + [0] * num_pages)[:num_pages] for r in rows]
        lens = torch.tensor([suffix_lens[r] for r in rows])
        mask = None
        if bool((lens != num_pages * page_size).any()):  # padding pages point at page 0: masked out
            allowed = torch.arange(num_pages * page_size) < lens.unsqueeze(1)
            mask = additive_mask(allowed.view(len(rows), 1, -1).to(device), torch.float32)
        in_order = len(rows) == num_rows and rows == sorted(rows)
        buckets.append(SuffixBucket(None if in_order else torch.tensor(rows, device=device),
                                    torch.tensor(pages, device=device), mask))
    return DecodePlan(num_rows, buckets, prefixes)
