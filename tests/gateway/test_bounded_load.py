"""Consistent hashing with bounded loads: the first replica in rendezvous order under the bound."""

from __future__ import annotations

import random

import pytest

from gateway_service.bounded_load import capacity, choose_bounded
from gateway_service.rendezvous import affinity_key, rendezvous_order

ADDRESSES = [f"10.0.0.{i}:50052" for i in range(8)]


def test_takes_the_first_choice_while_it_is_within_the_bound() -> None:
    order = rendezvous_order(ADDRESSES, affinity_key([1, 2, 3], 64))
    assert choose_bounded(order, {}, 1.25) == order[0]
    loads = dict.fromkeys(ADDRESSES, 4)
    # 32 outstanding over 8: capacity floor(1.25 * 33 / 8) = 5, the first choice has 4 (+1).
    assert capacity(32, 8, 1.25) == 5
    assert choose_bounded(order, loads, 1.25) == order[0]
    loads[order[0]] = 6  # 34 outstanding: capacity floor(1.25 * 35 / 8) = 5
    assert choose_bounded(order, loads, 1.25) == order[1]  # full: spill to the second choice
    loads[order[1]] = 9  # 39 outstanding: capacity 6, both full
    assert choose_bounded(order, loads, 1.25) == order[2]
    assert choose_bounded(order, loads, 1.25, total_load=sum(loads.values())) == order[2]
    assert choose_bounded(order, loads, 1.25, total_load=1000) == order[0]  # a larger mean
    # Never below ceil((total + 1) / n), which the least loaded replica is always within.
    assert capacity(5, 4, 1.0) == 2 and capacity(0, 8, 1.25) == 1
    for total in range(40):
        for n in range(1, 9):
            assert capacity(total, n, 1.0) >= total // n + 1


def test_a_hot_prefix_spreads_and_the_busiest_stays_within_the_bound() -> None:
    rng = random.Random(7)
    loads = dict.fromkeys(ADDRESSES, 0)
    busiest_sum = mean_sum = 0.0
    hot = rendezvous_order(ADDRESSES, affinity_key([9] * 64, 64))
    for _ in range(2000):
        # 80% of the traffic shares one prefix; requests also finish at random.
        if rng.random() < 0.8:
            order = hot
        else:
            order = rendezvous_order(ADDRESSES, affinity_key([rng.randrange(1000)], 64))
        chosen = choose_bounded(order, loads, 1.25)
        total = sum(loads.values())
        assert loads[chosen] + 1 <= capacity(total, len(ADDRESSES), 1.25)
        loads[chosen] += 1
        busiest_sum += max(loads.values())
        mean_sum += sum(loads.values()) / len(loads)
        for address in ADDRESSES:
            if loads[address] and rng.random() < 0.1:
                loads[address] -= 1
    assert loads[hot[1]] > 0  # the second choice took the spill
    # Completions between decisions can leave a replica over the bound for a while, not on
    # average: pure affinity would put ~80% of everything on one of 8 (6.4x the mean).
    assert busiest_sum / mean_sum <= 1.3


def test_a_huge_bound_is_pure_affinity_and_bad_input_is_refused() -> None:
    order = rendezvous_order(ADDRESSES, affinity_key([5], 64))
    loads = {address: 0 for address in ADDRESSES}
    loads[order[0]] = 1000
    assert choose_bounded(order, loads, 1e9) == order[0]
    # A bound whose product with the load overflows a float (the flags refuse inf, not 1e308):
    # still pure affinity, and every replica can take the request.
    for bound in (1e308, float("inf")):
        assert choose_bounded(order, loads, bound) == order[0]
        assert capacity(1000, len(ADDRESSES), bound) == 1001
    assert choose_bounded(order, loads, 1.0) != order[0]
    with pytest.raises(ValueError):
        choose_bounded(order, loads, 0.5)
    with pytest.raises(ValueError):
        choose_bounded([], loads, 1.25)


