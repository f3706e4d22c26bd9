"""``meshnet publish``: cut a GGUF into per-range shard files, hash them, make one v2 torrent and the manifest.

Output folder::

    OUT/manifest.json            canonical JSON; its SHA-256 is the model's identity
    OUT/model.torrent            one BitTorrent v2 torrent over every file below
    OUT/<name>/blk-000-010.gguf  shard files the llama.cpp shard backend loads directly
    OUT/<name>/blk-000-010.embd.gguf   the head's embedding table
    ...
    OUT/<name>/vocab.gguf        the GGUF's metadata, no tensors: all a gateway needs (artifacts.vocab)

``<name>`` is the torrent's name (the model id), so serving ``OUT`` over HTTP makes ``OUT``'s URL a
BEP 19 web seed: a client asks for ``URL/<name>/<file>``. Every file is written atomically; the
manifest last, so a folder with a manifest is complete.

The source may be a llama.cpp split set (pass its first file): every part is read, and the
manifest's ``gguf_splits`` lists each part. Tensor bytes are streamed (``gguf_source``), and the
torrent's piece hashes are computed here with bounded reads (``torrent.create_torrent``), so
publishing costs a few MiB of memory beyond the vocabulary whatever the model's size.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.artifacts.gguf_header import Field
from meshnet.artifacts.gguf_source import model_stem, open_gguf
from meshnet.artifacts.manifest import (
    MANIFEST_NAME,
    ROLE_EMBEDDINGS,
    ROLE_SHARD,
    SCHEMA,
    Manifest,
    canonical_json,
    parse_manifest,
)
from meshnet.artifacts.plan import shape_from_fields
from meshnet.artifacts.shard_file import range_starts_of, trunk_layers, write_shard
from meshnet.artifacts.torrent import DEFAULT_PIECE_LENGTH, create_torrent, magnet_of, read_torrent
from meshnet.artifacts.vocab import VOCAB_NAME, vocab_entry, write_vocab
from meshnet.errors import InvalidRequest
from meshnet.fsutil import file_sha256, write_atomic
from meshnet.layers import LayerRange

__all__ = ["TORRENT_NAME", "PublishOptions", "publish", "split_ranges"]

TORRENT_NAME = "model.torrent"
BACKENDS = ("llama.cpp",)  # runtimes that load the published files as they are
KV_DTYPE = "f16"  # llama.cpp's default K/V cache type


@dataclass(frozen=True, slots=True)
class PublishOptions:
    ranges: str | None = None  # "0:10,10:20,..."; else layers_per_file
    layers_per_file: int = 10
    web_seeds: tuple[str, ...] = ()
    source_repo: str | None = None
    revision: str | None = None
    license: str | None = None
    model_id: str | None = None
    model_version: str | None = None
    piece_length: int = DEFAULT_PIECE_LENGTH


def split_ranges(
    total: int, *, ranges: str | None = None, layers_per_file: int = 10, starts: Sequence[int] | None = None
) -> list[LayerRange]:
    """Contiguous ranges covering ``0:total``, from ``--ranges`` or ``--layers-per-file`` (each file
    then ends at the first layer its family lets a range start at, ``starts``, past that many)."""
    if ranges is None:
        if layers_per_file < 1:
            raise InvalidRequest("--layers-per-file must be at least 1", param="layers_per_file")
        allowed = sorted(set(range(total) if starts is None else starts) | {total})
        files, begin = [], 0
        while begin < total:
            stop = next(a for a in allowed if a >= min(total, begin + layers_per_file))
            files.append(LayerRange(begin, stop, total))
            begin = stop
        return files
    out: list[LayerRange] = []
    for text in ranges.split(","):
        try:
            out.append(LayerRange.parse(text.strip(), total))
        except ValueError as exc:
            raise InvalidRequest(f"--ranges: {exc} (the model has {total} layers)", param="ranges") from None
    expected = 0
    for r in out:
        if r.start != expected:
            kind = "gap" if r.start > expected else "overlap"
            raise InvalidRequest(f"--ranges: {kind} at layer {min(r.start, expected)}", param="ranges")
        expected = r.stop
    if expected != total:
        raise InvalidRequest(f"--ranges must end at layer {total}, not {expected}", param="ranges")
    return out


def _shard_name(r: LayerRange) -> str:
    return f"blk-{r.start:03d}-{r.stop:03d}.gguf"


def publish(source: Path, out: Path, options: PublishOptions | None = None) -> Manifest:
    """Publish the GGUF ``source`` (a plain file or a split set's first file) into ``out``."""
    opts = options or PublishOptions()
    reader = open_gguf(source)
    fields = reader.fields
    meta = reader.meta
    arch = str(meta("general.architecture"))
    total = trunk_layers(meta, arch)
    starts = range_starts_of(fields)
    ranges = split_ranges(total, ranges=opts.ranges, layers_per_file=opts.layers_per_file, starts=starts)
    model_id = opts.model_id or model_stem(source)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", model_id).lstrip(".-") or "model"
    folder = out / name
    expected = {_shard_name(r) for r in ranges} | {_shard_name(ranges[0]).replace(".gguf", ".embd.gguf"), VOCAB_NAME}
    if folder.is_dir():
        foreign = sorted(p.name for p in folder.iterdir() if p.name not in expected)
        if foreign:
            raise InvalidRequest(f"{folder} holds files that are not part of this publication ({foreign[0]}, ...)")
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # written last: its presence means complete

    source_tensors = [t.name for t in reader.tensors]
    files: list[dict[str, Any]] = []
    layer_map: list[dict[str, Any]] = []
    for r in ranges:
        shard = write_shard(source, r, folder / _shard_name(r), opened=reader)
        kept = [t for t in source_tensors if _in_shard(t, r, shard.vocab_cut)]
        group = [_file_entry(shard.path, ROLE_SHARD, r, kept)]
        if shard.embeddings is not None:
            group.append(_file_entry(shard.embeddings, ROLE_EMBEDDINGS, r, ["token_embd.weight"]))
        files += group
        layer_map.append({"layers": str(r), "files": [f["name"] for f in group]})

    vocab = write_vocab(reader, folder / VOCAB_NAME)
    torrent = create_torrent(out, name, piece_length=opts.piece_length, web_seeds=opts.web_seeds)
    write_atomic(out / TORRENT_NAME, torrent)
    parsed = read_torrent(torrent)
    for entry in files:
        entry["pieces_root"] = parsed.roots[entry["name"]]

    shape = shape_from_fields(source, fields, KV_DTYPE)
    tail = files[-1]["name"] if files[-1]["role"] == ROLE_SHARD else files[-2]["name"]
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "model": {"id": model_id, "version": opts.model_version or str(meta("general.version", "1"))},
        "source": {
            "repo": opts.source_repo if opts.source_repo is not None else str(meta("general.source.url", "")),
            "revision": opts.revision or "",
        },
        "license": opts.license if opts.license is not None else str(meta("general.license", "")),
        "architecture": arch,
        "layers": total,
        "layer_map": layer_map,
        "files": files,
        "tokenizer": {
            "model": str(meta("tokenizer.ggml.model", "")),
            "files": [tail],  # the tail keeps the full vocabulary; the other shards carry a 1-token stub
            "sha256": _tokenizer_sha256(fields),
            "vocab_size": int(meta(f"{arch}.vocab_size", 0) or len(meta("tokenizer.ggml.tokens", []))),
        },
        "quantization": {
            "file_type": _file_type(meta("general.file_type")),
            "tensor_types": dict(sorted(collections.Counter(t.tensor_type.name for t in reader.tensors).items())),
        },
        "gguf_splits": [{"name": p.name, "size": p.stat().st_size, "sha256": file_sha256(p)} for p in reader.parts],
        "backends": list(BACKENDS),
        "context_cap": int(meta(f"{arch}.context_length", 0)),
        "kv_cache": {
            "kind": shape.kind,
            "dtype": KV_DTYPE,
            "bytes_per_token_per_layer": shape.kv_bytes_per_token_per_layer,
            "per_layer": [shape.kv_bytes_per_token_per_layer] * total,
            "hidden": shape.hidden,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "kv_lora_rank": shape.kv_lora_rank,
            "qk_rope_head_dim": shape.qk_rope_head_dim,
        },
        "torrent": {
            "file": TORRENT_NAME,
            "sha256": hashlib.sha256(torrent).hexdigest(),
            "info_hash_v2": parsed.info_hash_v2,
            "magnet": magnet_of(parsed.info),
            "piece_length": opts.piece_length,
            "name": name,
        },
        "web_seeds": list(opts.web_seeds),
        "vocab": vocab_entry(vocab, parsed.roots[VOCAB_NAME]),
    }
    data = canonical_json(doc)
    manifest = parse_manifest(data)  # what we publish must pass our own strict parser
    write_atomic(out / MANIFEST_NAME, data)
    return manifest


