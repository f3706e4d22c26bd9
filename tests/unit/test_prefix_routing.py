"""Cache-warm routing (issue #14): prompt prefixes as chained block hashes (``protocol.prefix``),
the cost of a route whose nodes hold them, and the tracker's ``prefix_filter`` / ``prefix`` fields
and its hints about sessions that just closed."""

from __future__ import annotations

import base64
import re
import time
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

import meshnet.tracker.app as tracker_app
import meshnet.tracker.sessions as tracker_sessions
from meshnet.protocol.prefix import (
    FILTER_BITS,
    HASH_BYTES,
    MAX_PREFIX_BLOCKS,
    PrefixFilter,
    block_hashes,
    format_prefix,
    matched_blocks,
    parse_prefix,
)
from meshnet.tracker.app import create_tracker_app
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.routing import RouteRequest, select_routes
from meshnet.tracker.sessions import PREFIX_HINT_S, PrefixHints
from tests.unit.test_routing import MODEL, ids, node
from tests.unit.test_tracker import assert_error, registration

BLOCK = 128
PROMPT = [(7 * i + 3) % 50_000 for i in range(4 * BLOCK + 40)]  # 4 full blocks and a partial one
HASHES = tuple(block_hashes(PROMPT, BLOCK))


# -- protocol.prefix ----------------------------------------------------------------------------


def test_equal_prefixes_hash_equally_and_a_changed_token_changes_its_block_and_every_later_one():
    assert len(HASHES) == 4 and all(len(h) == HASH_BYTES for h in HASHES)
    assert block_hashes(list(PROMPT), BLOCK) == list(HASHES)
    # A longer prompt (the conversation's next turn) shares every block of the shorter one.
    assert block_hashes([*PROMPT, *range(300)], BLOCK)[:4] == list(HASHES)
    changed = list(PROMPT)
    changed[2 * BLOCK + 5] += 1  # a token of block 2
    other = block_hashes(changed, BLOCK)
    assert other[:2] == list(HASHES[:2])
    assert all(a != b for a, b in zip(other[2:], HASHES[2:], strict=True))  # chained: every later block moves


def test_only_full_blocks_are_hashed_up_to_the_limit_and_the_block_size_seeds_the_chain():
    assert block_hashes(PROMPT[: BLOCK - 1], BLOCK) == []
    assert len(block_hashes(PROMPT, BLOCK, limit=2)) == 2
    assert len(block_hashes(list(range(MAX_PREFIX_BLOCKS + 5)), 1)) == MAX_PREFIX_BLOCKS
    halves = block_hashes(PROMPT, BLOCK // 2)
    assert not set(halves) & set(HASHES)  # other block sizes never match
    with pytest.raises(ValueError, match="at least one token"):
        block_hashes(PROMPT, 0)


def test_the_prefix_header_round_trips():
    assert parse_prefix(format_prefix(BLOCK, HASHES)) == (BLOCK, HASHES)
    assert parse_prefix(f" {BLOCK}: ") == (BLOCK, ())
    assert parse_prefix(format_prefix(BLOCK, HASHES).upper()) == (BLOCK, HASHES)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "must be BLOCK:HASH,HASH"),
        ("0123456789abcdef", "must be BLOCK:HASH,HASH"),
        ("0:0123456789abcdef", "(1..65536)"),
        ("65537:0123456789abcdef", "(1..65536)"),
        ("-1:0123456789abcdef", "must be BLOCK:HASH,HASH"),
        ("x:0123456789abcdef", "must be BLOCK:HASH,HASH"),
        ("128:0123456789abcdeg", "'0123456789abcdeg' is not 16 hex digits"),
        ("128:0123456789abcd", "is not 16 hex digits"),
        ("128:0123456789abcdef,", "'' is not 16 hex digits"),
        ("128:" + ",".join(["0123456789abcdef"] * (MAX_PREFIX_BLOCKS + 1)), "names 513 blocks; at most 512"),
    ],
)
def test_a_bad_prefix_header_says_what_is_wrong(text: str, says: str):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_prefix(text)


