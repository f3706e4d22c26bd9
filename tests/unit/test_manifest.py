"""The manifest parser: canonical identity, strict errors that name the field, range → file selection."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from meshnet.artifacts.manifest import ManifestError, canonical_json, digest_of, parse_manifest
from meshnet.artifacts.plan import plan, read_shape
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange

H = "ab" * 32
INFO_HASH = "cd" * 32


def _file(name: str, layers: str, role: str = "shard", tensors: list[str] | None = None) -> dict[str, Any]:
    start = int(layers.split(":", maxsplit=1)[0])
    return {"name": name, "size": 1000, "sha256": H, "pieces_root": H, "role": role, "layers": layers,
            "tensors": tensors or [f"blk.{start}.attn_q.weight"]}  # fmt: skip


def valid() -> dict[str, Any]:
    files = [
        _file("blk-000-002.gguf", "0:2"),
        _file("blk-000-002.embd.gguf", "0:2", "embeddings", ["token_embd.weight"]),
        _file("blk-002-004.gguf", "2:4"),
        _file("blk-004-006.gguf", "4:6", tensors=["blk.5.ffn_up.weight", "output_norm.weight"]),
    ]
    return {
        "schema": "meshnet.manifest/1",
        "model": {"id": "tiny", "version": "1"},
        "source": {"repo": "org/tiny", "revision": "abc123"},
        "license": "apache-2.0",
        "architecture": "llama",
        "layers": 6,
        "layer_map": [
            {"layers": "0:2", "files": ["blk-000-002.gguf", "blk-000-002.embd.gguf"]},
            {"layers": "2:4", "files": ["blk-002-004.gguf"]},
            {"layers": "4:6", "files": ["blk-004-006.gguf"]},
        ],
        "files": files,
        "tokenizer": {"model": "gpt2", "files": ["blk-004-006.gguf"], "sha256": H, "vocab_size": 100},
        "quantization": {"file_type": "Q4_1", "tensor_types": {"Q4_1": 10, "F32": 3}},
        "gguf_splits": [{"name": "tiny.gguf", "size": 4000, "sha256": H}],
        "backends": ["llama.cpp"],
        "context_cap": 2048,
        "kv_cache": {"kind": "gqa", "dtype": "f16", "bytes_per_token_per_layer": 768, "per_layer": [768] * 6,
                     "hidden": 576, "kv_heads": 3, "head_dim": 64, "kv_lora_rank": 0, "qk_rope_head_dim": 0},
        "torrent": {"file": "model.torrent", "sha256": H, "info_hash_v2": INFO_HASH,
                    "magnet": f"magnet:?xt=urn:btmh:1220{INFO_HASH}&dn=tiny", "piece_length": 1 << 20, "name": "tiny"},
        "web_seeds": ["http://127.0.0.1:8090/"],
    }  # fmt: skip


def test_a_valid_manifest_parses_and_its_digest_is_the_canonical_json_hash() -> None:
    doc = valid()
    manifest = parse_manifest(json.dumps(doc, indent=2))  # whitespace does not change the identity
    assert manifest.digest == digest_of(doc) == parse_manifest(canonical_json(doc)).digest
    assert manifest.digest.startswith("sha256:") and len(manifest.digest) == 7 + 64
    assert manifest.to_json() == canonical_json(doc)
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    assert manifest.boundaries == (0, 2, 4, 6)
    changed = copy.deepcopy(doc)
    changed["license"] = "mit"
    assert parse_manifest(canonical_json(changed)).digest != manifest.digest


def test_a_range_selects_only_its_files() -> None:
    manifest = parse_manifest(canonical_json(valid()))
    names = lambda text: [f.name for f in manifest.files_for(LayerRange.parse(text, 6))]  # noqa: E731
    assert names("2:4") == ["blk-002-004.gguf"]
    assert names("0:2") == ["blk-000-002.gguf", "blk-000-002.embd.gguf"]
    assert names("2:6") == ["blk-002-004.gguf", "blk-004-006.gguf"]
    with pytest.raises(InvalidRequest, match="published boundaries 0, 2, 4, 6") as err:
        manifest.files_for(LayerRange.parse("1:4", 6))
    assert err.value.param == "layers"
    with pytest.raises(InvalidRequest, match="6 layers"):
        manifest.parse_layers("4:9")


def _broken(edit: Any) -> ManifestError:
    doc = valid()
    edit(doc)
    with pytest.raises(ManifestError) as err:
        parse_manifest(canonical_json(doc))
    return err.value


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda d: d.pop("license"), "license", "missing field"),
        (lambda d: d["model"].pop("version"), "model.version", "missing field"),
        (lambda d: d["files"][2].pop("sha256"), "files[2].sha256", "missing field"),
        (lambda d: d.update(extra=1), "extra", "unknown field"),
        (lambda d: d["files"][2].update(sha256="XYZ"), "files[2].sha256", "64 lowercase hex"),
        (lambda d: d["files"][0].update(pieces_root=H[:-2]), "files[0].pieces_root", "64 lowercase hex"),
        (lambda d: d["torrent"].update(info_hash_v2="00"), "torrent.info_hash_v2", "64 lowercase hex"),
        (lambda d: d["torrent"].update(magnet="magnet:?xt=urn:btih:00"), "torrent.magnet", "info_hash_v2"),
        (lambda d: d.update(architecture="notanarch"), "architecture", "unknown architecture 'notanarch'"),
        (lambda d: d.update(schema="meshnet.manifest/9"), "schema", "is not"),
        (lambda d: d["layer_map"].pop(1), "layer_map[1].layers", "gap: no file serves layers 2:4"),
        (lambda d: d["layer_map"].pop(2), "layer_map", "gap: no file serves layers 4:6"),
        (lambda d: d["layer_map"][1].update(layers="1:4"), "layer_map[1].layers", "overlap: layers 1:2"),
        (lambda d: d["layer_map"][1].update(files=["nope.gguf"]), "layer_map[1].files[0]", "not in files"),
        (lambda d: d["files"][2].update(tensors=["blk.7.attn_q.weight"]), "files[2].tensors[0]", "outside"),
        (lambda d: d["files"][1].update(name="../x"), "files[1].name", "plain file name"),
        (lambda d: d["files"][3].update(size=-1), "files[3].size", "integer >= 1"),
        (lambda d: d["files"][3].update(layers="4-6"), "files[3].layers", "START:STOP"),
        (lambda d: d["kv_cache"].update(per_layer=[768] * 5), "kv_cache.per_layer", "5 entries for 6 layers"),
        (lambda d: d["kv_cache"].update(kind="ssm"), "kv_cache.kind", "not one of"),
        (lambda d: d["tokenizer"].update(files=["x.gguf"]), "tokenizer.files[0]", "not in files"),
        (lambda d: d.update(web_seeds=["ftp://x/"]), "web_seeds[0]", "http"),
        (lambda d: d.update(layers=True), "layers", "integer"),
    ],
)
def test_malformed_manifests_name_the_field(edit: Any, field: str, words: str) -> None:
    err = _broken(edit)
    assert err.param == field and err.field == field
    assert words in err.message and f"manifest field {field!r}" in err.message


def test_not_json_and_a_pinned_digest_are_checked() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b"{")
    good = canonical_json(valid())
    assert parse_manifest(good, expect_digest=digest_of(valid())).model_id == "tiny"
    with pytest.raises(ManifestError, match="expected sha256:00"):
        parse_manifest(good, expect_digest="sha256:" + "0" * 64)


def test_plan_reads_a_manifest(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(canonical_json(valid()))
    shape = read_shape(path)
    assert (shape.name, shape.layers, shape.hidden, shape.kind) == ("tiny", 6, 576, "gqa")
    assert shape.kv_bytes_per_token_per_layer == 768  # the manifest's own kv_cache figure
    assert plan(shape, context=1024, layers=LayerRange(2, 4, 6)).shard_at_context == 768 * 2 * 1024
