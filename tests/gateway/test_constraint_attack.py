"""One client's slow constraints cannot switch off structured output for another (issue 36).

A real gateway process with two API tokens: the attacker sends distinct ~96 KB regexes whose
compiles run for many seconds, four at a time, for a while; the victim's valid `guided_choice`
and `json_schema` requests, sent before, during and after, are each served within 2 s, those
served before the attack are served again after it, and the gateway's RSS grows < 200 MB.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from gateway.gateway_process import gateway_process, rss_mb

pytestmark = pytest.mark.timeout(240)
MODEL = "fake-smollm2"
ATTACKER, VICTIM = "attacker-token-0123456789", "victim-token-0123456789"
NUM_ATTACKERS = 4
ATTACK_S = 10.0
SERVED_WITHIN_S = 2.0
MAX_RSS_GROWTH_MB = 200
# Starred groups: llguidance's lexer construction runs for seconds on them whatever its fuel.
GROUPS = "".join(f"(a|b{i % 10})*" for i in range(13_700))  # ~96 KB
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
CALL_TIMEOUT_S = 60.0


def completion(token: str, **fields) -> httpx.Response:
    return httpx.post(f"{completion.url}/v1/completions", headers={"Authorization": f"Bearer {token}"},
                      json={"model": MODEL, "prompt": "pick", "max_tokens": 3, **fields}, timeout=CALL_TIMEOUT_S)


def victim_round(tag: str) -> list[tuple[str, int, float]]:
    """(what, status, seconds) of a guided_choice and a json_schema request; `tag` makes them
    new constraints (compiled, not cached) unless it repeats."""
    results = []
    for what, fields in [
        ("choice", {"guided_choice": [f"yes-{tag}", f"no-{tag}"]}),
        ("schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {**SCHEMA, "title": tag}}}}),
    ]:
        start = time.monotonic()
        reply = completion(VICTIM, **fields)
        results.append((f"{what} {tag}", reply.status_code, time.monotonic() - start))
    return results


def test_slow_constraints_from_one_client_do_not_starve_another(smollm2_dir) -> None:
    with gateway_process(smollm2_dir, "--api-tokens", f"{ATTACKER},{VICTIM}") as gateway:
        gateway.router.script([11, 12, 2])
        completion.url = gateway.http_url
        served = victim_round("before")
        rss_before = rss_mb(gateway.pid)
        attack_statuses: list[int] = []
        stop_at = time.monotonic() + ATTACK_S

        def attack(index: int) -> None:
            seed = 0
            while time.monotonic() < stop_at:
                seed += 1
                regex = f"(a|c{index * 1000 + seed})*" + GROUPS
                attack_statuses.append(completion(ATTACKER, guided_regex=regex).status_code)

        attackers = [threading.Thread(target=attack, args=(i,)) for i in range(NUM_ATTACKERS)]
        for thread in attackers:
            thread.start()
        try:
            time.sleep(1.0)  # the attack is under way
            during = 0
            while time.monotonic() < stop_at:
                served += victim_round(f"during-{during}")
                during += 1
                time.sleep(0.5)
        finally:
            for thread in attackers:
                thread.join(timeout=CALL_TIMEOUT_S)
        served += victim_round("before") + victim_round("after")
        growth = rss_mb(gateway.pid) - rss_before
    print("attacker statuses:", {s: attack_statuses.count(s) for s in set(attack_statuses)})
    print("victim (what, status, s):", [(w, c, round(t, 3)) for w, c, t in served])
    print(f"gateway RSS growth {growth:.1f} MB")
    assert attack_statuses and set(attack_statuses) <= {400, 429}
    assert 400 in attack_statuses  # some compiles really ran and were stopped
    assert during >= 2
    for what, status, seconds in served:
        assert status == 200, what
        assert seconds < SERVED_WITHIN_S, (what, seconds)
    assert growth < MAX_RSS_GROWTH_MB
