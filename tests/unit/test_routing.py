"""Route selection by estimated time (``select_routes``): against brute force, and each cost term on its own."""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

import pytest

from meshnet.errors import Overloaded
from meshnet.layers import LayerRange
from meshnet.tracker.plausibility import MAX_FLOPS, MAX_MEMORY_BANDWIDTH_BYTES_PER_S, speed_ceilings
from meshnet.tracker.routing import (
    DEFAULT_HOP_LATENCY_MS,
    NO_KV_ROOM_PENALTY_S,
    NodeRecord,
    RouteChoice,
    RouteRequest,
    plan_route,
    route_cost_ns,
    select_routes,
)

MODEL = "m"


def node(
    node_id: str,
    layers: str,
    *,
    total: int = 12,
    prefill: float = 1000.0,
    decode: float = 50.0,
    warm: bool = True,
    **fields: object,
) -> NodeRecord:
    base = NodeRecord(
        node_id=node_id,
        url=f"http://{node_id}",
        model=MODEL,
        layers=LayerRange.parse(layers, total),
        backend="fake",
        kv_bytes_free=10**9,
        last_seen=0.0,
        prefill_tps=prefill,
        decode_tps=decode,
        warm=warm,
        kv_bytes_per_token=1000,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def ids(choice: RouteChoice) -> list[str]:
    return [n.node_id for n in choice.nodes]


def best(nodes: list[NodeRecord], **kwargs: object) -> list[str]:
    return ids(select_routes(nodes, MODEL, **kwargs)[0])  # type: ignore[arg-type]


def tiles(chain: tuple[NodeRecord, ...], a: int, b: int) -> bool:
    return (
        chain[0].layers.start == a
        and chain[-1].layers.stop == b
        and all(x.layers.stop == y.layers.start for x, y in itertools.pairwise(chain))
    )


# -- brute force ------------------------------------------------------------------------------


def _all_chains(nodes: list[NodeRecord], a: int, b: int) -> list[tuple[NodeRecord, ...]]:
    chains: list[tuple[NodeRecord, ...]] = []

    def extend(chain: tuple[NodeRecord, ...], at: int) -> None:
        if at == b:
            chains.append(chain)
            return
        for n in nodes:
            if n.layers.start == at and n.layers.stop <= b:
                extend((*chain, n), n.layers.stop)

    extend((), a)
    return chains


def _random_swarm(rng: random.Random) -> list[NodeRecord]:
    cuts = [0, 2, 3, 4, 6, 8, 9, 12]
    nodes: list[NodeRecord] = []
    for i in range(rng.randint(2, 12)):
        total = 12 if rng.random() < 0.9 else 16
        start = rng.choice([c for c in cuts if c < total])
        stop = rng.choice([c for c in [*cuts, total] if start < c <= total])
        nodes.append(
            node(
                f"n{i:02d}",
                f"{start}:{stop}",
                total=total,
                prefill=rng.choice([0.0, 200.0, 1000.0, 5000.0]),
                decode=rng.choice([0.0, 5.0, 20.0, 80.0]),
                warm=rng.random() < 0.7,
                queue_depth=rng.choice([0, 0, 0, 1, 3]),
                reliability=rng.choice([1.0, 1.0, 0.9, 0.5, 0.0]),
                kv_bytes_free=rng.choice([10**9, 10**9, 1000]),
                weight_bytes=rng.choice([0, 2**28]),
                model=MODEL if rng.random() < 0.95 else "other",
                decode_tps_ceiling=rng.choice([math.inf, math.inf, 10.0]),
                prefill_tps_ceiling=rng.choice([math.inf, math.inf, 300.0]),
                decode_floor_s=rng.choice([0.0, 0.0, 0.001, 0.05]),
            )
        )
    # Some measured latencies, including to URLs of nodes that are not next hops, and duplicates.
    urls = [n.url for n in nodes]
    return [
        replace(n, latency_ms={u: rng.choice([0.1, 1.0, 20.0]) for u in rng.sample(urls, rng.randint(0, len(urls)))})
        for n in nodes
    ]


@pytest.mark.parametrize("seed", range(400))
def test_random_swarms_match_brute_force(seed: int):
    rng = random.Random(seed)
    nodes = _random_swarm(rng)
    request = RouteRequest(prefill_tokens=rng.choice([0, 16, 512]), decode_tokens=rng.choice([0, 1, 64, 256]))
    k = rng.choice([1, 2, 3, 5])
    exclude = {n.node_id for n in nodes if rng.random() < 0.1}
    span = rng.choice([None, None, (0, 6), (3, 9), (4, 12)])
    if rng.random() < 0.5:  # a prompt some nodes hold leading blocks of (by filter or by hint)
        prefix = tuple(i.to_bytes(8, "little") for i in range(rng.randint(1, 6)))
        request = replace(request, prefix_block=rng.choice([1, 4, 128]), prefix=prefix)
        nodes = [replace(n, prefix_held=frozenset(prefix[: rng.randint(0, len(prefix))])) for n in nodes]
    mine = [n for n in nodes if n.model == MODEL and n.node_id not in exclude]
    chains = []
    for total in {n.layers.total for n in mine}:
        a, b = span or (0, total)
        if b <= total:
            chains += _all_chains([n for n in mine if n.layers.total == total], a, b)
    costs = sorted(route_cost_ns(c, request) for c in chains)
    if not costs:
        with pytest.raises(Overloaded):
            select_routes(nodes, MODEL, request=request, exclude=exclude, span=span, k=k)
        return
    choices = select_routes(nodes, MODEL, request=request, exclude=exclude, span=span, k=k)
    assert [route_cost_ns(c.nodes, request) for c in choices] == costs[:k]
    assert len({ids(c).__repr__() for c in choices}) == len(choices)  # k distinct chains
    for c in choices:
        a, b = span or (0, c.nodes[0].layers.total)
        assert tiles(c.nodes, a, b)
        assert len({n.layers.total for n in c.nodes}) == 1
        assert not {n.node_id for n in c.nodes} & exclude
        assert c.estimated_s == route_cost_ns(c.nodes, request) / 1e9
        assert sum(c.breakdown.values()) == pytest.approx(c.estimated_s, rel=1e-9, abs=1e-6)
        assert 0 <= c.cached_tokens <= max(0, request.prefill_tokens - 1)
    # The input order never matters, ties included.
    again = select_routes(list(reversed(nodes)), MODEL, request=request, exclude=exclude, span=span, k=k)
    assert [ids(c) for c in again] == [ids(c) for c in choices]


# -- each term --------------------------------------------------------------------------------


def test_the_measurably_faster_of_two_equal_routes_wins():
    slow = [node("a", "0:6", decode=20.0), node("b", "6:12", decode=20.0)]
    fast = [node("c", "0:4", decode=25.0), node("d", "4:12", decode=20.0)]  # the same hops, one node faster
    assert best([*slow, *fast]) == ["c", "d"]
    assert best([*fast, *slow]) == ["c", "d"]
    prefill_fast = [node("e", "0:12", prefill=2000.0)]
    assert best([node("f", "0:12"), *prefill_fast]) == ["e"]


def test_a_faster_longer_route_beats_a_slower_shorter_one():
    one_slow = node("slow", "0:12", decode=10.0)
    two_fast = [node("h", "0:6", decode=100.0), node("t", "6:12", decode=100.0)]
    assert best([one_slow, *two_fast]) == ["h", "t"]
    # ...until the hop between them costs more than the speed gains.
    far = replace(two_fast[0], latency_ms={"http://t": 200.0})
    assert best([one_slow, far, two_fast[1]]) == ["slow"]


def test_measured_hop_latency_picks_the_close_next_hop():
    head = node("h", "0:6", latency_ms={"http://t1": 50.0, "http://t2": 0.5})
    assert best([head, node("t1", "6:12"), node("t2", "6:12")]) == ["h", "t2"]
    [choice] = select_routes([head, node("t2", "6:12")], MODEL, request=RouteRequest(0, 99))
    assert choice.breakdown["hop_latency_s"] == pytest.approx(0.5e-3 * 100)  # every decode step + the prefill
    unmeasured = select_routes([node("a", "0:6"), node("b", "6:12")], MODEL, request=RouteRequest(0, 99))[0]
    assert unmeasured.breakdown["hop_latency_s"] == pytest.approx(DEFAULT_HOP_LATENCY_MS * 1e-3 * 100)


def test_a_node_without_kv_room_is_avoided_and_only_used_as_a_last_resort():
    request = RouteRequest(prefill_tokens=100, decode_tokens=100)  # needs 200 * 1000 bytes
    full = node("full", "0:12", decode=500.0, kv_bytes_free=199_999)
    roomy = node("roomy", "0:12", decode=5.0, kv_bytes_free=200_000)
    assert best([full, roomy], request=request) == ["roomy"]
    [only] = select_routes([full], MODEL, request=request)
    assert only.breakdown["kv_penalty_s"] == NO_KV_ROOM_PENALTY_S
    unknown = node("unknown", "0:12", kv_bytes_per_token=0, kv_bytes_free=0)  # says nothing: not held against it
    assert select_routes([unknown], MODEL, request=request)[0].breakdown["kv_penalty_s"] == 0


def test_load_reliability_and_cold_start_each_cost_time():
    assert best([node("busy", "0:12", queue_depth=2), node("idle", "0:12", decode=40.0)]) == ["idle"]
    assert best([node("flaky", "0:12", reliability=0.5), node("solid", "0:12", decode=40.0)]) == ["solid"]
    assert best([node("cold", "0:12", warm=False), node("warm", "0:12", decode=48.0)]) == ["warm"]
    [dead] = select_routes([node("dead", "0:12", reliability=0.0)], MODEL)  # still a route, at a price
    assert dead.breakdown["reliability_penalty_s"] > 99 * dead.breakdown["decode_s"]
    [busy] = select_routes([node("busy", "0:12", queue_depth=3)], MODEL)
    assert busy.breakdown["load_penalty_s"] == pytest.approx(
        3 * (busy.breakdown["prefill_s"] + busy.breakdown["decode_s"])
    )


def test_unmeasured_nodes_cost_a_conservative_default_per_layer():
    measured = node("measured", "0:12", prefill=2000.0, decode=10.0)  # a slow node, but known
    unknown = node("unknown", "0:12", prefill=0.0, decode=0.0)  # charged 12 x 10 ms a token: 8.3 tokens/s
    assert best([unknown, measured]) == ["measured"]
    [guess] = select_routes([unknown], MODEL, request=RouteRequest(prefill_tokens=100, decode_tokens=10))
    assert guess.breakdown["prefill_s"] == pytest.approx(100 * 12 * 1e-3)
    assert guess.breakdown["decode_s"] == pytest.approx(10 * 12 * 1e-2)
    # Among unmeasured nodes the split does not change the compute estimate, so fewer hops win.
    split = [node("a", "0:6", prefill=0.0, decode=0.0), node("b", "6:12", prefill=0.0, decode=0.0)]
    assert best([*split, unknown]) == ["unknown"]


def test_k_alternatives_are_distinct_and_best_first():
    nodes = [node(f"h{i}", "0:6", decode=10.0 + i) for i in range(4)] + [node("t", "6:12")]
    choices = select_routes(nodes, MODEL, k=3)
    assert [ids(c) for c in choices] == [["h3", "t"], ["h2", "t"], ["h1", "t"]]
    assert [c.estimated_s for c in choices] == sorted(c.estimated_s for c in choices)
    assert len(select_routes(nodes, MODEL, k=10)) == 4
    with pytest.raises(ValueError, match="k must be"):
        select_routes(nodes, MODEL, k=0)


def test_exclude_avoids_failed_nodes():
    nodes = [node("h", "0:6"), node("t1", "6:12"), node("t2", "6:12", decode=10.0)]
    assert best(nodes) == ["h", "t1"]
    assert best(nodes, exclude={"t1"}) == ["h", "t2"]
    with pytest.raises(Overloaded, match=r"no node serves layers 6:12"):
        select_routes(nodes, MODEL, exclude=["t1", "t2"])
    with pytest.raises(Overloaded, match=r"no node serves model 'm' right now besides the 3 excluded"):
        select_routes(nodes, MODEL, exclude=["h", "t1", "t2"])


def test_span_replaces_a_segment():
    nodes = [node("a", "0:4"), node("b", "4:8"), node("c", "8:12"), node("b2", "4:6"), node("b3", "6:8")]
    assert best(nodes, span=(4, 8)) == ["b"]
    assert best(nodes, span=(4, 8), exclude={"b"}) == ["b2", "b3"]
    assert best(nodes, span=(0, 12)) == ["a", "b", "c"]
    # A node reaching outside the span never joins it, even if it would cover it.
    assert best([node("wide", "0:12"), node("mid", "4:8")], span=(4, 8)) == ["mid"]
    with pytest.raises(Overloaded, match=r"do not cover layers 4:8: no node serves layers 6:8 \(have 4:6\)"):
        select_routes([node("a", "0:4"), node("b2", "4:6")], MODEL, span=(4, 8))
    with pytest.raises(Overloaded, match=r"do not cover layers 4:8: no node serves layers 4:8 \(have none\)"):
        select_routes([node("a", "0:12")], MODEL, span=(4, 8))


def test_plan_route_is_the_best_choice():
    nodes = [node("h", "0:6"), node("t1", "6:12"), node("t2", "6:12", decode=60.0)]
    assert plan_route(nodes, MODEL) == list(select_routes(nodes, MODEL)[0].nodes)
    assert [n.node_id for n in plan_route(nodes, MODEL, 12)] == ["h", "t2"]


def test_the_request_shape_changes_the_choice():
    # Fast prefill, slow decode vs the opposite: a long prompt with one token wants the first.
    prefiller = node("p", "0:12", prefill=10_000.0, decode=10.0)
    decoder = node("d", "0:12", prefill=500.0, decode=100.0)
    assert best([prefiller, decoder], request=RouteRequest(prefill_tokens=4096, decode_tokens=1)) == ["p"]
    assert best([prefiller, decoder], request=RouteRequest(prefill_tokens=16, decode_tokens=512)) == ["d"]


@pytest.mark.parametrize("count", [10, 100, 1000])
def test_large_swarms_select_quickly(count: int):
    rng = random.Random(count)
    total = 32
    cuts = sorted(rng.sample(range(1, total), 7))
    bounds = [0, *cuts, total]
    nodes = []
    for i in range(count):
        j = i if i < len(bounds) - 1 else rng.randrange(len(bounds) - 1)  # the first ones cover every layer
        span = rng.choice([1, 1, 2])
        start, stop = bounds[j], bounds[min(len(bounds) - 1, j + span)]
        nodes.append(node(f"n{i:04d}", f"{start}:{stop}", total=total, decode=rng.uniform(5, 100)))
    urls = [n.url for n in nodes]
    nodes = [
        replace(n, latency_ms={u: rng.uniform(0.1, 30) for u in rng.sample(urls, min(16, len(urls)))}) for n in nodes
    ]
    began = time.perf_counter()
    choices = select_routes(nodes, MODEL, k=3)
    elapsed = time.perf_counter() - began
    assert choices and all(tiles(c.nodes, 0, total) for c in choices)
    assert elapsed < 0.5  # ~20 ms at 1,000 nodes on one core; the margin is for a loaded CI machine


# -- plausible speeds (tracker.plausibility) --------------------------------------------------


def test_ceilings_cap_an_absurd_claim_and_leave_an_honest_one():
    # 70B parameters at ~4.5 bits in 80 layers: an honest single accelerator of 2026 decodes it at
    # tens of positions/s and prefills a few thousand; the ceilings are orders of magnitude above.
    prefill_cap, decode_cap = speed_ceilings(40 * 10**9, 80)
    assert decode_cap == pytest.approx(MAX_MEMORY_BANDWIDTH_BYTES_PER_S / 40e9) == pytest.approx(1250.0)
    assert prefill_cap == pytest.approx(MAX_FLOPS / (2 * 40e9 / 4)) == pytest.approx(5e6)
    capped = {"prefill_tps_ceiling": prefill_cap, "decode_tps_ceiling": decode_cap}
    honest = node("honest", "0:12", prefill=3000.0, decode=40.0, **capped)
    assert (honest.prefill_tps_used, honest.decode_tps_used) == (3000.0, 40.0)
    liar = node("liar", "0:12", prefill=1e7, decode=1e6, **capped)
    assert (liar.prefill_tps_used, liar.decode_tps_used) == (prefill_cap, decode_cap)
    [choice] = select_routes([liar], MODEL, request=RouteRequest(prefill_tokens=100, decode_tokens=50))
    assert choice.breakdown["decode_s"] == pytest.approx(50 / decode_cap)
    assert choice.breakdown["prefill_s"] == pytest.approx(100 / prefill_cap)
    # Unmeasured speeds stay unmeasured (0: the per-layer default), whatever the ceiling.
    assert node("new", "0:12", prefill=0.0, decode=0.0, **capped).decode_tps_used == 0.0


def test_an_unsaid_or_implausibly_small_weight_size_counts_as_a_floor_per_layer():
    assert speed_ceilings(0, 12) == speed_ceilings(100, 12) == speed_ceilings(12 << 20, 12)
    assert speed_ceilings(0, 12)[1] == pytest.approx(MAX_MEMORY_BANDWIDTH_BYTES_PER_S / (12 << 20))
    assert speed_ceilings(13 << 20, 12)[1] < speed_ceilings(0, 12)[1]  # a real size above the floor counts
    assert all(0 < c < math.inf for c in speed_ceilings(2**50, 1))


def test_an_observed_floor_charges_a_liar_its_real_speed_prefill_included():
    liar = node("liar", "0:6", prefill=1e6, decode=1e6)
    honest = node("honest", "0:6", prefill=1000.0, decode=50.0)
    tail = node("t", "6:12")
    assert best([liar, honest, tail]) == ["liar", "t"]
    floored = replace(liar, decode_floor_s=0.1)  # its routes took 0.1 s per position for its layers
    assert best([floored, honest, tail]) == ["honest", "t"]
    # A prompt-heavy request too: its prefill claim is scaled by the factor its decode claim was off by.
    assert best([floored, honest, tail], request=RouteRequest(prefill_tokens=4096, decode_tokens=1)) == ["honest", "t"]
    whole = node("whole", "0:12", prefill=1e6, decode=1e6, decode_floor_s=0.1)
    [alone] = select_routes([whole], MODEL, request=RouteRequest(prefill_tokens=100, decode_tokens=10))
    assert alone.breakdown["decode_s"] == pytest.approx(10 * 0.1)
    assert alone.breakdown["prefill_s"] == pytest.approx(100 * 1e-6 * (0.1 / 1e-6))
    # A floor below what the node claims changes nothing.
    assert route_cost_ns([replace(honest, decode_floor_s=0.01), tail]) == route_cost_ns([honest, tail])
