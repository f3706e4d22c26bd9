"""A GGUF as published: llama.cpp split sets read whole, tensors streamed, offsets past 4 GiB.

The split sets are written by gguf-py's own splitter (``GGUFWriter(split_max_size=...)``) from the
bundled model, so every check runs on real files in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any, cast

import gguf
import numpy as np
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.gguf_header import read_header
from meshnet.artifacts.gguf_source import TensorBytes, model_stem, open_gguf, split_parts
from meshnet.artifacts.identity import gguf_identity
from meshnet.artifacts.publish import PublishOptions, publish
from meshnet.artifacts.shard_file import _write_gguf, write_shard
from meshnet.cli.node_run import _model_facts
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from tests.realmodels import write_split


@pytest.fixture(scope="module")
def split_set(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_split(bundled_gguf(), tmp_path_factory.mktemp("split"), 30 << 20)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_split_set_is_every_part_and_names_the_model_like_the_whole_file(split_set: list[Path]) -> None:
    whole, parts = open_gguf(bundled_gguf()), open_gguf(split_set[0])
    assert len(split_set) == 4 and parts.parts == tuple(split_set) == split_parts(split_set[0])
    assert [t.name for t in parts.tensors] == [t.name for t in whole.tensors]
    assert {t.path for t in parts.tensors} == set(split_set)  # tensors of every part, not the first alone
    assert model_stem(split_set[0]) == model_stem(bundled_gguf()) == "SmolLM2-135M-Instruct.Q4_1"
    for a, b in zip(whole.tensors, parts.tensors, strict=True):
        assert (a.shape, a.dtype, a.tensor_type, a.nbytes) == (b.shape, b.dtype, b.tensor_type, b.nbytes)
    assert {t.name: t.read() for t in parts.tensors[-3:]} == {t.name: t.read() for t in whole.tensors[-3:]}


def test_a_split_set_has_the_identity_of_the_model_as_one_file(split_set: list[Path]) -> None:
    """What a ``--gguf`` node advertises reads every part (cli.node_run): the set's nodes and the
    whole file's may share a route, one model, whichever range each holds."""
    whole = gguf_identity(bundled_gguf())
    assert gguf_identity(split_set[0]) == whole
    for layers in (LayerRange(0, 10, 30), LayerRange(20, 30, 30)):
        trained, identity, kv_per_token = _model_facts(split_set[0], layers)
        assert (trained, identity, kv_per_token) == _model_facts(bundled_gguf(), layers)
        assert identity == whole and trained == 8192 and kv_per_token > 0


def test_shards_cut_from_a_split_set_are_the_bytes_cut_from_the_whole_file(
    split_set: list[Path], tmp_path: Path
) -> None:
    for layers in ("0:10", "10:20", "20:30"):
        a = write_shard(bundled_gguf(), layers, tmp_path / f"whole-{layers[0]}.gguf")
        b = write_shard(split_set[0], layers, tmp_path / f"split-{layers[0]}.gguf")
        assert b.tensors == a.tensors == 92 and _sha(a.path) == _sha(b.path)
        fields = read_header(b.path).fields
        assert not any(k.startswith("split.") for k in fields)  # a shard is one file, never part of a set
        if b.embeddings is not None:
            assert a.embeddings is not None and _sha(a.embeddings) == _sha(b.embeddings)