def test_choose_ranked_is_choose_bounded_over_the_rendezvous_order_after_the_preferred() -> None:
    from gateway_service.bounded_load import choose_ranked
    from gateway_service.rendezvous import Ranking

    ranking = Ranking(ADDRESSES)
    rng = random.Random(3)
    for _ in range(300):
        key = affinity_key([rng.randrange(1000)], 64)
        loads = {address: rng.randrange(6) for address in ADDRESSES}
        order = ranking.order(key)
        assert order == rendezvous_order(ADDRESSES, key)
        weights = ranking.weights(key)
        assert choose_ranked(ranking.names, weights, loads, 1.25) == choose_bounded(order, loads, 1.25)
        preferred = rng.choice(ADDRESSES)
        expected = choose_bounded([preferred] + [a for a in order if a != preferred], loads, 1.25)
        assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=[preferred]) == expected


def test_the_preferred_replica_has_a_bound_of_its_own() -> None:
    from gateway_service.bounded_load import choose_ranked
    from gateway_service.rendezvous import Ranking

    ranking = Ranking(ADDRESSES)
    weights = ranking.weights(affinity_key([8], 64))
    order = ranking.order(affinity_key([8], 64))
    preferred = order[-1]
    loads = dict.fromkeys(ADDRESSES, 4)
    loads[preferred] = 5  # 33 outstanding: capacity 5 at 1.25, 6 at 1.5
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=[preferred]) == order[0]
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=[preferred], preferred_bound=1.5) == preferred
    loads[preferred] = 6
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=[preferred], preferred_bound=1.5) == order[0]
    loads[preferred] = 4  # a preferred bound below the bound counts as the bound
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=[preferred], preferred_bound=1.0) == preferred


def test_the_preferred_replicas_are_tried_in_their_order() -> None:
    from gateway_service.bounded_load import choose_ranked
    from gateway_service.rendezvous import Ranking

    ranking = Ranking(ADDRESSES)
    weights = ranking.weights(affinity_key([8], 64))
    order = ranking.order(affinity_key([8], 64))
    loads = dict.fromkeys(ADDRESSES, 4)  # 32 outstanding: capacity 5 at 1.25
    loads[order[-1]] = 5
    held = [order[-1], order[-2]]
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=held) == order[-2]  # the first is full
    loads[order[-2]] = 5
    assert choose_ranked(ranking.names, weights, loads, 1.25, preferred=held) == order[0]  # both are


def test_a_conversation_and_a_shared_prefix_get_their_own_bounds() -> None:
    from gateway_service.bounded_load import Bounds, choose_remembered
    from gateway_service.prefix_memory import PrefixMemory
    from gateway_service.rendezvous import Ranking

    ranking = Ranking(ADDRESSES)
    system = list(range(100, 132))  # two strides of 16
    weights = ranking.weights(affinity_key(system, 64))
    order = ranking.order(affinity_key(system, 64))
    bounds = Bounds(load=1.25, memory=1.25, session=1.5)
    memory: PrefixMemory[str] = PrefixMemory(100, stride=16, holders=2)
    loads = dict.fromkeys(ADDRESSES, 4)
    turn1 = system + list(range(16))
    assert choose_remembered(ADDRESSES, weights, loads, bounds, memory, turn1) == order[0]
    loads[order[0]] = 5  # 33 outstanding: capacity 5 at 1.25, 6 at 1.5
    # The session's next turn: its history (turn 1's prompt) ends on order[0], within 1.5.
    turn2 = turn1 + [7] * 20
    assert choose_remembered(ADDRESSES, weights, loads, bounds, memory, turn2) == order[0]
    # A new session of the same system prompt only shares it: 1.25 for order[0], so it spills.
    loads[order[0]] = 6  # 34 outstanding: capacity 5 at 1.25
    assert choose_remembered(ADDRESSES, weights, loads, bounds, memory, system + [9] * 16) == order[1]
    # Both now hold the system prompt: a third session takes the most recent holder, a fourth
    # (that one full) the other.
    loads[order[0]], loads[order[1]] = 4, 0
    assert choose_remembered(ADDRESSES, weights, loads, bounds, memory, system + [8] * 16) == order[1]
    loads[order[1]] = 6
    assert choose_remembered(ADDRESSES, weights, loads, bounds, memory, system + [6] * 16) == order[0]
    assert memory.recall_all(memory.checkpoints(system)).holders == (order[0], order[1])
    # A holder that is down (not in `loads`) is skipped; no memory is the rendezvous order.
    up = {a: n for a, n in loads.items() if a != order[1]}
    assert choose_remembered([a for a in ADDRESSES if a != order[1]], weights[[a != order[1] for a in ADDRESSES]],
                             up, bounds, memory, system + [5] * 16) != order[1]
    assert choose_remembered(ADDRESSES, weights, dict.fromkeys(ADDRESSES, 0), bounds, None, turn2) == order[0]


