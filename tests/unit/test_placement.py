"""Automatic placement (``tracker.placement``) as pure functions: holes first, then the weakest span,
sized by memory, on allowed boundaries; reservations keep concurrent joiners apart; moves to holes."""

from __future__ import annotations

import random

import pytest

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange, split_layers
from meshnet.tracker.placement import (
    LEAST_THROUGHPUT,
    UNCOVERED,
    Ask,
    Holder,
    choose_move,
    choose_range,
    holes,
    reserved_throughput,
)

MIB = 2**20


def ask(
    total: int = 30,
    *,
    layers_fit: float | None = None,
    max_layers: int | None = None,
    bounds: list[int] | None = None,
    head: int = 0,
    tail: int = 0,
) -> Ask:
    """A node whose budget holds ``layers_fit`` layers of 1 MiB each (default: all of them)."""
    fit = total if layers_fit is None else layers_fit
    return Ask(
        total_layers=total,
        layer_bytes=(MIB,) * total,
        budget_bytes=int(fit * MIB),
        boundaries=tuple(bounds if bounds is not None else range(total + 1)),
        head_bytes=head,
        tail_bytes=tail,
        max_layers=max_layers,
    )


def held(node_id: str, layers: str, tps: float = 10.0, total: int = 30, *, live: bool = True) -> Holder:
    return Holder(node_id, LayerRange.parse(layers, total), tps, live)


def join_all(asks: list[Ask]) -> list[str]:
    """Nodes asking one after another, each reserving what it got (as the tracker does)."""
    holders: list[Holder] = []
    for i, a in enumerate(asks):
        got = choose_range(a, holders).layers
        holders.append(Holder(f"n{i}", got, reserved_throughput(got), live=False))
    return [str(h.layers) for h in holders]


def test_an_empty_swarm_is_split_evenly_by_equal_nodes() -> None:
    assert join_all([ask(max_layers=10)] * 3) == ["0:10", "10:20", "20:30"]
    # By memory alone (10.5 layers' worth each): the same split, no sliver for the last node.
    assert join_all([ask(layers_fit=10.5)] * 3) == ["0:10", "10:20", "20:30"]
    first = choose_range(ask(max_layers=10), [])
    assert first.reason == UNCOVERED and "layers 0:30 are served by no node" in first.detail


@pytest.mark.parametrize(
    ("total", "nodes", "starts"),
    [(30, 3, None), (10, 3, None), (30, 4, None), (30, 5, None), (12, 2, None), (30, 1, None),
     (30, 4, list(range(0, 30, 4))), (48, 3, list(range(0, 48, 4))), (9, 3, [0, 3, 6])],
)  # fmt: skip
def test_equal_nodes_reproduce_meshnet_ups_equal_split(total: int, nodes: int, starts: list[int] | None) -> None:
    split = split_layers(total, nodes, starts)
    bounds = sorted({*(starts if starts is not None else range(total)), total})
    cap = max(len(r) for r in split)
    got = join_all([ask(total, max_layers=cap, bounds=bounds)] * nodes)
    assert got == [str(r) for r in split]


def test_a_node_that_holds_the_whole_hole_takes_exactly_the_hole() -> None:
    swarm = [held("a", "0:10"), held("c", "20:30")]
    got = choose_range(ask(), swarm)
    assert (str(got.layers), got.reason) == ("10:20", UNCOVERED)


def test_the_largest_hole_first_then_the_lowest() -> None:
    swarm = [held("a", "2:10"), held("b", "12:30")]
    assert str(choose_range(ask(), swarm).layers) == "0:2"  # 2 layers each: the lower one
    swarm = [held("a", "0:10"), held("b", "12:25")]
    assert str(choose_range(ask(), swarm).layers) == "25:30"  # 5 layers beat 2


def test_a_hole_bigger_than_the_node_gets_an_even_share_from_its_start() -> None:
    swarm = [held("a", "0:6")]  # hole 6:30, 24 layers; the node holds 10 -> 3 nodes of 8
    got = choose_range(ask(layers_fit=10), swarm)
    assert str(got.layers) == "6:14" and "an even share" in got.detail


def test_ranges_start_and_stop_on_the_allowed_boundaries_only() -> None:
    manifest = [0, 10, 20, 30]
    # A hole at 5:15 (gguf nodes cut elsewhere): the range must start at 0 and stop at 20.
    swarm = [held("a", "0:5"), held("b", "15:30")]
    assert str(choose_range(ask(bounds=manifest), swarm).layers) == "0:20"
    # A node that can hold only 9 layers fits no published range at all.
    with pytest.raises(InvalidRequest, match="no layer range fits this node") as caught:
        choose_range(ask(layers_fit=9, bounds=manifest), [])
    assert caught.value.code == "placement_does_not_fit" and caught.value.param == "budget_bytes"


