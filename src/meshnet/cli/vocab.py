"""What a gateway tokenizes with: ``--gguf``, or the vocabulary artifact of ``--manifest`` (no weights).

``meshnet gateway --manifest PATH_OR_URL`` reads the manifest and its torrent (verified, as every
manifest reader does), then takes the vocabulary artifact (artifacts.vocab) from the publication's
folder when the manifest is a local path holding it, else fetches it with BitTorrent v2 into
``--dest``: from ``--peer``, from the nodes the tracker knows seed this model, and from web seeds —
the manifest's own, ``--web-seed``, and the folder a manifest URL is served from (``meshnet publish
--serve`` serves the publication folder, which is a BEP 19 web seed). Every fetched byte is checked
against the manifest's merkle root and SHA-256; a tampered file is never loaded.

The same fetch serves the models the gateway learns from its tracker (gateway.catalog).
"""

from __future__ import annotations

import argparse
import dataclasses
import urllib.parse
from pathlib import Path
from typing import Any

from meshnet.cli.artifacts import MIB, add_fetch_arguments, default_artifacts_dir, fetch_config, tracker_peers

__all__ = ["add_gateway_source", "gateway_vocab", "vocab_of"]


def add_gateway_source(gateway: argparse.ArgumentParser) -> None:
    """The gateway's ``--gguf`` / ``--manifest`` and the fetch options of a manifest."""
    source = gateway.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, help="the model's GGUF, for its tokenizer (default: bundled)")
    source.add_argument(
        "--manifest",
        help="a published manifest (path or URL): the gateway fetches only its vocabulary artifact (the GGUF's "
        "metadata, no weights) and serves that model",
    )
    gateway.add_argument("--dest", type=Path, help="with --manifest: folder for fetched vocabulary artifacts")
    gateway.add_argument(
        "--learn-models",
        choices=("on", "off"),
        default="on",
        help="on (default): also serve every model the tracker knows a manifest of (nodes serving from a "
        "manifest hand it to the tracker); off: only --gguf / --manifest",
    )
    add_fetch_arguments(gateway)


def gateway_vocab(args: argparse.Namespace) -> Any:
    """The ``LlamaVocab`` the gateway starts with (``MeshnetError`` saying what is wrong; a
    ``FetchError`` when no source delivered the artifact)."""
    from meshnet.backends.llama_vocab import LlamaVocab
    from meshnet.cli.serve import resolve_gguf

    if not args.manifest:
        return LlamaVocab(resolve_gguf(args.gguf, "gateway"))
    from meshnet.artifacts.fetch import load_source
    from meshnet.artifacts.vocab import Publication

    manifest, torrent = load_source(args.manifest, expect_digest=args.manifest_digest)
    publication = Publication(manifest, torrent)
    ref = args.manifest
    if ref.startswith(("http://", "https://")):
        return vocab_of(publication, args, web_seeds=(urllib.parse.urljoin(ref, "."),))
    return vocab_of(publication, args, folder=Path(ref).parent)


def vocab_of(
    publication: Any, args: argparse.Namespace, *, folder: Path | None = None, web_seeds: tuple[str, ...] = ()
) -> Any:
    """The vocabulary of ``publication`` loaded vocab-only: from ``folder`` (a publication folder) when
    it holds the artifact, else fetched (``web_seeds`` are tried besides the manifest's and ``--web-seed``)."""
    from meshnet.artifacts.vocab import fetch_vocab, published_vocab
    from meshnet.backends.llama_vocab import LlamaVocab

    manifest = publication.manifest
    path = published_vocab(manifest, folder) if folder is not None else None
    if path is None:
        config = fetch_config(args, args.dest or default_artifacts_dir(), None)
        peers = tuple(config.peers)
        if args.tracker:  # any node seeding the model may hold it (a node whose folder has it seeds it)
            names = {f.name for f in manifest.files}
            peers += tuple(tracker_peers(args.tracker, manifest.digest, names))
        config = dataclasses.replace(config, peers=peers, web_seeds=(*config.web_seeds, *web_seeds))
        path = fetch_vocab(publication, config)
    assert manifest.vocab is not None  # published_vocab / fetch_vocab refuse a manifest without one
    print(
        f"meshnet: vocabulary of {manifest.model_id} ({manifest.digest[:19]}…): {path} "
        f"({manifest.vocab.size / MIB:.1f} MiB, SHA-256 verified; no weights on this gateway)",
        flush=True,
    )
    return LlamaVocab(path, model_id=manifest.model_id)
