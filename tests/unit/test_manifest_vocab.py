"""The vocabulary artifact: its manifest field, its file (metadata only), and a verified publication."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest

from meshnet.artifacts.manifest import ROLE_VOCAB, ManifestError, canonical_json, parse_manifest
from meshnet.artifacts.vocab import VOCAB_NAME, published_vocab, verify_publication, write_vocab
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from tests.unit.test_manifest import H, valid

TORRENT = b"d4:infod4:name4:tinyee"


def with_vocab(torrent: bytes = TORRENT, **fields: Any) -> dict[str, Any]:
    doc = valid()
    doc["torrent"]["sha256"] = hashlib.sha256(torrent).hexdigest()
    doc["vocab"] = {"name": VOCAB_NAME, "size": 1234, "sha256": "ef" * 32, "pieces_root": H, **fields}
    return doc


def test_a_manifest_with_its_vocabulary_round_trips() -> None:
    doc = with_vocab()
    manifest = parse_manifest(canonical_json(doc))
    assert manifest.to_json() == canonical_json(doc)
    vocab = manifest.vocab
    assert vocab is not None and vocab.role == ROLE_VOCAB and vocab.name == VOCAB_NAME
    assert (vocab.size, vocab.sha256, vocab.tensors, vocab.layers) == (1234, "ef" * 32, (), LayerRange.full(6))
    assert manifest.file(VOCAB_NAME) is vocab and manifest.extra_files == (vocab,)
    # It serves no layer: no range selects it.
    assert VOCAB_NAME not in {f.name for f in manifest.files_for(LayerRange.full(6))}
    # It is part of the identity.
    changed = copy.deepcopy(doc)
    changed["vocab"]["sha256"] = "aa" * 32
    assert parse_manifest(canonical_json(changed)).digest != manifest.digest


def test_a_manifest_published_before_the_vocabulary_still_parses() -> None:
    manifest = parse_manifest(canonical_json(valid()))
    assert manifest.vocab is None and manifest.extra_files == ()


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"sha256": "XYZ"}, "vocab.sha256", "64 lowercase hex"),
        ({"pieces_root": 7}, "vocab.pieces_root", "64 lowercase hex"),
        ({"size": 0}, "vocab.size", "integer >= 1"),
        ({"name": "../vocab.gguf"}, "vocab.name", "plain file name"),
        ({"name": "blk-002-004.gguf"}, "vocab.name", "also one of files"),
        ({"tensors": []}, "vocab.tensors", "unknown field"),
    ],
)
def test_a_bad_vocabulary_field_is_named(fields: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ManifestError, match=problem) as err:
        parse_manifest(canonical_json(with_vocab(**fields)))
    assert err.value.field == field


def test_a_publication_is_its_manifest_and_the_torrent_it_names() -> None:
    data = canonical_json(with_vocab())
    publication = verify_publication(data, TORRENT)
    assert publication.digest == parse_manifest(data).digest
    assert verify_publication(data, TORRENT, expect_digest=publication.digest).torrent == TORRENT
    with pytest.raises(ManifestError, match="does not match") as err:
        verify_publication(data, TORRENT + b" ")
    assert err.value.field == "torrent.sha256"
    with pytest.raises(ManifestError, match="expected sha256:00"):
        verify_publication(data, TORRENT, expect_digest="sha256:" + "00" * 32)


def test_a_published_vocabulary_is_used_only_when_its_bytes_are_the_manifests(tmp_path: Path) -> None:
    body = b"GGUF" + bytes(100)
    doc = with_vocab(size=len(body), sha256=hashlib.sha256(body).hexdigest())
    manifest = parse_manifest(canonical_json(doc))
    folder = tmp_path / manifest.torrent_name
    folder.mkdir()
    assert published_vocab(manifest, tmp_path) is None  # not there: fetch it
    (folder / VOCAB_NAME).write_bytes(body)
    assert published_vocab(manifest, tmp_path) == folder / VOCAB_NAME
    (folder / VOCAB_NAME).write_bytes(b"GGUF" + bytes(99) + b"\1")  # same size, other bytes
    assert published_vocab(manifest, tmp_path) is None


def test_a_manifest_without_a_vocabulary_says_to_publish_again(tmp_path: Path) -> None:
    manifest = parse_manifest(canonical_json(valid()))
    with pytest.raises(InvalidRequest, match="publish the GGUF again, or give the gateway --gguf"):
        published_vocab(manifest, tmp_path)


def test_the_vocabulary_of_a_split_set_is_one_file(tmp_path: Path) -> None:
    """The first part of a split set carries split.*: the artifact drops them (llama.cpp would look for parts)."""
    import gguf
    import numpy as np

    first = tmp_path / "m-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(first), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_int32("split.tensors.count", 3)
    writer.add_uint32("llama.context_length", 4096)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written = gguf.GGUFReader(str(write_vocab(gguf.GGUFReader(str(first)), tmp_path / VOCAB_NAME)))
    assert len(written.tensors) == 0
    assert not [n for n in written.fields if n.startswith("split.")]
    assert written.fields["llama.context_length"].contents() == 4096
    assert written.fields["general.architecture"].contents() == "llama"


@pytest.mark.real
def test_the_vocabulary_file_holds_the_metadata_and_loads_vocab_only(tmp_path: Path) -> None:
    import gguf

    from meshnet.artifacts.bundled import bundled_gguf
    from meshnet.backends.llama_vocab import LlamaVocab

    source = gguf.GGUFReader(str(bundled_gguf()))
    path = write_vocab(source, tmp_path / VOCAB_NAME)
    written = gguf.GGUFReader(str(path))
    assert len(written.tensors) == 0 and len(source.tensors) > 0
    kept = {n: f.contents() for n, f in written.fields.items() if not n.startswith("GGUF.")}
    assert kept == {n: f.contents() for n, f in source.fields.items() if not n.startswith("GGUF.")}
    assert path.stat().st_size < bundled_gguf().stat().st_size / 20
    assert sorted(p.name for p in tmp_path.iterdir()) == [VOCAB_NAME]  # no partial file left behind
    small, full = LlamaVocab(path, model_id="m"), LlamaVocab(bundled_gguf(), model_id="m")
    try:
        text = "<|im_start|>user\nWhat is 2+2? Ünïcödé 🚀<|im_end|>"
        assert small.tokenize(text, add_special=True) == full.tokenize(text, add_special=True)
        assert all(small.token_bytes(t) == full.token_bytes(t) for t in range(full.info.n_vocab))
        facts = ("architecture", "quantization", "n_layers", "n_ctx_train", "n_vocab", "hidden_size", "chat_template",
                 "bos_token", "eos_token")  # fmt: skip
        for field in facts:
            assert getattr(small.info, field) == getattr(full.info, field), field
    finally:
        small.close()
        full.close()
