"""Route repair as a pure decision: which run of hops to replace, and by which nodes."""

from __future__ import annotations

import pytest

from meshnet.errors import Overloaded
from meshnet.layers import LayerRange
from meshnet.tracker.repair import PinnedHop, plan_repair
from meshnet.tracker.routing import NodeRecord

MODEL = "m"
TOTAL = 30


def node(node_id: str, layers: str, **fields: object) -> NodeRecord:
    base: dict[str, object] = {
        "url": f"http://{node_id}:7000",
        "model": MODEL,
        "layers": LayerRange.parse(layers, TOTAL),
        "backend": "fake",
        "kv_bytes_free": 1 << 30,
        "last_seen": 0.0,
        "prefill_tps": 1000.0,
        "decode_tps": 100.0,
        "warm": True,
        "numerics": "cpu-x; threads 1",
    }
    base.update(fields)
    return NodeRecord(node_id=node_id, **base)  # type: ignore[arg-type]


def route(*hops: NodeRecord) -> list[PinnedHop]:
    return [PinnedHop(h.node_id, h.layers, h.numerics, h.wire_dtype) for h in hops]


A, B, C = node("a", "0:10"), node("b", "10:20"), node("c", "20:30")


def test_a_spare_with_the_same_range_replaces_only_the_failed_hop():
    spare = node("b2", "10:20")
    fix = plan_repair(route(A, B, C), "b", [A, C, spare], MODEL)
    assert (fix.first, fix.removed, [n.node_id for n in fix.nodes]) == (1, 1, ["b2"])
    assert [h.node_id for h in fix.apply(route(A, B, C))] == ["a", "b2", "c"]


def test_a_wider_spare_replaces_the_failed_hop_and_its_neighbour():
    spare = node("s", "10:30")  # the only cover of 20:30 once c is gone
    fix = plan_repair(route(A, B, C), "c", [A, B, spare], MODEL)
    assert (fix.first, fix.removed, [n.node_id for n in fix.nodes]) == (1, 2, ["s"])
    fix = plan_repair(route(A, B, C), "b", [A, C, spare], MODEL)
    assert (fix.first, fix.removed, [n.node_id for n in fix.nodes]) == (1, 2, ["s"])


def test_a_run_can_be_replaced_by_several_nodes():
    route_ = route(A, node("s", "10:30"))
    fix = plan_repair(route_, "s", [A, B, C], MODEL)
    assert (fix.first, fix.removed, [n.node_id for n in fix.nodes]) == (1, 1, ["b", "c"])


def test_the_head_is_replaced_only_when_nothing_smaller_works():
    head2, wide = node("a2", "0:10"), node("w", "0:20")
    fix = plan_repair(route(A, B, C), "a", [B, C, head2, wide], MODEL)
    assert (fix.first, fix.removed, [n.node_id for n in fix.nodes]) == (0, 1, ["a2"])
    # Same length: a run that keeps the head wins over one that replaces it.
    b_or_head = plan_repair(route(A, B, C), "b", [A, C, wide, node("bc", "10:30")], MODEL)
    assert (b_or_head.first, b_or_head.removed) == (1, 2)


def test_nodes_on_the_route_or_excluded_never_replace():
    again = node("b", "10:20")  # the failed node itself, still registered
    with pytest.raises(Overloaded, match="no live node can take over layers 10:20 from failed node b"):
        plan_repair(route(A, B, C), "b", [A, again, C], MODEL)
    b2 = node("b2", "10:20")
    with pytest.raises(Overloaded):
        plan_repair(route(A, B, C), "b", [A, C, b2], MODEL, exclude={"b2"})


def test_the_faster_replacement_wins():
    slow, fast = node("slow", "10:20", decode_tps=10.0), node("fast", "10:20", decode_tps=400.0)
    fix = plan_repair(route(A, B, C), "b", [A, C, slow, fast], MODEL)
    assert [n.node_id for n in fix.nodes] == ["fast"]


def test_an_unknown_failed_node_is_a_caller_error():
    with pytest.raises(ValueError, match="not on this route"):
        plan_repair(route(A, B, C), "zzz", [A, B, C], MODEL)


def test_hop_timeouts_nest_so_the_innermost_caller_gives_up_first():
    from meshnet.routes import NESTED_TIMEOUT_MARGIN_S, hop_timeout_s

    # Route head -> mid -> tail: mid waits for the tail, head for mid (and the tail), the gateway for all.
    mid, head, gateway = hop_timeout_s(4.0, 1), hop_timeout_s(4.0, 2), hop_timeout_s(4.0, 3)
    assert mid == 4.0 and head == 4.0 + NESTED_TIMEOUT_MARGIN_S and gateway == head + NESTED_TIMEOUT_MARGIN_S
    assert hop_timeout_s(4.0, 0) == 4.0


def test_only_a_node_with_the_same_numerics_may_replace_a_hop():
    """Another thread count or processor computes other low bits: the text would change after the repair."""
    other = node("b2", "10:20", numerics="cpu-x; threads 2")
    unknown = node("b3", "10:20", numerics=None)
    with pytest.raises(Overloaded, match="bit-identically"):
        plan_repair(route(A, B, C), "b", [A, C, other, unknown], MODEL)
    same = node("b4", "10:20")
    assert plan_repair(route(A, B, C), "b", [A, C, other, unknown, same], MODEL).nodes == (same,)


def test_exact_float32_seams_may_merge_but_lossy_ones_stay_where_they_were():
    lossy_b = node("b", "10:20", wire_dtype="bfloat16")
    spare = node("s", "10:30")
    # B sent bfloat16 into C: a spare computing 10:30 in one piece would skip that rounding.
    with pytest.raises(Overloaded):
        plan_repair(route(A, lossy_b, C), "c", [A, lossy_b, spare], MODEL)
    assert plan_repair(route(A, B, C), "c", [A, B, spare], MODEL).nodes == (spare,)
    # Replacing B alone: the replacement must send what B sent, in B's dtype.
    exact_b2 = node("b2", "10:20")
    lossy_b2 = node("b3", "10:20", wire_dtype="bfloat16")
    assert plan_repair(route(A, lossy_b, C), "b", [A, C, exact_b2, lossy_b2], MODEL).nodes == (lossy_b2,)
    # ...and where the route had an exact seam, a lossy sender would add a rounding.
    assert plan_repair(route(A, B, C), "b", [A, C, exact_b2, lossy_b2], MODEL).nodes == (exact_b2,)
    # A new seam inside a replaced run must be exact too.
    lossy_s1, s2 = node("s1", "10:15", wire_dtype="float16"), node("s2", "15:20")
    with pytest.raises(Overloaded):
        plan_repair(route(A, B, C), "b", [A, C, lossy_s1, s2], MODEL)
