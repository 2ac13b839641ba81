"""Rank 0's acceptance rule for speculative entries: drafts are kept while sampling agrees.

An entry with drafts computes the pending token t0 and the drafts d1..dk at consecutive
positions in one forward pass, so the logits at position j (j = 0..k) are those decoding would
see after t0, d1..dj. Each position becomes one sampler row whose sequence is exactly that
prefix, so penalties count the same tokens and a seeded row draws with the generator of the same
output step (`sampler.seed_for_step`) as non-speculative decoding would. Draft d(j+1) is accepted
when row j's draw equals it; the first row that disagrees gives the correction, and when every
draft is accepted row k gives one more token. The output is therefore token for token what
decoding one token per step produces: greedy (argmax) and seeded sampling alike, alone or in any
batch. (An unseeded row draws from the shared generator; its rejected rows only use up numbers.)
"""

from __future__ import annotations

from worker_service.request_state import RequestState
from worker_service.sampling import Sample, SampleRow


def verify_rows(state: RequestState, num_drafts: int) -> list[SampleRow]:
    """One sampler row per verified position of an entry (1 + `num_drafts` rows; 1 without).

    `state` already holds the entry's tokens, drafts last; row j sees the sequence up to the
    entry's position j. Only a row before the last copies a prefix of the sequence (there are
    at most k of them, in the few steps that verify drafts); the last row is the state's own.
    """
    tokens, params, num_prompt, history = state.token_ids, state.sampling, state.num_prompt_tokens, state.token_array
    last = SampleRow(params, tokens, num_prompt, history)
    if not num_drafts:  # every row of a step without drafts
        return [last]
    first = len(tokens) - num_drafts
    return [*(SampleRow(params, tokens[: first + j], num_prompt, history) for j in range(num_drafts)), last]


def num_accepted(drafts: list[int], samples: list[Sample]) -> int:
    """How many drafts in a row equal the draw at the position before each
    (`samples[j]` is row j's draw; there is one more sample than drafts)."""
    count = 0
    while count < len(drafts) and samples[count].token_id == drafts[count]:
        count += 1
    return count
