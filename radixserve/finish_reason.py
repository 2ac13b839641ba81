"""The finish reason in words ("stop", "length", "cancelled"): the one mapping from the
`radixserve.v1.FinishReason` enum, for the HTTP API, the metrics' labels and the Python client.

The words are the enum's own names without their prefix, so a reason added to the proto gets its
word without a second list to keep in step.
"""

from __future__ import annotations

from radixserve.v1 import generation_pb2

_PREFIX = "FINISH_REASON_"


def finish_reason_text(value: int) -> str | None:
    """The word for `value`; None for FINISH_REASON_UNSPECIFIED (the request still runs)."""
    if value == generation_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return generation_pb2.FinishReason.Name(value).removeprefix(_PREFIX).lower()