def test_the_cli_cuts_and_plans_a_split_set_by_its_first_file(
    split_set: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``meshnet shard make`` and ``meshnet plan`` take a split set's first file like a whole GGUF."""
    from meshnet.cli.main import main

    out = tmp_path / "tail.gguf"
    assert main(["shard", "make", "--gguf", str(split_set[0]), "--layers", "20:30", "--out", str(out)]) == 0
    assert _sha(out) == _sha(write_shard(bundled_gguf(), "20:30", tmp_path / "whole-tail.gguf").path)
    assert "tail shard, layers 20:30 of 30, 92 tensors" in capsys.readouterr().out
    assert main(["plan", str(split_set[0]), "--context", "4096"]) == 0
    of_split = capsys.readouterr().out
    assert main(["plan", str(bundled_gguf()), "--context", "4096"]) == 0
    assert of_split == capsys.readouterr().out and "30" in of_split


def test_the_lean_header_reads_what_gguf_py_reads() -> None:
    reader, header = gguf.GGUFReader(str(bundled_gguf())), read_header(bundled_gguf())
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    assert keys == set(header.fields)
    for key in keys:
        assert header.fields[key].contents() == reader.fields[key].contents(), key
        assert header.fields[key].types == tuple(reader.fields[key].types), key
        assert header.fields[key].raw == b"".join(p.tobytes() for p in reader.fields[key].parts), key
    assert [(t.name, t.offset) for t in header.tensors] == [(t.name, int(t.data_offset)) for t in reader.tensors]


def test_publishing_a_split_set_lists_every_part_and_publishes_the_whole_files_shards(
    split_set: list[Path], tmp_path: Path
) -> None:
    opts = PublishOptions(ranges="0:10,10:20,20:30")
    whole = publish(bundled_gguf(), tmp_path / "whole", opts)
    split = publish(split_set[0], tmp_path / "split", opts)
    assert split.model_id == whole.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert [(f.name, f.sha256) for f in split.files] == [(f.name, f.sha256) for f in whole.files]
    doc = json.loads((tmp_path / "split" / "manifest.json").read_bytes())
    assert [(s["name"], s["size"], s["sha256"]) for s in doc["gguf_splits"]] == [
        (p.name, p.stat().st_size, _sha(p)) for p in split_set
    ]
    assert doc["tokenizer"] == json.loads((tmp_path / "whole" / "manifest.json").read_bytes())["tokenizer"]


def test_a_missing_or_foreign_part_is_an_error_naming_the_file(split_set: list[Path], tmp_path: Path) -> None:
    folder = tmp_path / "set"
    folder.mkdir()
    for part in split_set:
        os.link(part, folder / part.name)
    third = folder / split_set[2].name
    third.unlink()
    with pytest.raises(InvalidRequest, match=f"part 3 of 4 .* is missing: {third}"):
        open_gguf(folder / split_set[0].name)
    with pytest.raises(InvalidRequest, match=f"{split_set[1].name} is part 2 of a 4-file split GGUF; pass its first"):
        open_gguf(split_set[1])
    os.link(split_set[3], third)  # part 4 posing as part 3
    with pytest.raises(InvalidRequest, match=f"{third} does not belong .* split.no 3 of split.count 4"):
        open_gguf(folder / split_set[0].name)
    with pytest.raises(InvalidRequest, match="missing"):
        write_shard(folder / "absent-00001-of-00004.gguf", "0:10", tmp_path / "x.gguf")


def test_a_truncated_part_is_an_error_naming_it(split_set: list[Path], tmp_path: Path) -> None:
    folder = tmp_path / "cut"
    folder.mkdir()
    for part in split_set:
        (folder / part.name).write_bytes(part.read_bytes())
    last = folder / split_set[-1].name
    os.truncate(last, last.stat().st_size - 4096)
    with pytest.raises(InvalidRequest, match=f"{last} ends inside tensor"):
        open_gguf(folder / split_set[0].name)


class _Hole:
    """Tensor data GGUFWriter writes as a hole (a seek): a multi-GiB file that costs no disk."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def tofile(self, out: IO[bytes]) -> None:
        out.seek(self.nbytes, os.SEEK_CUR)


def test_tensors_past_4_gib_are_found_and_copied_exactly(tmp_path: Path) -> None:
    big = (1 << 30) + 8  # float32 elements: 4 GiB + 32 bytes, all a hole
    tail = np.arange(4096, dtype=np.float32) * np.float32(0.5)
    path = tmp_path / "sparse.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor_info("blk.0.hole.weight", (big,), np.dtype(np.float32), big * 4, gguf.GGMLQuantizationType.F32)
    writer.add_tensor_info("blk.0.tail.weight", tail.shape, tail.dtype, tail.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_tensor_data(cast(Any, _Hole(big * 4)))
    writer.write_tensor_data(tail)
    writer.close()
    assert path.stat().st_size > 1 << 32 and path.stat().st_blocks * 512 < 64 << 20  # sparse

    source = open_gguf(path)
    hole, found = source.tensors
    assert hole.nbytes == big * 4 and found.offset > 1 << 32 and found.offset == hole.offset + hole.nbytes
    assert found.read() == tail.tobytes()
    reference = gguf.GGUFReader(str(path)).tensors[1]
    assert int(reference.data_offset) == found.offset and np.array_equal(reference.data, tail)

    copy = tmp_path / "copy.gguf"
    _write_gguf(copy, "llama", lambda w: None, [(found.name, found)], source.endianess)
    (back,) = gguf.GGUFReader(str(copy)).tensors
    assert back.name == found.name and np.array_equal(back.data, tail)


def test_tensor_bytes_stream_in_bounded_chunks(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    data = os.urandom(3 * (1 << 20) + 123)
    path.write_bytes(b"x" * 77 + data)
    tensor = TensorBytes("t", (len(data),), np.dtype(np.uint8), gguf.GGMLQuantizationType.I8, path, 77, len(data))
    out = tmp_path / "out"
    with out.open("wb") as f:
        tensor.tofile(f)
    assert out.read_bytes() == data and tensor.first_rows(10).read() == data[:10]
