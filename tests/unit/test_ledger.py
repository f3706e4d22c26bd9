"""Chunk lists (``X-Meshnet-Chunks``) and per-hop chunk ledgers with running digests."""

from __future__ import annotations

import pytest

from meshnet.errors import RouteInconsistent, SeamMismatch
from meshnet.layers import LayerRange
from meshnet.protocol.ledger import (
    EMPTY_DIGEST,
    ChunkLedger,
    extend_digest,
    format_chunks,
    pack_chunks,
    parse_chunks,
    verify_hops,
)
from meshnet.protocol.messages import HopEntry
from meshnet.routes import Hop


def test_chunk_lists_are_run_length_encoded_and_round_trip() -> None:
    sizes = [128, 128, 37, 1, 1, 1, 5, 1]
    text = format_chunks(sizes)
    assert text == "128x2,37,1x3,5,1"
    assert parse_chunks(text, sum(sizes)) == tuple(sizes)
    assert parse_chunks(None, 9) == (9,)
    assert parse_chunks("  ", 9) == (9,)
    assert parse_chunks(" 4x2 , 1 ", 9) == (4, 4, 1)


@pytest.mark.parametrize(
    ("text", "n", "needle"),
    [
        ("4x2", 9, "adds up to 8"),
        ("4x3", 9, "adds up to 12"),
        ("0,9", 9, "does not split"),
        ("4x0,9", 9, "does not split"),
        ("-1,10", 9, "SIZE or SIZExCOUNT"),
        ("4,x", 9, "SIZE or SIZExCOUNT"),
        ("4y2,1", 9, "SIZE or SIZExCOUNT"),
        ("٣,6", 9, "SIZE or SIZExCOUNT"),  # a non-ASCII digit
        ("1x99999999999", 9, "does not split"),
        (",".join(["1"] * 5000), 5000, "at most 4096"),
    ],
)
def test_a_bad_chunk_list_is_a_seam_mismatch(text: str, n: int, needle: str) -> None:
    with pytest.raises(SeamMismatch, match=needle):
        parse_chunks(text, n)


def test_chunks_are_packed_into_requests_without_splitting_any() -> None:
    assert list(pack_chunks([128, 128, 37, 1, 1, 1], 128)) == [(0, (128,)), (128, (128,)), (256, (37, 1, 1, 1))]
    assert list(pack_chunks([1] * 5, 2)) == [(0, (1, 1)), (2, (1, 1)), (4, (1,))]
    assert list(pack_chunks([300, 1], 128)) == [(0, (300,)), (300, (1,))]  # a big chunk travels alone
    assert list(pack_chunks([], 8)) == []


def test_the_digest_covers_start_size_and_bytes() -> None:
    d = extend_digest(EMPTY_DIGEST, 0, 2, b"abcdefgh")
    assert len(d) == 16 and d != EMPTY_DIGEST
    assert extend_digest(EMPTY_DIGEST, 1, 2, b"abcdefgh") != d
    assert extend_digest(EMPTY_DIGEST, 0, 1, b"abcdefgh") != d
    assert extend_digest(EMPTY_DIGEST, 0, 2, b"abcdefgi") != d


def test_the_digest_is_pinned() -> None:
    """docs/protocol.md gives this value: BLAKE2b-128 of 16 zero bytes, start and size as u64 LE, the bytes."""
    assert extend_digest(EMPTY_DIGEST, 0, 1, (7).to_bytes(4, "little")).hex() == "6b6488e398dd2f86c0333be6f5d67c40"


