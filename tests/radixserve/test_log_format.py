"""A text log line is one line whatever a caller sent, and its `key=value` pairs read back as
they were given; the JSON format carries the same fields."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from radixserve.log_format import JsonFormatter, TextFormatter

# A request's `user` (any Unicode, from the caller) that tries to forge an access-log line.
FORGED = "alice\nINFO radixserve.access: request FAKE ok"
EXTRA = {"user": FORGED, "route": "/v1/completions", "status": "ok", "ttft_s": None, "output_tokens": 3,
         "quoted": 'say "hi"', "pair": "a=b", "who": "josé", "empty": ""}
# key=value pairs: a bare value, or a JSON string.
PAIR = re.compile(r' (\w+)=("(?:[^"\\]|\\.)*"|[^ ]*)')


@pytest.fixture()
def capture() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = logging.getLogger("radixserve.test_log_format")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield log, out, handler
    finally:
        log.removeHandler(handler)


def test_a_callers_line_breaks_cannot_forge_a_line_and_the_pairs_read_back(capture) -> None:
    log, out, handler = capture
    handler.setFormatter(TextFormatter())
    log.info("request %s %s", "id-1", "msg with\nbreak and \x1b[31mescape", extra=EXTRA)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert "request id-1 msg with\\nbreak and \\u001b[31mescape" in lines[0]
    pairs = {key: json.loads(value) if value.startswith('"') else value for key, value in PAIR.findall(lines[0])}
    assert pairs == {**{key: str(value) for key, value in EXTRA.items()}, "user": FORGED}
    assert "status=ok ttft_s=None output_tokens=3" in lines[0]  # plain values stay bare


def test_a_traceback_still_follows_its_message(capture) -> None:
    log, out, handler = capture
    handler.setFormatter(TextFormatter())
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed for %s", "x\ny", extra={"route": "/r"})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("failed for x\\ny route=/r")
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"


def test_json_lines_carry_the_same_fields(capture) -> None:
    log, out, handler = capture
    handler.setFormatter(JsonFormatter())
    log.info("request %s", "id-1", extra=EXTRA)
    entry = json.loads(out.getvalue())
    assert entry["message"] == "request id-1" and {key: entry[key] for key in EXTRA} == EXTRA
