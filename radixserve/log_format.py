"""How every service writes its log: plain text lines or one JSON object per line
(`--log-format`, declared once in `shared_flags.LOG_FORMAT`).

A record's `extra=` fields that name no standard attribute (an access log line's `route`,
`status`, token counts...) become keys of the JSON object, and `key=value` pairs after the
message in text, so a line reads the same way in both formats.
"""

from __future__ import annotations

import json
import logging
import sys

TEXT, JSON = "text", "json"
LOG_FORMATS = (TEXT, JSON)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = extra_fields(record)
        return line + "".join(f" {k}={v}" for k, v in extra.items()) if extra else line


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