def test_the_filter_round_trips_and_holds_what_was_added():
    held = PrefixFilter.of(HASHES[:3])
    again = PrefixFilter.decode(held.encode())
    assert again.bits == held.bits and len(base64.b64decode(held.encode())) == FILTER_BITS // 8
    assert all(h in again for h in HASHES[:3])  # no false negatives
    assert HASHES[3] not in again
    assert b"short" not in again and "text" not in again  # not a hash: never held
    assert not PrefixFilter() and held


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not base64!", "a prefix filter is base64"),
        ("\u00e9" * 8, "a prefix filter is base64"),
        (base64.b64encode(b"\0" * 10).decode(), "is 2048 bytes, got 10"),
        (base64.b64encode(b"\0" * (FILTER_BITS // 8 + 1)).decode(), "is 2048 bytes, got 2049"),
    ],
)
def test_a_bad_filter_is_refused(text: str, says: str):
    with pytest.raises(ValueError, match=re.escape(says)):
        PrefixFilter.decode(text)


def test_matched_blocks_counts_the_leading_blocks_held_and_stops_at_the_first_miss():
    assert matched_blocks(HASHES, set(HASHES)) == 4
    assert matched_blocks(HASHES, PrefixFilter.of(HASHES)) == 4
    holes = [HASHES[0], HASHES[1], HASHES[3]]  # block 2 evicted: block 3 is no use without it
    assert matched_blocks(HASHES, holes) == 2
    assert matched_blocks(HASHES, PrefixFilter.of(holes)) == 2
    assert matched_blocks(HASHES, HASHES[1:]) == 0
    assert matched_blocks((), HASHES) == 0


# -- the cost of a warm route -------------------------------------------------------------------

WARM = RouteRequest(prefill_tokens=len(PROMPT), decode_tokens=16, prefix_block=BLOCK, prefix=HASHES)


def test_between_two_equal_chains_the_one_holding_the_prompt_wins():
    cold = [node("a1", "0:6"), node("b1", "6:12")]  # cut elsewhere than the warm ones: no chain mixes them
    by_filter = [node(n, r, prefix_filter=PrefixFilter.of(HASHES)) for n, r in (("a2", "0:4"), ("b2", "4:12"))]
    by_hint = [node(n, r, prefix_held=frozenset(HASHES)) for n, r in (("a3", "0:4"), ("b3", "4:12"))]
    for warm in (by_filter, by_hint):
        for nodes in ([*cold, *warm], [*warm, *cold]):
            first, second = select_routes(nodes, MODEL, request=WARM, k=2)
            assert ids(first) == [n.node_id for n in warm] and ids(second) == ["a1", "b1"]
            assert (first.cached_tokens, second.cached_tokens) == (4 * BLOCK, 0)
            # Each node skips 512 of its prefill positions (1,000 positions/s in these nodes).
            saved = second.breakdown["prefill_s"] - first.breakdown["prefill_s"]
            assert saved == pytest.approx(2 * 4 * BLOCK / 1000.0)
            assert sum(first.breakdown.values()) == pytest.approx(first.estimated_s, rel=1e-9)
            assert "cached_tokens" not in first.breakdown  # a count, not seconds
    # Without the prompt's hashes the same swarm ties, and the ids break it.
    assert ids(select_routes([*by_filter, *cold], MODEL, request=replace(WARM, prefix=()))[0]) == ["a1", "b1"]


def test_a_chain_reuses_only_what_every_hop_holds():
    head = node("h", "0:4", prefix_filter=PrefixFilter.of(HASHES))
    middle = node("m", "4:8", prefix_held=frozenset(HASHES[:2]))  # held by the hint only
    tail = node("t", "8:12", prefix_filter=PrefixFilter.of(HASHES[:3]))
    [choice] = select_routes([head, middle, tail], MODEL, request=WARM)
    assert choice.cached_tokens == 2 * BLOCK
    # The cost charges each node what it holds itself: 4, 2 and 3 blocks.
    expected = sum(len(PROMPT) - blocks * BLOCK for blocks in (4, 2, 3)) / 1000.0
    assert choice.breakdown["prefill_s"] == pytest.approx(expected)
    [cold_hop] = select_routes([head, node("m", "4:8"), tail], MODEL, request=WARM)
    assert cold_hop.cached_tokens == 0


def test_the_filter_or_the_hint_whichever_reaches_further_and_a_miss_ends_the_prefix():
    both = node("n", "0:12", prefix_filter=PrefixFilter.of(HASHES[:1]), prefix_held=frozenset(HASHES[:3]))
    assert select_routes([both], MODEL, request=WARM)[0].cached_tokens == 3 * BLOCK
    holes = node("n", "0:12", prefix_filter=PrefixFilter.of([HASHES[0], HASHES[2], HASHES[3]]))
    assert select_routes([holes], MODEL, request=WARM)[0].cached_tokens == BLOCK


@pytest.mark.parametrize(("prefill", "cached"), [(4 * BLOCK + 40, 4 * BLOCK), (4 * BLOCK, 4 * BLOCK - 1), (100, 99),
                                                  (1, 0), (0, 0)])  # fmt: skip
def test_the_last_prompt_position_is_always_computed(prefill: int, cached: int):
    warm = node("n", "0:12", prefix_filter=PrefixFilter.of(HASHES))
    [choice] = select_routes([warm], MODEL, request=replace(WARM, prefill_tokens=prefill))
    assert choice.cached_tokens == cached
    assert choice.breakdown["prefill_s"] == pytest.approx((prefill - cached) / 1000.0)


def test_a_cold_request_still_picks_by_speed():
    held = PrefixFilter.of(HASHES)
    warm_slow = [node("a", "0:6", decode=20.0, prefix_filter=held), node("b", "6:12", decode=20.0, prefix_filter=held)]
    fast = [node("c", "0:6", decode=80.0), node("d", "6:12", decode=80.0)]
    assert ids(select_routes([*warm_slow, *fast], MODEL, request=replace(WARM, prefix=()))[0]) == ["c", "d"]
    unheld = tuple(block_hashes([1, *PROMPT], BLOCK))  # another prompt: nobody holds it
    choice = select_routes([*warm_slow, *fast], MODEL, request=replace(WARM, prefix=unheld))[0]
    assert ids(choice) == ["c", "d"] and choice.cached_tokens == 0
    # The hashes of another block size never match the filter's.
    halves = replace(WARM, prefix_block=BLOCK // 2, prefix=tuple(block_hashes(PROMPT, BLOCK // 2)))
    assert select_routes(warm_slow, MODEL, request=halves)[0].cached_tokens == 0
    assert select_routes(warm_slow, MODEL, request=WARM)[0].cached_tokens == 4 * BLOCK


# -- the tracker's HTTP surface -----------------------------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    db = TrackerDB("sqlite:///" + str(tmp_path / "t.db"))
    try:
        with TestClient(create_tracker_app(db)) as c:
            yield c
    finally:
        db.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The tracker's wall clock, moved by hand: ``clock[0] += ...`` (from now: the database expires
    sessions by its own clock)."""
    now = [time.time()]
    fake = types.SimpleNamespace(time=lambda: now[0])
    monkeypatch.setattr(tracker_app, "time", fake)
    monkeypatch.setattr(tracker_sessions, "time", fake)
    return now


def prefix_json(hashes: tuple[bytes, ...] = HASHES, block: int = BLOCK) -> dict[str, Any]:
    return {"block": block, "hashes": [h.hex() for h in hashes]}


CHAINS = (("a1", "0:6"), ("b1", "6:12"), ("a2", "0:4"), ("b2", "4:12"))


def two_chains(client: TestClient, **warm: Any) -> None:
    """a1 b1 and a2 b2, equal but for ``warm`` (the fields of a2 and b2); cold, a1 b1 win by id. The
    chains are cut at different layers, so no route mixes them; all compute alike (``like_session``)."""
    for name, layers in CHAINS:
        fields = warm if name.endswith("2") else {}
        body = registration(name, layers, numerics="fake 1; threads 1", **fields)
        assert client.post("/v1/nodes", json=body).status_code in (200, 201)


def open_route(client: TestClient, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prefill_tokens": len(PROMPT), "max_tokens": 16, **fields}
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def hop_ids(session: dict[str, Any]) -> list[str]:
    return [h["node_id"] for h in session["hops"]]


def test_a_registration_takes_a_prefix_filter_and_lists_only_whether_it_holds_any(client: TestClient):
    client.post("/v1/nodes", json=registration("a", "0:12", prefix_filter=PrefixFilter.of(HASHES).encode()))
    client.post("/v1/nodes", json=registration("b", "0:12", prefix_filter=PrefixFilter().encode()))  # empty
    client.post("/v1/nodes", json=registration("c", "0:12", prefix_filter=None))
    listed = {n["node_id"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    assert {k: n["holds_prefixes"] for k, n in listed.items()} == {"a": True, "b": False, "c": False}
    assert "prefix_filter" not in listed["a"]  # 2 KiB per node is the router's business


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("not base64!", "a prefix filter is base64: send PrefixFilter.encode()"),
        (base64.b64encode(b"\xff" * 10).decode(), "a prefix filter is 2048 bytes, got 10"),
        ("A" * (FILTER_BITS // 4 + 4), "at most 4096 characters"),
        (12, "valid string"),
    ],
)
def test_a_bad_prefix_filter_is_400_naming_it_and_changes_nothing(client: TestClient, value: object, says: str):
    client.post("/v1/nodes", json=registration("a", "0:12", prefix_filter=PrefixFilter.of(HASHES).encode()))
    bad = client.post("/v1/nodes", json=registration("a", "0:12", kv_bytes_free=5, prefix_filter=value))
    error = assert_error(bad, 400, "invalid_request_error", param="prefix_filter")
    assert says in error["message"]
    [listed] = client.get("/v1/nodes").json()["nodes"]
    assert (listed["kv_bytes_free"], listed["holds_prefixes"]) == (1000, True)


def test_a_session_with_a_prefix_goes_to_the_nodes_holding_it_and_says_how_much(client: TestClient):
    two_chains(client, prefix_filter=PrefixFilter.of(HASHES).encode())
    warm = open_route(client, prefix=prefix_json())
    assert hop_ids(warm) == ["a2", "b2"] and warm["cached_tokens"] == 4 * BLOCK
    cold = open_route(client)
    assert hop_ids(cold) == ["a1", "b1"] and cold["cached_tokens"] == 0
    assert warm["estimated_s"] < cold["estimated_s"]
    stored = client.get(f"/v1/sessions/{warm['session_id']}").json()
    assert "cached_tokens" not in stored  # the choice's snapshot, not persisted


@pytest.mark.parametrize(
    ("prefix", "param", "says"),
    [
        ({"block": 0, "hashes": []}, "prefix.block", "greater than or equal to 1"),
        ({"block": 65537, "hashes": []}, "prefix.block", "less than or equal to 65536"),
        ({"hashes": []}, "prefix.block", "Field required"),
        ({"block": 128}, "prefix.hashes", "Field required"),
        ({"block": 128, "hashes": ["0123456789abcdeg"]}, "prefix.hashes.0", "should match pattern"),
        ({"block": 128, "hashes": [HASHES[0].hex(), "0123"]}, "prefix.hashes.1", "should match pattern"),
        ({"block": 128, "hashes": ["0123456789abcdef"] * 513}, "prefix.hashes", "at most 512 items"),
        ("128:0123456789abcdef", "prefix", "Input should be an object"),
    ],
)
def test_a_bad_prefix_is_400_naming_the_field(client: TestClient, prefix: object, param: str, says: str):
    client.post("/v1/nodes", json=registration("a", "0:12"))
    bad = client.post("/v1/sessions", json={"model": MODEL, "prefix": prefix})
    error = assert_error(bad, 400, "invalid_request_error", param=param)
    assert says in error["message"]
    assert client.get("/v1/sessions").json()["sessions"] == []


def beat_for(client: TestClient, clock: list[float], seconds: float) -> None:
    """``seconds`` pass, every node of ``two_chains`` beating every 5 s without a filter."""
    end = clock[0] + seconds
    while clock[0] < end:
        clock[0] = min(end, clock[0] + 5)
        for name, layers in CHAINS:
            body = registration(name, layers, numerics="fake 1; threads 1")
            assert client.post("/v1/nodes", json=body).status_code == 200


def test_a_closed_sessions_nodes_hold_its_prompt_until_the_hint_expires(client: TestClient, clock: list[float]):
    two_chains(client)  # nobody advertises a filter
    first = open_route(client, prefix=prefix_json(), exclude=["a1"])  # lands on a2 b2
    assert hop_ids(first) == ["a2", "b2"] and first["cached_tokens"] == 0
    unclosed = open_route(client, prefix=prefix_json())  # still open: its nodes hold nothing yet
    assert hop_ids(unclosed) == ["a1", "b1"] and unclosed["cached_tokens"] == 0
    assert client.delete(f"/v1/sessions/{first['session_id']}").status_code == 200
    # The conversation's next turn: the same prompt and more. No heartbeat brought a filter.
    beat_for(client, clock, PREFIX_HINT_S - 1)
    turn = tuple(block_hashes([*PROMPT, *range(400)], BLOCK))
    follow = open_route(client, prefix=prefix_json(turn), prefill_tokens=len(PROMPT) + 400)
    assert hop_ids(follow) == ["a2", "b2"] and follow["cached_tokens"] == 4 * BLOCK
    other = open_route(client, prefix=prefix_json(tuple(block_hashes([9, *PROMPT], BLOCK))))
    assert hop_ids(other) == ["a1", "b1"] and other["cached_tokens"] == 0  # another prompt is not warm there
    # A fresh route like the first session's weighs the hint as well.
    like = open_route(client, prefix=prefix_json(), like_session=first["session_id"])
    assert hop_ids(like) == ["a2", "b2"] and like["cached_tokens"] == 4 * BLOCK
    beat_for(client, clock, 2)  # the hint expired: by now the nodes' own filters would say
    later = open_route(client, prefix=prefix_json())
    assert hop_ids(later) == ["a1", "b1"] and later["cached_tokens"] == 0


def test_hints_are_bounded_per_node_and_in_open_sessions(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tracker_sessions, "_HINTS_PER_NODE", 3)
    monkeypatch.setattr(tracker_sessions, "_PREFIXES_KEPT", 2)
    hints = PrefixHints()
    nodes = [node("a", "0:12"), node("b", "0:12")]
    for sid in ("s1", "s2", "s3"):
        hints.opened(sid, HASHES)
    hints.opened("s4", ())  # no prefix: nothing to remember
    hints.closed("s1", ["a"])  # forgotten: the two latest sessions are kept
    assert hints.apply(nodes, HASHES) == nodes and all(not n.prefix_held for n in hints.apply(nodes, HASHES))
    hints.closed("s3", ["a"])
    held_a, held_b = hints.apply(nodes, HASHES)
    assert held_a.prefix_held == frozenset(HASHES[1:])  # the 3 newest: block 0 went, so no prefix is held
    assert not held_b.prefix_held
    [warm] = select_routes([held_a], MODEL, request=WARM)
    assert warm.cached_tokens == 0
    hints.closed("s3", ["b"])  # already closed: nothing more
    assert not hints.apply(nodes, HASHES)[1].prefix_held


def test_a_namespace_seeds_the_chain_and_the_empty_one_is_the_old_chain():
    tokens = list(range(300))
    plain = block_hashes(tokens, 128)
    assert block_hashes(tokens, 128, namespace=b"") == plain
    alice, bob = block_hashes(tokens, 128, namespace=b"alice"), block_hashes(tokens, 128, namespace=b"bob")
    assert len(alice) == len(bob) == len(plain) == 2
    assert not set(alice) & set(bob) and not set(alice) & set(plain)  # equal prompts, no shared block
