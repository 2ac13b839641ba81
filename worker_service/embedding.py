"""Embedding requests on a rank: a prompt pooled into one vector instead of sampled from.

The router sends an embedding request like a prompt whose last chunk samples (`NewRequest.pooling`
set). Every rank computes its K/V as usual; rank 0 folds each chunk's final hidden states (after
the model's last norm, see `CausalLM.final_hidden`) into the request's state and, on the chunk
that completes the prompt, answers with the vector instead of a token:
- LAST: the hidden state of the prompt's last position (a cached prefix is fine: only the last
  position is needed, and the router always computes it);
- MEAN: the mean over every prompt position, so none may come from the cache
  (`cached_token_ids` must be empty);
then, with `normalize`, scaled to unit L2 norm. The vector is float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from radixserve.v1 import worker_pb2
from worker_service.request_state import RequestState

_MODES = (worker_pb2.POOLING_MODE_NONE, worker_pb2.POOLING_MODE_LAST, worker_pb2.POOLING_MODE_MEAN)


def pooling_problem(new: worker_pb2.NewRequest) -> str | None:
    """What makes a new request's pooling unusable (None: fine, or not an embedding request)."""
    mode = new.pooling.mode
    if mode not in _MODES:
        return f"unknown pooling mode {mode}"
    if mode == worker_pb2.POOLING_MODE_MEAN and new.cached_token_ids:
        return "mean pooling needs every prompt position computed, but cached_token_ids is not empty"
    if mode != worker_pb2.POOLING_MODE_NONE and new.constraint.WhichOneof("kind") is not None:
        return "an embedding request cannot be constrained"
    return None


def finish_embedding(state: RequestState, pooled: torch.Tensor | None, num_tokens: int,
                     last: bool) -> list[float] | None:
    """Fold one chunk's pooled row (`StepOutput.pooled`) into `state`; on the `last` chunk,
    the finished vector (None before)."""
    if state.pooling == worker_pb2.POOLING_MODE_MEAN:
        if pooled is None:
            raise RuntimeError(f"no pooled row for {state.request_id}'s chunk of {num_tokens} tokens")
        state.pooled_sum = pooled if state.pooled_sum is None else state.pooled_sum + pooled
        if not last:
            return None
        vector = state.pooled_sum / state.num_written
    elif not last:
        return None
    elif pooled is None:
        raise RuntimeError(f"no final hidden state for {state.request_id}")
    else:
        vector = pooled
    if state.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
