"""Rendezvous order: stable, prefix-affine, and minimal movement when a router goes away."""

from __future__ import annotations

from gateway_service.rendezvous import affinity_key, rendezvous_order

ROUTERS = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]


def test_order_depends_only_on_the_affinity_window():
    a = affinity_key([5, 6, 7, 8, 1], 4)
    b = affinity_key([5, 6, 7, 8, 2, 3], 4)
    assert a == b
    assert rendezvous_order(ROUTERS, a) == rendezvous_order(list(reversed(ROUTERS)), b)


def test_keys_spread_over_routers():
    firsts = {rendezvous_order(ROUTERS, affinity_key([i, i + 1], 8))[0] for i in range(60)}
    assert firsts == set(ROUTERS)


def test_removing_a_router_only_moves_its_own_keys():
    for i in range(100):
        key = affinity_key([i, 3 * i], 8)
        full = rendezvous_order(ROUTERS, key)
        without = rendezvous_order([r for r in ROUTERS if r != ROUTERS[0]], key)
        # Failover order is the full order with the missing router skipped.
        assert without == [r for r in full if r != ROUTERS[0]]


def test_the_vectorized_weights_are_the_documented_mix() -> None:
    from gateway_service.rendezvous import Ranking, hash64, weight

    ranking = Ranking(ROUTERS)
    key = affinity_key([4, 5, 6], 8)
    expected = [weight(hash64(name.encode()), hash64(key)) for name in ROUTERS]
    assert ranking.weights(key).tolist() == expected
    assert ranking.order(key) == sorted(ROUTERS, key=lambda name: expected[ROUTERS.index(name)], reverse=True)
