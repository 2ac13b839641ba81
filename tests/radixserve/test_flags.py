"""Every setting of every program, from its one declaration: in `--help` with its default and
its variable, settable from `RADIXSERVE_*`, and the command line wins over the environment."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from gateway_service.config import PROGRAM as GATEWAY
from procs import ROOT
from radixserve import launcher_config
from radixserve.flags import MAX_SECONDS, Flag, flags_of, show
from radixserve.health_probe import PROGRAM as PROBE
from router_service.config import PROGRAM as ROUTER
from worker_service.config import PROGRAM as WORKER

# name -> (config class, parse(argv, env), the words before the flags)
PROGRAMS: dict[str, tuple[type, Callable[..., Any], list[str]]] = {
    "gateway": (GATEWAY.config, GATEWAY.parse, []),
    "router": (ROUTER.config, ROUTER.parse, []),
    "worker": (WORKER.config, WORKER.parse, []),
    "health_probe": (PROBE.config, PROBE.parse, []),
    "radixserve up": (launcher_config.UpConfig, launcher_config.config_from_args, ["up"]),
}
# Values that other settings need to be valid while one is changed (TLS pieces go together,
# a rank must be below the world size, the probe needs an address).
BASE_ENV = {
    "RADIXSERVE_TLS_CERT": "cert.pem", "RADIXSERVE_TLS_KEY": "key.pem",
    "RADIXSERVE_TLS_CA": "ca.pem", "RADIXSERVE_WORLD_SIZE": "100",
    "RADIXSERVE_ADDRESS": "127.0.0.1:1",
}


def _value(config: Any, flag: Flag) -> Any:
    for name in flag.path:
        config = getattr(config, name)
    return config


def _two_values(flag: Flag) -> tuple[str, str]:
    """Two texts, neither the default, that the setting accepts: for the env and the flag."""
    declared = flag.setting
    default = flag.shown_default
    if declared.choices is not None:
        texts = [show(c) for c in declared.choices if show(c).upper() != default.upper()]
        return texts[0], texts[-1] if len(texts) > 1 else texts[0]
    unset = default == "unset"
    kind = type(flag.convert("1" if unset else default))  # an unset number's kind from its converter
    if kind in (int, float):
        low = max(0 if unset else float(default), declared.min or 0, declared.above or 0)
        first, second = low + 1, low + 2
        if declared.max is not None:
            first, second = declared.max - 2, declared.max - 1
            if kind is float:  # a fraction's range may be narrower than 2: two points inside it
                floor = declared.min or 0
                first, second = floor + (declared.max - floor) / 2, floor + 3 * (declared.max - floor) / 4
        return (str(int(first)), str(int(second))) if kind is int else (f"{first}", f"{second}")
    if kind is tuple:
        return "a:1,b:2", "c:3"
    if flag.name == "router-dns":  # a host:port, checked as one
        return "routers-env:1", "routers-flag:2"
    return "from-env", "from-flag"


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_flag_is_in_help_with_its_default_and_variable(program, capsys, monkeypatch):
    cls, parse, words = PROGRAMS[program]
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: nothing wrapped mid-word
    with pytest.raises(SystemExit):
        parse([*words, "--help"], {})
    text = " ".join(capsys.readouterr().out.split())
    declared = list(flags_of(cls))
    assert declared
    for flag in declared:
        names = ", else ".join([flag.env, *([flag.setting.also_env] if flag.setting.also_env else [])])
        assert f"--{flag.name} " in text, flag.name
        assert f"(env {names}; default: {flag.shown_default})" in text, flag.name


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_flag_is_settable_from_its_variable_and_the_flag_wins(program):
    cls, parse, words = PROGRAMS[program]
    for flag in flags_of(cls):
        base = {k: v for k, v in BASE_ENV.items() if k != flag.env}
        if flag.is_bool:
            assert _value(parse(words, base | {flag.env: "1"}), flag) is True
            assert _value(parse([*words, f"--no-{flag.name}"], base | {flag.env: "1"}), flag) is False
            continue
        from_env, from_flag = _two_values(flag)
        expected_env, expected_flag = flag.convert(from_env), flag.convert(from_flag)
        assert _value(parse(words, base | {flag.env: from_env}), flag) == expected_env, flag.name
        config = parse([*words, f"--{flag.name}", from_flag], base | {flag.env: from_env})
        assert _value(config, flag) == expected_flag, flag.name


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_number_that_is_not_finite_or_a_duration_past_what_grpc_can_wait_is_refused(program, capsys):
    """inf and nan name their flag; so does a duration past `MAX_SECONDS` (a gRPC deadline of
    1e10 s or more overflows into one already passed: "wait forever" would fail every call)."""
    cls, parse, words = PROGRAMS[program]
    numbers = [flag for flag in flags_of(cls) if flag.convert is float]
    durations = [flag for flag in numbers if flag.name.endswith("-s")]
    assert numbers
    for flag in numbers:
        for text in ("inf", "nan", *(["1e10"] if flag in durations else [])):
            with pytest.raises(SystemExit):
                parse([*words, f"--{flag.name}", text], BASE_ENV)
            assert f"--{flag.name} must be" in capsys.readouterr().err, (flag.name, text)
    for flag in durations:  # the largest allowed still parses
        assert _value(parse([*words, f"--{flag.name}", str(MAX_SECONDS)], BASE_ENV), flag) == MAX_SECONDS


# The flags reference: one `## `heading`` per program, its table listing every declared flag.
FLAGS_PAGE = ROOT / "docs" / "flags.md"
REFERENCE_SECTIONS = {"gateway": "python -m gateway_service", "router": "python -m router_service",
                      "worker": "python -m worker_service", "radixserve up": "radixserve up",
                      "health_probe": "python -m radixserve.health_probe"}


@pytest.mark.parametrize("program", REFERENCE_SECTIONS)
def test_flags_reference_lists_every_declared_flag_once_and_no_other(program):
    page = FLAGS_PAGE.read_text()
    heading = f"\n## `{REFERENCE_SECTIONS[program]}`\n"
    assert page.count(heading) == 1, heading
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `--")]
    assert table, "no flag table"
    listed = [name for line in table for name in re.findall(r"`--([a-z0-9-]+)`", line.split("|")[1])]
    mentioned = set(re.findall(r"`--([a-z0-9-]+)`", "\n".join(table)))
    declared = {flag.name for flag in flags_of(PROGRAMS[program][0])}
    assert set(listed) == declared
    assert len(listed) == len(declared), "a flag listed in two rows"
    assert mentioned <= declared, "a row names a flag the program does not have"


def test_every_program_with_declared_flags_has_a_reference_section():
    assert set(REFERENCE_SECTIONS) == set(PROGRAMS)
