"""The vocabulary artifact: a model's GGUF metadata with no tensors, for a gateway that holds no weights.

A gateway needs a model's tokenizer, special tokens, chat template, trained context and layer count,
never its weights. ``meshnet publish`` writes them as ``<name>/vocab.gguf``: every metadata key of the
source GGUF except ``split.*`` (the artifact is one file; llama.cpp would go looking for the other
parts of a split set) and not one tensor. It sits in the model's torrent beside the shard files and is
named by the manifest's ``vocab`` field (size, SHA-256, merkle root), so it is fetched and verified
like them: BitTorrent v2 from peers, or a BEP 19 web seed.

llama.cpp loads such a file with ``vocab_only=True`` as it is: it reads the architecture, the
hyper-parameters and the vocabulary and stops before the tensors. Verified with llama-cpp-python
0.3.36 on the bundled SmolLM2-135M-Instruct (98 MB): the artifact is 1.7 MB with zero tensors, loads
in 0.1 s, and tokenizes, renders every token's bytes and reports the same model facts as the full file.

A :class:`Publication` is a manifest with its torrent, both verified (the digest, the torrent's
SHA-256): what a node hands its tracker and a gateway learns a model from.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from meshnet.artifacts.manifest import ROLE_VOCAB, FileEntry, Manifest, ManifestError, parse_manifest
from meshnet.errors import InvalidRequest

__all__ = [
    "VOCAB_NAME",
    "Publication",
    "fetch_vocab",
    "published_vocab",
    "verify_publication",
    "vocab_entry",
    "write_vocab",
]

VOCAB_NAME = "vocab.gguf"
_DROPPED_PREFIXES = ("GGUF.", "split.")  # GGUF.*: written by GGUFWriter itself; split.*: see above
_HASH_CHUNK = 4 << 20


@dataclass(frozen=True, slots=True)
class Publication:
    """A manifest and its torrent, verified against each other (and against a digest when one was asked)."""

    manifest: Manifest
    torrent: bytes

    @property
    def digest(self) -> str:
        return self.manifest.digest


def verify_publication(manifest: bytes, torrent: bytes, *, expect_digest: str | None = None) -> Publication:
    """Parse ``manifest`` strictly and check ``torrent`` is the one it names (``ManifestError`` otherwise)."""
    parsed = parse_manifest(manifest, expect_digest=expect_digest)
    if hashlib.sha256(torrent).hexdigest() != parsed.torrent_sha256:
        raise ManifestError("torrent.sha256", f"{parsed.torrent_file} does not match the manifest's SHA-256")
    return Publication(parsed, torrent)


def write_vocab(reader: Any, out: Path) -> Path:
    """Write the vocabulary artifact of the GGUF ``reader`` reads (gguf-py's ``GGUFReader``) to ``out``,
    atomically: a reader sees no file or the whole one."""
    import gguf

    arch = str(reader.fields["general.architecture"].contents())
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)
        for field in reader.fields.values():
            name: str = field.name
            if name.startswith(_DROPPED_PREFIXES) or name == "general.architecture":
                continue
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), val_type, sub_type=sub_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()  # no tensor infos: the file ends after its metadata
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def vocab_entry(path: Path, pieces_root: str) -> dict[str, Any]:
    """The manifest's ``vocab`` field for the artifact at ``path``."""
    return {"name": path.name, "size": path.stat().st_size, "sha256": _sha256(path), "pieces_root": pieces_root}


def published_vocab(manifest: Manifest, folder: Path) -> Path | None:
    """The artifact in a publication's folder (the one ``manifest.json`` lies in), if it is there and
    its SHA-256 is the manifest's; ``None`` otherwise (then fetch it)."""
    entry = _entry(manifest)
    path = folder / manifest.torrent_name / entry.name
    if path.is_file() and path.stat().st_size == entry.size and _sha256(path) == entry.sha256:
        return path
    return None


def fetch_vocab(publication: Publication, config: Any) -> Path:
    """Fetch the artifact with BitTorrent v2 (peers, web seeds) into ``config.dest``, verified against
    the manifest, and stop seeding it. ``config`` is a ``FetchConfig``; its layer range is ignored."""
    from meshnet.artifacts.fetch import Swarm

    entry = _entry(publication.manifest)
    swarm = Swarm(publication.manifest, publication.torrent, replace(config, files=(entry.name,)))
    try:
        result = swarm.fetch()
    finally:
        swarm.close()
    return result.files[0]


def _entry(manifest: Manifest) -> FileEntry:
    if manifest.vocab is None:
        raise InvalidRequest(
            f"the manifest of {manifest.model_id} ({manifest.digest[:19]}…) has no vocabulary artifact: it was "
            "published by an older meshnet; publish the GGUF again, or give the gateway --gguf",
            param="manifest",
        )
    assert manifest.vocab.role == ROLE_VOCAB
    return manifest.vocab


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