def _in_shard(tensor: str, r: LayerRange, vocab_cut: bool) -> bool:
    if tensor.startswith("blk."):
        return r.start <= int(tensor.split(".", 2)[1]) < r.stop
    # A cut-vocab shard carries 1-row stubs of these; the real tables live in the tail / sidecar.
    return not (vocab_cut and tensor in ("token_embd.weight", "output.weight"))


def _file_entry(path: Path, role: str, r: LayerRange, tensors: list[str]) -> dict[str, Any]:
    return {
        "name": path.name,
        "size": path.stat().st_size,
        "sha256": file_sha256(path),
        "pieces_root": "",  # filled in from the torrent
        "role": role,
        "layers": str(r),
        "tensors": tensors,
    }


def _tokenizer_sha256(fields: dict[str, Field]) -> str:
    """SHA-256 over the exact GGUF bytes of every ``tokenizer.*`` key (name, then the entry)."""
    digest = hashlib.sha256()
    for name, field in sorted(fields.items()):
        if name.startswith("tokenizer."):
            digest.update(name.encode() + b"\0")
            digest.update(field.raw)
    return digest.hexdigest()


def _file_type(value: Any) -> str:
    import gguf

    if value is None:
        return "unknown"
    try:
        name = str(gguf.LlamaFileType(int(value)).name)
    except ValueError:
        return f"ftype-{int(value)}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")  # "Q4_1", as the node advertises it