def test_a_ledger_records_chunks_rewinds_to_a_boundary_and_describes_itself() -> None:
    ledger = ChunkLedger(sends=True)
    assert ledger.describe() == {"held": 0, "input_digest": EMPTY_DIGEST.hex(), "output_digest": EMPTY_DIGEST.hex()}
    ledger.record(4, b"in-a", b"out-a")
    after_first = ledger.describe()
    ledger.record(1, b"in-b", b"out-b")
    ledger.record(1, b"in-c", b"out-c")
    assert ledger.sizes() == [4, 1, 1] and ledger.position == 6
    assert ledger.rewind(5)
    assert ledger.sizes() == [4, 1]
    ledger.record(1, b"in-c", b"out-c")
    twin = ChunkLedger(sends=True)
    for size, data in ((4, b"a"), (1, b"b"), (1, b"c")):
        twin.record(size, b"in-" + data, b"out-" + data)
    assert ledger.describe() == twin.describe()  # rewinding and recomputing gives the same record
    assert ledger.rewind(4) and ledger.describe() == after_first
    assert ledger.rewind(4)  # already there


def test_a_rewind_inside_a_chunk_clears_the_ledger() -> None:
    ledger = ChunkLedger(sends=False)
    ledger.record(8, b"x")
    assert not ledger.rewind(3)
    assert ledger.position == 0 and ledger.sizes() == []
    assert "output_digest" not in ledger.describe()


def test_the_same_positions_in_other_chunks_give_another_digest() -> None:
    one, two = ChunkLedger(sends=False), ChunkLedger(sends=False)
    one.record(2, b"ab")
    two.record(1, b"a")
    two.record(1, b"b")
    assert one.position == two.position and one.describe() != two.describe()


ROUTE = (Hop("a", "http://a", LayerRange(0, 10, 30)), Hop("b", "http://b", LayerRange(10, 30, 30)))


def consistent_answer() -> tuple[ChunkLedger, list[dict[str, object]]]:
    """A gateway ledger of two chunks of token ids, and the answer of a route that computed them faithfully."""
    gateway, head, tail = ChunkLedger(sends=False), ChunkLedger(sends=True), ChunkLedger(sends=False)
    for tokens, activations in ((b"t0t1", b"h0h1"), (b"t2", b"h2")):
        size = len(tokens) // 2
        gateway.record(size, tokens)
        head.record(size, tokens, activations)
        tail.record(size, activations)
    return gateway, [
        {"node": "a", "layers": "0:10", **head.describe()},
        {"node": "b", "layers": "10:30", **tail.describe()},
    ]


def entries(hops: list[dict[str, object]]) -> list[HopEntry]:
    return [HopEntry.from_json(h) for h in hops]


def test_a_faithful_route_passes_the_check() -> None:
    gateway, hops = consistent_answer()
    verify_hops(gateway, ROUTE, entries(hops))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda hops: hops[1].update(held=2), "holds 2 positions; the route should hold 3"),
        (lambda hops: hops[0].update(input_digest=EMPTY_DIGEST.hex()), "the gateway's token ids"),
        (lambda hops: hops[0].update(output_digest=EMPTY_DIGEST.hex()), "what node a sent it"),
        (lambda hops: hops[1].update(input_digest="00"), "what node a sent it"),
        (lambda hops: hops.pop(), "the session is on ['a', 'b']"),
        (lambda hops: hops.reverse(), "answered for nodes ['b', 'a']"),
    ],
)
def test_any_disagreement_between_hops_stops_the_generation(damage: object, needle: str) -> None:
    gateway, hops = consistent_answer()
    damage(hops)  # type: ignore[operator]
    with pytest.raises(RouteInconsistent, match=needle.replace("[", r"\[").replace("]", r"\]")):
        verify_hops(gateway, ROUTE, entries(hops))


def test_a_route_that_chunked_the_prompt_differently_is_caught() -> None:
    gateway, hops = consistent_answer()
    rechunked = ChunkLedger(sends=True)
    rechunked.record(3, b"t0t1t2", b"h0h1h2")
    hops[0] = {"node": "a", "layers": "0:10", **rechunked.describe()}
    with pytest.raises(RouteInconsistent, match="token ids"):
        verify_hops(gateway, ROUTE, entries(hops))
