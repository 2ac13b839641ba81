"""Several choices of one request (`n`): each its own request (run concurrently by
choice_streams.ChoiceStreams), seeded apart.

All choices of a prompt carry the same token ids, so the gateway sends them to the same router
(prompt affinity) and the router's radix cache computes the prompt once: the first choice to
prefill writes the pages, the others match them (or wait for them while they are written).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.sampling import SEED_MASK
from radixserve.v1 import generation_pb2

GenerateRequest = generation_pb2.GenerateRequest


def with_choice_seeds(inputs: Sequence[GenerateRequest], n: int) -> list[GenerateRequest]:
    """Each input repeated `n` times, in order; choice j of a seeded request samples with
    seed + j, so that choices differ from each other yet the response is reproducible."""
    out = []
    for request in inputs:
        seeded = request.sampling.HasField("seed")
        for j in range(n):
            if not seeded or j == 0:
                out.append(request)
            else:
                choice = GenerateRequest()
                choice.CopyFrom(request)
                choice.sampling.seed = (request.sampling.seed + j) & SEED_MASK
                out.append(choice)
    return out
