"""A request state's int32 copy of its token ids stays equal to the list through every change."""

from __future__ import annotations

import random
from array import array

from radixserve.sampling import SamplingParams
from worker_service.request_state import RequestState


def test_token_array_follows_appends_drafts_restores_and_truncation() -> None:
    rng = random.Random(0)
    state = RequestState("r", SamplingParams(), num_prompt_tokens=5, token_ids=[1, 2, 3])
    assert state.token_array == array("i", [1, 2, 3])
    page = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.5:  # an entry, possibly starting inside the last drafts
            start = len(state.token_ids) - rng.randrange(0, state.num_unverified + 1)
            tokens = [rng.randrange(49152) for _ in range(rng.randrange(1, 6))]
            mark = state.append_entry(start, tokens, [page], num_drafts=rng.randrange(0, len(tokens)))
            page += 1
            if rng.random() < 0.2:  # the step failed: undone
                state.restore(mark)
        elif action < 0.6 and len(state.token_ids) > 3:
            state.truncate(rng.randrange(3, len(state.token_ids)), len(state.page_table))
            state.num_unverified = 0
        else:
            state.append([rng.randrange(49152) for _ in range(rng.randrange(0, 4))], ())
        assert state.token_array == array("i", state.token_ids)
