"""The model manifest: a content address for every file of a published model, and its identity.

A manifest is canonical JSON (sorted keys, no whitespace, UTF-8, integers and strings only); the
SHA-256 of those bytes, written ``sha256:<hex>``, is the model's identity on the wire. The parser
is strict: every field is required, unknown fields are refused, and every error is a
:class:`ManifestError` whose ``param`` names the field at fault (``files[2].sha256``,
``layer_map[1].layers``). Schema (``meshnet.manifest/1``), in the order a reader needs it:

- ``model`` {id, version}; ``source`` {repo, revision}; ``license``; ``architecture``;
- ``layers``: the model's block count; ``layer_map``: the published layer ranges, contiguous from 0
  to ``layers`` (no gap, no overlap), each naming the files that serve it;
- ``files``: per file its name, size, SHA-256, BitTorrent v2 merkle root (``pieces_root``), role
  (``shard`` or ``embeddings``), layer range and the source tensors it holds — the tensor-to-layer map;
- ``tokenizer`` {model, files, sha256 of the tokenizer metadata, vocab_size}; ``quantization``
  {file_type, tensor_types}; ``gguf_splits``: the upstream GGUF file(s) the files were cut from;
- ``backends``: runtimes that load the files directly; ``context_cap``; ``kv_cache``: the KV
  format (kind, dtype, bytes per token per layer, the per-layer list, the shape it comes from);
- ``torrent`` {file, sha256, info_hash_v2, magnet, piece_length, name}; ``web_seeds``: BEP 19 URLs;
- ``vocab`` {name, size, sha256, pieces_root}: the vocabulary artifact (artifacts.vocab), a file of the
  torrent beside the shard files. The one optional field: a manifest published before it existed
  parses with ``vocab`` None (its nodes still serve; a gateway needs ``--gguf`` for it).

Pure: no I/O beyond :func:`read_manifest`; everything else works on values.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.models.families import KNOWN_ARCHITECTURES

__all__ = [
    "KNOWN_ARCHITECTURES",
    "MANIFEST_NAME",
    "ROLE_EMBEDDINGS",
    "ROLE_SHARD",
    "ROLE_VOCAB",
    "SCHEMA",
    "FileEntry",
    "KVCache",
    "Manifest",
    "ManifestError",
    "canonical_json",
    "digest_of",
    "parse_manifest",
    "read_manifest",
]

SCHEMA = "meshnet.manifest/1"
MANIFEST_NAME = "manifest.json"
ROLE_SHARD = "shard"
ROLE_EMBEDDINGS = "embeddings"
ROLE_VOCAB = "vocab"  # the manifest's ``vocab`` file: metadata only, no layer, no tensor
KV_KINDS = ("gqa", "mla")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

T = TypeVar("T")


class ManifestError(InvalidRequest):
    """A manifest that does not parse or does not hold together; ``param`` names the field."""

    code = "invalid_manifest"

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"manifest field {field!r}: {problem}", param=field)
        self.field = field


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def digest_of(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(value)).hexdigest()


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    size: int
    sha256: str
    pieces_root: str  # BitTorrent v2 merkle root of the file: a content address independent of piece size
    role: str  # "shard" (a loadable layer-range GGUF), "embeddings" (the head's token table) or "vocab"
    layers: LayerRange
    tensors: tuple[str, ...]  # source tensor names it holds


@dataclass(frozen=True, slots=True)
class KVCache:
    kind: str  # "gqa" (K and V per KV head) or "mla" (one latent + the RoPE key)
    dtype: str
    bytes_per_token_per_layer: int
    per_layer: tuple[int, ...]
    hidden: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int


@dataclass(frozen=True, slots=True)
class Manifest:
    model_id: str
    model_version: str
    source_repo: str
    source_revision: str
    license: str
    architecture: str
    layers: int
    layer_map: tuple[tuple[LayerRange, tuple[str, ...]], ...]
    files: tuple[FileEntry, ...]
    tokenizer: Mapping[str, Any]
    quantization: Mapping[str, Any]
    gguf_splits: tuple[Mapping[str, Any], ...]
    backends: tuple[str, ...]
    context_cap: int
    kv_cache: KVCache
    torrent_file: str
    torrent_sha256: str
    info_hash_v2: str
    magnet: str
    piece_length: int
    torrent_name: str
    web_seeds: tuple[str, ...]
    digest: str  # sha256 of the canonical JSON: the model's identity
    raw: Mapping[str, Any]
    vocab: FileEntry | None = None  # the vocabulary artifact (None: published before it existed)

    @property
    def boundaries(self) -> tuple[int, ...]:
        return (0, *(r.stop for r, _ in self.layer_map))

    def file(self, name: str) -> FileEntry:
        """A file of the torrent by name: a layer file, or the vocabulary artifact."""
        return next(f for f in (*self.files, *self.extra_files) if f.name == name)

    @property
    def extra_files(self) -> tuple[FileEntry, ...]:
        """Files of the torrent that serve no layer range (the vocabulary artifact)."""
        return () if self.vocab is None else (self.vocab,)

    def parse_layers(self, text: str | None) -> LayerRange:
        if not text:
            return LayerRange.full(self.layers)
        try:
            return LayerRange.parse(text, self.layers)
        except ValueError as exc:
            raise InvalidRequest(f"{exc} (the model has {self.layers} layers)", param="layers") from None

    def groups_for(self, layers: LayerRange) -> tuple[tuple[LayerRange, tuple[str, ...]], ...]:
        """The published ranges whose union is ``layers``; an error names the boundaries otherwise."""
        bounds = self.boundaries
        if layers.total != self.layers:
            raise InvalidRequest(f"layers {layers} assume {layers.total} blocks; the manifest has {self.layers}")
        if layers.start not in bounds or layers.stop not in bounds:
            raise InvalidRequest(
                f"layers {layers} are not a union of published ranges: pick START and STOP from the "
                f"published boundaries {', '.join(map(str, bounds))}",
                param="layers",
            )
        return tuple(g for g in self.layer_map if layers.start <= g[0].start and g[0].stop <= layers.stop)

    def files_for(self, layers: LayerRange) -> tuple[FileEntry, ...]:
        return tuple(self.file(name) for _, names in self.groups_for(layers) for name in names)

    def to_json(self) -> bytes:
        return canonical_json(self.raw)


# -- parsing ---------------------------------------------------------------------------------------
def read_manifest(path: Path, *, expect_digest: str | None = None) -> Manifest:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"cannot read manifest {path}: {exc.strerror or exc}", param="manifest") from None
    return parse_manifest(data, expect_digest=expect_digest)


def parse_manifest(data: bytes | str, *, expect_digest: str | None = None) -> Manifest:
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError("(document)", f"not valid JSON: {exc}") from None
    manifest = _Parser(raw).manifest()
    if expect_digest is not None and manifest.digest != expect_digest:
        raise ManifestError("(digest)", f"the manifest's digest is {manifest.digest}, expected {expect_digest}")
    return manifest


class _Parser:
    def __init__(self, raw: Any) -> None:
        self.raw = raw

    # -- typed getters: each names the field it reads --------------------------------------------
    def obj(self, value: Any, field: str, keys: Sequence[str], optional: Sequence[str] = ()) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise ManifestError(field or "(document)", "must be a JSON object")
        for key in keys:
            if key not in value:
                raise ManifestError(_join(field, key), "missing field")
        extra = sorted(set(value) - set(keys) - set(optional))
        if extra:
            raise ManifestError(_join(field, extra[0]), "unknown field")
        return value

    def str_(self, value: Any, field: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value):
            raise ManifestError(field, "must be a non-empty string" if not empty else "must be a string")
        return value

    def int_(self, value: Any, field: str, *, minimum: int = 1) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ManifestError(field, f"must be an integer >= {minimum}")
        return value

    def hex64(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not _HEX64.match(value):
            raise ManifestError(field, "must be 64 lowercase hex digits (a SHA-256)")
        return value

    def list_(self, value: Any, field: str, item: Callable[[Any, str], T], *, empty: bool = False) -> tuple[T, ...]:
        if not isinstance(value, list) or (not empty and not value):
            raise ManifestError(field, "must be a non-empty list" if not empty else "must be a list")
        return tuple(item(v, f"{field}[{i}]") for i, v in enumerate(value))

    def name(self, value: Any, field: str) -> str:
        text = self.str_(value, field)
        if not _SAFE_NAME.match(text) or ".." in text:
            raise ManifestError(field, f"{text!r} is not a plain file name ([A-Za-z0-9._-], no path)")
        return text

    def range_(self, value: Any, field: str, total: int) -> LayerRange:
        text = self.str_(value, field)
        start, sep, stop = text.partition(":")
        try:
            if not sep:
                raise ValueError
            return LayerRange(int(start), int(stop), total)
        except ValueError:
            raise ManifestError(field, f"{text!r} is not a layer range START:STOP within 0:{total}") from None

    # -- the document ----------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        doc = self.obj(self.raw, "", _TOP_KEYS, optional=("vocab",))
        if doc["schema"] != SCHEMA:
            raise ManifestError("schema", f"{doc['schema']!r} is not {SCHEMA!r}")
        model = self.obj(doc["model"], "model", ("id", "version"))
        source = self.obj(doc["source"], "source", ("repo", "revision"))
        arch = self.str_(doc["architecture"], "architecture")
        if arch not in KNOWN_ARCHITECTURES:
            raise ManifestError(
                "architecture", f"unknown architecture {arch!r} (known: {', '.join(KNOWN_ARCHITECTURES)})"
            )
        total = self.int_(doc["layers"], "layers")
        files = self.list_(doc["files"], "files", lambda v, f: self.file(v, f, total))
        by_name = {f.name: f for f in files}
        if len(by_name) != len(files):
            dup = next(f.name for f in files if sum(g.name == f.name for g in files) > 1)
            raise ManifestError("files", f"file {dup!r} is listed twice")
        layer_map = self.layer_map(doc["layer_map"], total, by_name)
        torrent = self.obj(doc["torrent"], "torrent", _TORRENT_KEYS)
        tokenizer = self.obj(doc["tokenizer"], "tokenizer", ("files", "model", "sha256", "vocab_size"))
        for i, name in enumerate(self.list_(tokenizer["files"], "tokenizer.files", self.name)):
            if name not in by_name:
                raise ManifestError(f"tokenizer.files[{i}]", f"{name!r} is not in files")
        self.hex64(tokenizer["sha256"], "tokenizer.sha256")
        self.int_(tokenizer["vocab_size"], "tokenizer.vocab_size")
        quant = self.obj(doc["quantization"], "quantization", ("file_type", "tensor_types"))
        self.str_(quant["file_type"], "quantization.file_type")
        if not isinstance(quant["tensor_types"], dict) or not quant["tensor_types"]:
            raise ManifestError("quantization.tensor_types", "must be a non-empty object of type -> tensor count")
        splits = self.list_(doc["gguf_splits"], "gguf_splits", self.split)
        vocab = self.vocab(doc["vocab"], total) if "vocab" in doc else None
        if vocab is not None and vocab.name in by_name:
            raise ManifestError("vocab.name", f"{vocab.name!r} is also one of files")
        return Manifest(
            model_id=self.str_(model["id"], "model.id"),
            model_version=self.str_(model["version"], "model.version"),
            source_repo=self.str_(source["repo"], "source.repo", empty=True),
            source_revision=self.str_(source["revision"], "source.revision", empty=True),
            license=self.str_(doc["license"], "license", empty=True),
            architecture=arch,
            layers=total,
            layer_map=layer_map,
            files=files,
            tokenizer=tokenizer,
            quantization=quant,
            gguf_splits=splits,
            backends=self.list_(doc["backends"], "backends", self.str_),
            context_cap=self.int_(doc["context_cap"], "context_cap"),
            kv_cache=self.kv_cache(doc["kv_cache"], total),
            torrent_file=self.name(torrent["file"], "torrent.file"),
            torrent_sha256=self.hex64(torrent["sha256"], "torrent.sha256"),
            info_hash_v2=self.hex64(torrent["info_hash_v2"], "torrent.info_hash_v2"),
            magnet=self.magnet(torrent["magnet"], torrent["info_hash_v2"]),
            piece_length=self.int_(torrent["piece_length"], "torrent.piece_length", minimum=16384),
            torrent_name=self.name(torrent["name"], "torrent.name"),
            web_seeds=self.list_(doc["web_seeds"], "web_seeds", self.url, empty=True),
            digest=digest_of(self.raw),
            raw=self.raw,
            vocab=vocab,
        )

    def vocab(self, value: Any, total: int) -> FileEntry:
        entry = self.obj(value, "vocab", ("name", "pieces_root", "sha256", "size"))
        return FileEntry(
            name=self.name(entry["name"], "vocab.name"),
            size=self.int_(entry["size"], "vocab.size"),
            sha256=self.hex64(entry["sha256"], "vocab.sha256"),
            pieces_root=self.hex64(entry["pieces_root"], "vocab.pieces_root"),
            role=ROLE_VOCAB,
            layers=LayerRange.full(total),
            tensors=(),
        )

    def file(self, value: Any, field: str, total: int) -> FileEntry:
        entry = self.obj(value, field, ("layers", "name", "pieces_root", "role", "sha256", "size", "tensors"))
        role = self.str_(entry["role"], f"{field}.role")
        if role not in (ROLE_SHARD, ROLE_EMBEDDINGS):
            raise ManifestError(f"{field}.role", f"{role!r} is not {ROLE_SHARD!r} or {ROLE_EMBEDDINGS!r}")
        layers = self.range_(entry["layers"], f"{field}.layers", total)
        tensors = self.list_(entry["tensors"], f"{field}.tensors", self.str_)
        for i, tensor in enumerate(tensors):
            match = _BLOCK.match(tensor)
            if match and not layers.start <= int(match.group(1)) < layers.stop:
                raise ManifestError(f"{field}.tensors[{i}]", f"{tensor} lies outside the file's layers {layers}")
        return FileEntry(
            name=self.name(entry["name"], f"{field}.name"),
            size=self.int_(entry["size"], f"{field}.size"),
            sha256=self.hex64(entry["sha256"], f"{field}.sha256"),
            pieces_root=self.hex64(entry["pieces_root"], f"{field}.pieces_root"),
            role=role,
            layers=layers,
            tensors=tensors,
        )

    def layer_map(
        self, value: Any, total: int, files: Mapping[str, FileEntry]
    ) -> tuple[tuple[LayerRange, tuple[str, ...]], ...]:
        groups: list[tuple[LayerRange, tuple[str, ...]]] = []
        expected = 0
        for i, item in enumerate(self.list_(value, "layer_map", lambda v, f: v)):
            field = f"layer_map[{i}]"
            entry = self.obj(item, field, ("files", "layers"))
            layers = self.range_(entry["layers"], f"{field}.layers", total)
            if layers.start > expected:
                raise ManifestError(f"{field}.layers", f"gap: no file serves layers {expected}:{layers.start}")
            if layers.start < expected:
                raise ManifestError(f"{field}.layers", f"overlap: layers {layers.start}:{expected} are served twice")
            names = self.list_(entry["files"], f"{field}.files", self.name)
            for j, name in enumerate(names):
                entry_file = files.get(name)
                if entry_file is None:
                    raise ManifestError(f"{field}.files[{j}]", f"{name!r} is not in files")
                if entry_file.layers != layers:
                    raise ManifestError(f"{field}.files[{j}]", f"{name} holds layers {entry_file.layers}, not {layers}")
            if sum(files[n].role == ROLE_SHARD for n in names) != 1:
                raise ManifestError(f"{field}.files", "each range needs exactly one shard file")
            groups.append((layers, names))
            expected = layers.stop
        if expected != total:
            raise ManifestError("layer_map", f"gap: no file serves layers {expected}:{total}")
        listed = {n for _, names in groups for n in names}
        unmapped = sorted(set(files) - listed)
        if unmapped:
            raise ManifestError("files", f"{unmapped[0]!r} appears in no layer_map range")
        return tuple(groups)

    def kv_cache(self, value: Any, total: int) -> KVCache:
        keys = ("bytes_per_token_per_layer", "dtype", "head_dim", "hidden", "kind", "kv_heads", "kv_lora_rank",
                "per_layer", "qk_rope_head_dim")  # fmt: skip
        kv = self.obj(value, "kv_cache", keys)
        kind = self.str_(kv["kind"], "kv_cache.kind")
        if kind not in KV_KINDS:
            raise ManifestError("kv_cache.kind", f"{kind!r} is not one of {', '.join(KV_KINDS)}")
        per_layer = self.list_(kv["per_layer"], "kv_cache.per_layer", lambda v, f: self.int_(v, f, minimum=0))
        if len(per_layer) != total:
            raise ManifestError("kv_cache.per_layer", f"has {len(per_layer)} entries for {total} layers")
        return KVCache(
            kind=kind,
            dtype=self.str_(kv["dtype"], "kv_cache.dtype"),
            bytes_per_token_per_layer=self.int_(kv["bytes_per_token_per_layer"], "kv_cache.bytes_per_token_per_layer"),
            per_layer=per_layer,
            hidden=self.int_(kv["hidden"], "kv_cache.hidden"),
            kv_heads=self.int_(kv["kv_heads"], "kv_cache.kv_heads", minimum=0),
            head_dim=self.int_(kv["head_dim"], "kv_cache.head_dim", minimum=0),
            kv_lora_rank=self.int_(kv["kv_lora_rank"], "kv_cache.kv_lora_rank", minimum=0),
            qk_rope_head_dim=self.int_(kv["qk_rope_head_dim"], "kv_cache.qk_rope_head_dim", minimum=0),
        )

    def split(self, value: Any, field: str) -> Mapping[str, Any]:
        entry = self.obj(value, field, ("name", "sha256", "size"))
        self.str_(entry["name"], f"{field}.name")
        self.hex64(entry["sha256"], f"{field}.sha256")
        self.int_(entry["size"], f"{field}.size")
        return entry

    def url(self, value: Any, field: str) -> str:
        text = self.str_(value, field)
        if not text.startswith(("http://", "https://")):
            raise ManifestError(field, f"{text!r} is not an http(s) URL")
        return text

    def magnet(self, value: Any, info_hash: Any) -> str:
        text = self.str_(value, "torrent.magnet")
        if not text.startswith("magnet:?") or f"urn:btmh:1220{info_hash}" not in text:
            raise ManifestError(
                "torrent.magnet", "must be a magnet link carrying torrent.info_hash_v2 (urn:btmh:1220…)"
            )
        return text


_TOP_KEYS = (
    "architecture", "backends", "context_cap", "files", "gguf_splits", "kv_cache", "layer_map", "layers",
    "license", "model", "quantization", "schema", "source", "tokenizer", "torrent", "web_seeds",
)  # fmt: skip
_TORRENT_KEYS = ("file", "info_hash_v2", "magnet", "name", "piece_length", "sha256")


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key
