"""The web seed server answers Range requests (what BEP 19 needs) and stays inside its folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshnet.artifacts.publish import split_ranges
from meshnet.artifacts.webseed import RangeServer
from meshnet.errors import InvalidRequest

DATA = bytes(range(256)) * 40


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.bin").write_bytes(DATA)
    (tmp_path.parent / "secret.txt").write_text("no")
    web = RangeServer(tmp_path).start()
    try:
        yield web.url
    finally:
        web.close()


def test_ranges_are_answered_206(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as client:
        whole = client.get("m/a.bin")
        assert whole.status_code == 200 and whole.content == DATA
        assert whole.headers["accept-ranges"] == "bytes"
        part = client.get("m/a.bin", headers={"Range": "bytes=100-299"})
        assert part.status_code == 206 and part.content == DATA[100:300]
        assert part.headers["content-range"] == f"bytes 100-299/{len(DATA)}"
        assert client.get("m/a.bin", headers={"Range": "bytes=10000-"}).content == DATA[10000:]
        assert client.get("m/a.bin", headers={"Range": "bytes=-5"}).content == DATA[-5:]
        assert client.get("m/a.bin", headers={"Range": f"bytes={len(DATA)}-"}).status_code == 416
        assert client.head("m/a.bin").headers["content-length"] == str(len(DATA))


def test_paths_outside_the_folder_are_not_served(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as client:
        assert client.get("../secret.txt").status_code == 404
        assert client.get("%2e%2e/secret.txt").status_code == 404
        assert client.get("m/missing.bin").status_code == 404


def test_publish_ranges() -> None:
    assert [str(r) for r in split_ranges(30, layers_per_file=10)] == ["0:10", "10:20", "20:30"]
    assert [str(r) for r in split_ranges(7, layers_per_file=3)] == ["0:3", "3:6", "6:7"]
    # A family that lets ranges start only at some layers: each file ends at the next allowed start.
    assert [str(r) for r in split_ranges(12, layers_per_file=3, starts=[0, 4, 8])] == ["0:4", "4:8", "8:12"]
    assert [str(r) for r in split_ranges(6, layers_per_file=2, starts=[0, 1, 2, 4])] == ["0:2", "2:4", "4:6"]
    assert [str(r) for r in split_ranges(30, ranges="0:5,5:30")] == ["0:5", "5:30"]
    for bad, words in (("0:5,6:30", "gap"), ("0:5,4:30", "overlap"), ("0:5,5:20", "end at layer 30")):
        with pytest.raises(InvalidRequest, match=words):
            split_ranges(30, ranges=bad)