def test_the_span_with_the_least_throughput_wins_once_every_layer_is_served() -> None:
    swarm = [held("a", "0:10", 50.0), held("b", "10:20", 5.0), held("c", "20:30", 50.0)]
    got = choose_range(ask(max_layers=10), swarm)
    assert (str(got.layers), got.reason) == ("10:20", LEAST_THROUGHPUT)
    # Petals' order: the weakest layer first, then the next weakest. Layer 29 alone is slowest.
    swarm = [held("a", "0:29", 20.0), held("b", "29:30", 1.0), held("c", "0:5", 100.0)]
    assert str(choose_range(ask(max_layers=10), swarm).layers) == "20:30"


def test_the_longest_range_from_a_start_is_taken_and_longer_wins_a_tie() -> None:
    swarm = [held("a", "0:30", 10.0)]
    got = choose_range(ask(layers_fit=12), swarm)
    assert str(got.layers) == "0:12"  # every span equally weak: the longest, then the lowest start


def test_memory_sizes_the_range_the_head_and_tail_cost_their_tables() -> None:
    # 12 layers' budget; the head's embedding table costs 4 layers' worth, the lm_head 2.
    big_ends = ask(layers_fit=12, head=4 * MIB, tail=2 * MIB)
    assert str(choose_range(big_ends, []).layers) == "0:8"  # 8 layers + the table: 12
    # The third can hold 10 of the last 11 (the tail costs 2): it takes an even share, 6, not a sliver-leaving 10.
    assert join_all([big_ends] * 4) == ["0:8", "8:19", "19:25", "25:30"]
    # With the KV budget inside layer_bytes, a longer context means fewer layers.
    kv_heavy = Ask(30, (3 * MIB,) * 30, 30 * MIB, tuple(range(31)))
    assert str(choose_range(kv_heavy, []).layers) == "0:10"


def test_concurrent_joiners_never_take_the_same_hole() -> None:
    swarm = [held("a", "0:10"), held("b", "20:30")]
    first = choose_range(ask(), swarm)
    reserved = Holder("x", first.layers, reserved_throughput(first.layers), live=False)
    second = choose_range(ask(max_layers=10), [*swarm, reserved])
    assert str(first.layers) == "10:20"
    assert second.reason == LEAST_THROUGHPUT  # the hole is taken: it helps elsewhere


def test_the_choice_does_not_depend_on_the_order_of_the_snapshot() -> None:
    rng = random.Random(7)
    for _ in range(50):
        swarm = []
        for i in range(rng.randint(0, 6)):
            a = rng.randrange(30)
            swarm.append(held(f"n{i}", f"{a}:{rng.randint(a + 1, 30)}", rng.choice([1.0, 2.0, 3.5])))
        node = ask(layers_fit=rng.randint(1, 30))
        expected = choose_range(node, swarm)
        assert choose_range(node, list(reversed(swarm))) == expected
        assert choose_range(node, rng.sample(swarm, len(swarm))) == expected


def test_a_doubly_covered_node_moves_to_the_hole() -> None:
    me = held("me", "0:10")
    swarm = [held("a", "0:10"), held("b", "10:20")]  # 20:30 left for good
    move = choose_move(ask(max_layers=10), me, swarm)
    assert move is not None and str(move.layers) == "20:30" and "stay served by other nodes" in move.detail


def test_a_node_moves_only_when_it_leaves_no_layer_uncovered() -> None:
    alone = held("me", "0:10")
    assert choose_move(ask(max_layers=10), alone, [held("b", "10:20")]) is None
    # Served twice only through a reservation: that node is not serving yet.
    pending = held("r", "0:10", live=False)
    assert choose_move(ask(max_layers=10), alone, [pending, held("b", "10:20")]) is None
    # Nothing uncovered: no move.
    full = [held("a", "0:10"), held("b", "10:20"), held("c", "20:30")]
    assert choose_move(ask(max_layers=10), held("me", "0:10"), full) is None
    # The hole is reserved by another node already: no second node goes there.
    reserved = [*full[:2], held("r", "20:30", live=False)]
    assert choose_move(ask(max_layers=10), held("me", "0:10"), reserved) is None


def test_asks_that_do_not_hold_together_are_invalid() -> None:
    with pytest.raises(InvalidRequest, match="layer_bytes has 2 entries for 3 layers"):
        Ask(3, (1, 2), 10, (0, 3))
    with pytest.raises(InvalidRequest, match="boundaries must rise strictly from 0 to 3"):
        Ask(3, (1, 2, 3), 10, (0, 2, 2, 3))
    with pytest.raises(InvalidRequest, match="boundaries"):
        Ask(3, (1, 2, 3), 10, (1, 3))
    assert holes([0, 1, 0, 0, 2]) == [(0, 1), (2, 4)]
