"""LayerRange parsing and validation; client-proposed generation ids."""

from __future__ import annotations

import pytest

from meshnet import LayerRange
from meshnet.ids import new_generation_id, new_route_id, new_session_id, parse_generation_id


@pytest.mark.parametrize(
    ("text", "start", "stop"),
    [
        ("10:20", 10, 20),
        ("0:32", 0, 32),
        (":10", 0, 10),
        ("20:", 20, 32),
        (":", 0, 32),
        (" 3 : 7 ", 3, 7),
        ("31:32", 31, 32),
    ],
)
def test_parse_valid(text, start, stop):
    r = LayerRange.parse(text, 32)
    assert (r.start, r.stop, r.total) == (start, stop, 32)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("10", "START:STOP"),
        ("", "START:STOP"),
        ("a:b", "integers"),
        ("1.5:3", "integers"),
        ("1:2:3", "integers"),
        ("20:10", "0 <= start < stop"),
        ("5:5", "0 <= start < stop"),
        ("-1:4", "0 <= start < stop"),
        ("0:33", "0 <= start < stop"),
        ("32:", "0 <= start < stop"),
    ],
)
def test_parse_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        LayerRange.parse(text, 32)


@pytest.mark.parametrize("total", [0, -1])
def test_total_must_be_positive(total):
    with pytest.raises(ValueError, match="at least one layer"):
        LayerRange(0, 1, total)


def test_head_tail_full():
    head = LayerRange(0, 10, 32)
    middle = LayerRange(10, 20, 32)
    tail = LayerRange(20, 32, 32)
    full = LayerRange.full(32)
    assert head.is_head and not head.is_tail and not head.is_full
    assert not middle.is_head and not middle.is_tail and not middle.is_full
    assert tail.is_tail and not tail.is_head and not tail.is_full
    assert full.is_head and full.is_tail and full.is_full
    assert full == LayerRange(0, 32, 32)


def test_len_and_str():
    r = LayerRange(10, 20, 32)
    assert len(r) == 10
    assert str(r) == "10:20"
    assert len(LayerRange.full(1)) == 1
    assert str(LayerRange.full(1)) == "0:1"


def test_str_round_trips_through_parse():
    for r in (LayerRange(0, 4, 4), LayerRange(1, 3, 4), LayerRange(3, 4, 4)):
        assert LayerRange.parse(str(r), r.total) == r


def test_layer_range_is_frozen_and_hashable():
    r = LayerRange(1, 2, 3)
    with pytest.raises(AttributeError):
        r.start = 0  # type: ignore[misc]
    assert {r, LayerRange(1, 2, 3)} == {r}


@pytest.mark.parametrize(
    "raw",
    ["a", "gen-0123abcd", "A.b_c:d-e", "9", "x" * 128, "my-client:req.42"],
)
def test_parse_generation_id_accepts(raw):
    assert parse_generation_id(raw) == raw


@pytest.mark.parametrize(
    "raw",
    ["", "-leading-dash", ".dot", "_under", "has space", "slash/id", "q?x=1", "x" * 129, "é", "a\tb", "a\nb"],
)
def test_parse_generation_id_rejects(raw):
    with pytest.raises(ValueError, match="generation id"):
        parse_generation_id(raw)


def test_parse_generation_id_rejects_trailing_newline():
    with pytest.raises(ValueError):
        parse_generation_id("abc\n")


def test_new_ids_are_prefixed_unique_and_valid():
    gids = {new_generation_id() for _ in range(50)}
    assert len(gids) == 50
    for gid in gids:
        assert gid.startswith("gen-")
        assert parse_generation_id(gid) == gid
    assert new_session_id().startswith("ses-")
    assert new_route_id().startswith("rte-")
