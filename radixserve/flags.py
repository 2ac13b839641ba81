"""Settings declared once, read from `--flag` or a `RADIXSERVE_*` environment variable.

A program's configuration is a frozen dataclass whose fields are declared with `setting(...)`:
default, help, and the range or choices a value must fall in; the field's type annotation says
how text becomes a value (`int`, `float`, `str`, `bool` for `--x/--no-x`, an `Enum`, or
`tuple[str, ...]` for a comma-separated list). From that one declaration come the flag
(`max_batch_tokens` is `--max-batch-tokens`), its variable (`RADIXSERVE_MAX_BATCH_TOKENS`),
its `--help` line with the default, and its validation: `check(self)` in the config's
`__post_init__`, so a config built in code is held to the same ranges as one built from flags.
The command line wins over the environment, the environment over the default. A config can
hold another (`nested`), whose settings become flags of the same program.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import operator
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "RADIXSERVE_"
MAX_PORT = 65535
# The longest duration a `...-s` setting may give (see `_check_number`).
MAX_SECONDS = 1e7
_SETTING = "radixserve.setting"
_NESTED = "radixserve.nested"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_KEEP: Any = object()


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's declaration. Calling it makes the dataclass field (with another default or
    help where a program needs one), so a setting shared by several programs is declared once.

    `min`/`max` bound a number (for a list: how many items), `above` from below exclusively
    (a timeout: `above=0`); `choices` are the allowed values;
    `parse` replaces the type's own conversion of text (`str.upper` for log levels); `also_env`
    is a variable read when the `RADIXSERVE_*` one is unset (`RANK` for `--rank`). A callable
    `default` is called when the config is built (a default that depends on the machine).
    """

    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    above: float | None = None
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    also_env: str | None = None

    def __call__(self, default: Any = _KEEP, help: str | None = None) -> Any:
        declared = dataclasses.replace(
            self, default=self.default if default is _KEEP else default, help=help or self.help
        )
        if _is_factory(declared.default):
            return dataclasses.field(default_factory=declared.default, metadata={_SETTING: declared})
        return dataclasses.field(default=declared.default, metadata={_SETTING: declared})


def setting(default: Any, help: str, **bounds: Any) -> Any:
    """A config field declared as a setting (see `Setting` for `bounds`)."""
    return Setting(default, help, **bounds)()


def nested(cls: type, skip: Sequence[str] = ()) -> Any:
    """A config field holding another config; its settings but `skip` become flags too."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: tuple(skip)})


@dataclass(frozen=True, slots=True)
class Flag:
    """A declared setting as a program sees it: where it lives in the config and how it reads."""

    name: str  # the flag without dashes: `max-batch-tokens`
    path: tuple[str, ...]  # attribute names from the outer config: ("security", "tls_cert")
    setting: Setting
    convert: Callable[[str], Any]
    is_bool: bool

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def shown_default(self) -> str:
        """The default as `--help` and docs/flags.md show it."""
        return show(_default_value(self.setting.default))


def env_name(flag: str) -> str:
    """`page-size` -> `RADIXSERVE_PAGE_SIZE`."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, enum.Enum):
        return str(value.value)
    return "unset" if value is None else str(value)


def flags_of(cls: type, skip: Sequence[str] = (), path: tuple[str, ...] = ()) -> Iterator[Flag]:
    """Every setting of config class `cls`, nested configs included, in declaration order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if _NESTED in field.metadata:
            yield from flags_of(hints[field.name], field.metadata[_NESTED], (*path, field.name))
        elif _SETTING in field.metadata:
            declared = field.metadata[_SETTING]
            kind = _plain_type(hints[field.name])
            if isinstance(kind, enum.EnumMeta) and declared.choices is None:
                declared = dataclasses.replace(declared, choices=tuple(kind))
            yield Flag(field.name.replace("_", "-"), (*path, field.name), declared,
                       declared.parse or _converter(kind), kind is bool)


def check(config: Any) -> None:
    """Raise ValueError naming the flag when a field of `config` is outside its declaration."""
    for flag in flags_of(type(config)):
        if len(flag.path) > 1:
            continue  # a nested config checks itself
        value = getattr(config, flag.path[0])
        bound = flag.setting
        if bound.choices is not None and value is not None and value not in bound.choices:
            raise ValueError(f"--{flag.name} must be one of "
                             f"{', '.join(map(show, bound.choices))}, got {show(value)!r}")
        if value is None:
            continue  # unset: its consumer's own default, decided where the setting is used
        if isinstance(value, float):
            _check_number(flag.name, value)
        size, (verb, what) = ((len(value), ("have", " items")) if isinstance(value, tuple)
                              else (value, ("be", "")))
        for limit, relation, holds in ((bound.min, ">=", operator.ge), (bound.max, "<=", operator.le),
                                       (bound.above, ">", operator.gt)):
            if limit is not None and not holds(size, limit):
                raise ValueError(f"--{flag.name} must {verb} {relation} {limit:g}{what}, "
                                 f"got {show(value)}")


def _check_number(name: str, value: float) -> None:
    """A number must be finite, and a duration (a flag named `...-s`) at most `MAX_SECONDS`:
    past ~1e10 s a gRPC deadline overflows into one already passed, so "wait forever" would
    fail every call at once."""
    if not math.isfinite(value):
        raise ValueError(f"--{name} must be a finite number, got {value}")
    if name.endswith("-s") and value > MAX_SECONDS:
        raise ValueError(f"--{name} must be <= {MAX_SECONDS:g} seconds (about 115 days), got {value:g}")


def split_address(text: str, flag: str) -> tuple[str, int]:
    """`host:port` (a bracketed IPv6 host allowed) -> (host, port); ValueError naming `--flag`
    otherwise (no port, a port outside 1-65535, a scheme or path such as `http://`)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or "/" in host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise ValueError(f"--{flag} must be host:port, got {text!r}")
    return host.strip("[]"), int(port)


