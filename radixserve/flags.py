"""Command-line flags that can also come from `RADIXSERVE_*` environment variables.

Every service builds its frozen config from one parser made with `add_flag`, so that
`--page-size 16` and `RADIXSERVE_PAGE_SIZE=16` mean the same thing. The command line wins
over the environment, the environment over the default; `--help` shows all three.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

ENV_PREFIX = "RADIXSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """`page-size` -> `RADIXSERVE_PAGE_SIZE`."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use one of {sorted(_TRUE | _FALSE - {''})})")


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str,
    choices: list[Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Add `--flag` whose default comes from `RADIXSERVE_FLAG` when that variable is set.

    `type=bool` makes a `--flag / --no-flag` pair. `type=list` takes a comma-separated list.
    """
    environ = os.environ if env is None else env
    name = env_name(flag)
    dest = flag.replace("-", "_")
    convert: Callable[[str], Any]
    if type is bool:
        convert = parse_bool
    elif type is list:
        convert = _split_list
    else:
        convert = type
    value = default
    if name in environ:
        try:
            value = convert(environ[name])
        except ValueError as exc:
            parser.error(f"{name}={environ[name]!r}: {exc}")
    shown = ",".join(map(str, default)) if isinstance(default, list) else default
    text = f"{help} (env {name}; default: {shown})"
    if type is bool:
        parser.add_argument(
            f"--{flag}", dest=dest, action=argparse.BooleanOptionalAction, default=value, help=text
        )
    else:
        parser.add_argument(
            f"--{flag}", dest=dest, type=convert, default=value, help=text, choices=choices
        )


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]
