"""The on-disk cache of a shard's load-time bit checks: keyed by file, build, threads and shapes."""

from __future__ import annotations

import os
from pathlib import Path

from meshnet.backends.load_checks import BatchChecks, CheckCache, check_key

SHAPES = {"verify": 12, "decode": 4, "long": 260, "n_batch": 512}


def _shard(tmp_path: Path, body: bytes = b"GGUF" + b"\0" * 64) -> Path:
    path = tmp_path / "shard.gguf"
    path.write_bytes(body)
    return path


def test_a_stored_result_is_read_back_under_the_same_key(tmp_path: Path) -> None:
    cache = CheckCache(tmp_path / "checks")
    key = check_key(_shard(tmp_path), build="b1", threads=2, shapes=SHAPES)
    assert cache.get(key) is None
    found = BatchChecks(verify=(True, False), decode=None)
    cache.put(key, found)
    assert cache.get(key) == found
    assert CheckCache(tmp_path / "checks").get(key) == found  # another process reading the same folder


def test_every_input_of_the_measurement_is_part_of_the_key(tmp_path: Path) -> None:
    shard = _shard(tmp_path)
    base = check_key(shard, build="b1", threads=2, shapes=SHAPES)
    assert check_key(shard, build="b1", threads=2, shapes=dict(SHAPES)) == base
    assert check_key(shard, build="b2", threads=2, shapes=SHAPES) != base
    assert check_key(shard, build="b1", threads=1, shapes=SHAPES) != base
    assert check_key(shard, build="b1", threads=2, shapes={**SHAPES, "decode": 8}) != base
    # another file's content (same size), or the same content rewritten later
    stat = shard.stat()
    shard.write_bytes(b"GGUF" + b"\1" * 64)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert check_key(shard, build="b1", threads=2, shapes=SHAPES) != base


def test_an_unreadable_entry_is_measured_again_and_an_unwritable_folder_is_no_error(tmp_path: Path) -> None:
    cache = CheckCache(tmp_path / "checks")
    key = check_key(_shard(tmp_path), build="b", threads=1, shapes=SHAPES)
    (tmp_path / "checks").mkdir()
    for bad in ("{not json", '{"verify": [1, 2], "decode": null}', '{"verify": null}', "[]"):
        (tmp_path / "checks" / f"{key}.json").write_text(bad)
        assert cache.get(key) is None
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    CheckCache(blocked / "sub").put(key, BatchChecks(verify=None, decode=(True, True)))  # logs, never raises