def check_addresses(flag: str, addresses: Sequence[str], distinct: bool = False) -> None:
    """Each of `addresses` (a list setting) is host:port; with `distinct`, none twice."""
    for address in addresses:
        split_address(address, flag)
    if distinct and len(set(addresses)) < len(addresses):
        twice = next(address for address in addresses if addresses.count(address) > 1)
        raise ValueError(f"--{flag} names {twice} more than once")


def add_settings(
    parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str] | None = None
) -> None:
    """Add a flag for every setting of `cls` (its default from the environment when set)."""
    for flag in flags_of(cls):
        add_flag(parser, flag.name, type=bool if flag.is_bool else flag.convert,
                 default=_default_value(flag.setting.default), help=flag.setting.help, env=env,
                 also_env=flag.setting.also_env, choices=flag.setting.choices)


def parse_into(cls: type, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Any:
    """Parse `argv` with `parser` (which has `cls`'s settings) and build the config; a bad
    value exits with a usage error that names its flag."""
    args = parser.parse_args(argv)
    try:
        return _build(cls, args)
    except ValueError as exc:
        parser.error(str(exc))


@dataclass(frozen=True, slots=True)
class Program:
    """A command whose flags are the settings of one config class."""

    config: type
    prog: str
    description: str

    def parse(self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Any:
        """The config from `argv` (default: `sys.argv`) over `env` (default: `os.environ`)."""
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        add_settings(parser, self.config, env)
        return parse_into(self.config, parser, argv)


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str,
    choices: Sequence[Any] | None = None,
    env: Mapping[str, str] | None = None,
    also_env: str | None = None,
) -> None:
    """Add `--flag` whose default comes from `RADIXSERVE_FLAG` (else `also_env`) when set.

    `type=bool` makes a `--flag / --no-flag` pair; `type=list` takes a comma-separated list.
    """
    environ = os.environ if env is None else env
    names = [env_name(flag), *([also_env] if also_env else [])]
    convert = _converter(type)
    value = default
    for name in names:
        if name in environ:
            try:
                value = convert(environ[name])
            except ValueError as exc:
                parser.error(f"{name}={environ[name]!r}: {exc}")
            break
    text = f"{help} (env {', else '.join(names)}; default: {show(default)})".replace("%", "%%")
    dest = flag.replace("-", "_")
    if type is bool:
        parser.add_argument(f"--{flag}", dest=dest, action=argparse.BooleanOptionalAction,
                            default=value, help=text)
    else:
        metavar = "{" + ",".join(map(show, choices)) + "}" if choices else None
        parser.add_argument(f"--{flag}", dest=dest, type=convert, default=value, help=text,
                            metavar=metavar)


def _build(cls: type, args: argparse.Namespace) -> Any:
    """`cls` from parsed flags (each named after its field); its `__post_init__` validates it."""
    hints = typing.get_type_hints(cls)
    return cls(**{field.name: _build(hints[field.name], args) if _NESTED in field.metadata
                  else getattr(args, field.name)
                  for field in dataclasses.fields(cls)
                  if _NESTED in field.metadata or hasattr(args, field.name)})


def _is_factory(default: Any) -> bool:
    return callable(default) and not isinstance(default, type)


def _default_value(default: Any) -> Any:
    return default() if _is_factory(default) else default


def _plain_type(hint: Any) -> Any:
    """`str | None` -> `str`; other hints unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        return inner
    return hint


def _converter(kind: Any) -> Callable[[str], Any]:
    """How text becomes a value of the annotated type."""
    if kind is bool:
        return _parse_bool
    if kind is list or typing.get_origin(kind) is tuple:
        return _split_list
    return kind


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError(f"not a boolean: {text!r} (use one of {sorted(_TRUE | _FALSE - {''})})")


def _split_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())