def test_the_gateway_needs_a_router_address_or_a_dns_name() -> None:
    from gateway_service.config import GatewayConfig

    with pytest.raises(ValueError, match="--routers or --router-dns"):
        GatewayConfig(routers=())
    assert GatewayConfig(routers=(), router_dns="routers:50052").router_dns == "routers:50052"
    # Refused when the gateway starts, not a router that is down forever.
    for routers, dns in [(("127.0.0.1",), ""), (("a:1", "http://b:2"), ""), (("a:1",), "routers")]:
        with pytest.raises(ValueError, match="must be host:port"):
            GatewayConfig(routers=routers, router_dns=dns)
    assert GatewayConfig(routers=("a:1", "a:1")).routers == ("a:1", "a:1")  # one router, as discovery reads it


def test_by_work_a_request_stays_until_the_excess_load_outweighs_what_it_would_recompute() -> None:
    from gateway_service.bounded_load import Bounds, capacity, choose_by_work
    from gateway_service.prefix_memory import Held
    from gateway_service.rendezvous import Ranking

    ranking = Ranking(ADDRESSES)
    weights = ranking.weights(affinity_key([8], 64))
    order = ranking.order(affinity_key([8], 64))
    holder, other = order[-1], order[-2]
    bounds = Bounds(load=1.0, memory=2.0, session=2.0, recompute_tokens=100)
    loads = dict.fromkeys(ADDRESSES, 4)  # 32 outstanding: capacity 5 at 1.0, 8 at 2.0
    assert capacity(32, 8, 1.0) == 5
    # A conversation whose 250-token history only `holder` has, its system prompt (50) `other` too.
    history = Held(((holder, 250), (other, 50)), 250, True)
    for load, expected in ((4, holder), (5, holder), (6, holder), (7, other)):
        # Excess over the capacity at 1.0, with this request: 0, 1, 2, 3 requests (x 100 tokens)
        # against 200 tokens to recompute on `other` (a tie goes to the longer held prefix).
        loads[holder] = load
        assert choose_by_work(ADDRESSES, weights, loads, bounds, history, 32 + load - 4) == expected
    # A new session of a shared prompt held by two: the one within the load bound; once both
    # are over it, the first in rendezvous order (50 tokens to recompute, under one request).
    loads[holder], loads[other] = 6, 4
    shared = Held(((holder, 50), (other, 50)), 50, False)
    assert choose_by_work(ADDRESSES, weights, loads, bounds, shared) == other
    loads[other] = 5
    assert choose_by_work(ADDRESSES, weights, loads, bounds, shared) == order[0]
    # Over their own bound (2.0 x the mean: 11 of 46), holders are never taken; nothing known: the
    # rendezvous order within the load bound.
    loads[holder] = loads[other] = 11
    assert choose_by_work(ADDRESSES, weights, loads, Bounds(1.0, 2.0, 2.0, 1), shared) == order[0]
    loads[order[0]] = 11
    assert choose_by_work(ADDRESSES, weights, loads, bounds, Held((), 0, False)) == order[1]
    up = {a: 4 for a in ADDRESSES if a != holder}  # a holder that is down is skipped
    assert choose_by_work(ADDRESSES, weights, up, bounds, history) == other
