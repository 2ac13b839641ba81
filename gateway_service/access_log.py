"""One line per request, whichever API it came by and however it ended.

The line carries the request id (echoed to the caller as `X-Request-Id`), the route (the gRPC
method or the HTTP path), the status (the gRPC status name, as in `requests_total`), the
caller's `user` when given, prompt / cached / output tokens, the time to the first token and
the total time. With `--log-format json` each becomes a key of the line's JSON object.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from gateway_service.caller import Caller

log = logging.getLogger("radixserve.access")
# Seconds are logged to the millisecond.
DIGITS = 3


@dataclass(slots=True)
class RequestRecord:
    route: str
    status: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0


def log_request(caller: Caller, record: RequestRecord) -> None:
    fields = asdict(record)
    fields["ttft_s"] = None if record.ttft_s is None else round(record.ttft_s, DIGITS)
    fields["total_s"] = round(record.total_s, DIGITS)
    extra = {"request_id": caller.request_id, **fields}
    if caller.user:
        extra["user"] = caller.user
    log.info("request %s %s %s", caller.request_id, record.route, record.status, extra=extra)
