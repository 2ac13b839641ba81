"""How every service writes its log: plain text lines or one JSON object per line
(`--log-format`, declared once in `shared_flags.LOG_FORMAT`).

A record's `extra=` fields that name no standard attribute (an access log line's `route`,
`status`, token counts...) become keys of the JSON object, and `key=value` pairs after the
message in text, so a line reads the same way in both formats.

A text line is one line whatever a caller sent: a message's line breaks and other control
characters are escaped (`\n`), and an extra value with a space, a quote, `=` or such a
character is written as a JSON string. So a request's `user` of "a\nINFO ... request FAKE ok"
cannot forge an access-log line, and `key=value` pairs split where they should. A traceback
still follows its message on lines of its own.
"""

from __future__ import annotations

import json
import logging
import re
import sys

TEXT, JSON = "text", "json"
LOG_FORMATS = (TEXT, JSON)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


# A value written bare in `key=value`: nothing that would end it or the line.
_BARE = re.compile(r'[^\s"=\x00-\x1f\x7f]*')
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\u2028\u2029]")


def _escaped(match: re.Match) -> str:
    return json.dumps(match.group())[1:-1]


def _value(value: object) -> str:
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = _CONTROL.sub(_escaped, super().formatMessage(record))
        extra = extra_fields(record)
        return line + "".join(f" {k}={_value(v)}" for k, v in extra.items()) if extra else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **extra_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str, log_format: str = TEXT) -> None:
    """Configure the root logger once per process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == JSON else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
