"""``meshnet publish`` and ``meshnet fetch``, and the fetch a ``meshnet node --manifest`` starts with.

Exit codes: 0 done; 1 the fetch failed (no source delivered, a file failed verification);
2 bad input (a malformed manifest, layers off the published boundaries, a bad argument).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from meshnet.cli.serve import add_allow_uncertified
from meshnet.errors import MeshnetError

__all__ = [
    "add_artifact_commands",
    "add_fetch_arguments",
    "default_artifacts_dir",
    "fetch_config",
    "fetch_node_shard",
    "run_fetch",
    "run_publish",
    "start_fetch",
]

MIB = 2**20


def add_artifact_commands(sub: Any) -> None:
    pub = sub.add_parser("publish", help="split a GGUF into per-range files + manifest + BitTorrent v2 torrent")
    pub.add_argument("gguf", type=Path, nargs="?", help="full model GGUF (default: the bundled model)")
    pub.add_argument("--out", type=Path, required=True, help="folder to write (manifest.json, model.torrent, files)")
    group = pub.add_mutually_exclusive_group()
    group.add_argument("--layers-per-file", type=int, default=10, help="layers per shard file (default 10)")
    group.add_argument("--ranges", help="explicit ranges, e.g. 0:10,10:20,20:30")
    pub.add_argument("--web-seed", action="append", default=[], help="BEP 19 web seed URL serving --out (repeatable)")
    add_allow_uncertified(pub)
    pub.add_argument("--source-repo", help="upstream repository, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    pub.add_argument("--revision", help="upstream revision (commit) the GGUF was made from")
    pub.add_argument("--license", help="license id (default: the GGUF's general.license)")
    pub.add_argument("--model-id", help="model id (default: the GGUF file name, as `meshnet node --gguf` uses)")
    pub.add_argument("--model-version", help="model version (default: general.version, else 1)")
    pub.add_argument("--piece-kib", type=int, default=1024, help="torrent piece size in KiB (power of 2, >= 16)")
    pub.add_argument("--serve", action="store_true", help="then serve --out over HTTP (a Range-capable web seed)")
    pub.add_argument("--host", default="127.0.0.1", help="with --serve: interface (default 127.0.0.1)")
    pub.add_argument("--port", type=int, default=8090, help="with --serve: port (default 8090; 0: a free one)")

    fetch = sub.add_parser("fetch", help="download the files of a layer range from peers / a web seed")
    fetch.add_argument("manifest", help="manifest.json path or http(s) URL (the torrent is read from beside it)")
    fetch.add_argument("--dest", type=Path, required=True, help="folder to hold the files")
    fetch.add_argument("--layers", help="layer range START:STOP (default: every file)")
    add_fetch_arguments(fetch)
    fetch.add_argument("--tracker", help="tracker URL: also fetch from the nodes it knows seed this model")
    fetch.add_argument("--seed", action="store_true", help="keep seeding what is held until interrupted")


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``meshnet fetch`` and ``meshnet node --manifest``."""
    parser.add_argument("--peer", action="append", default=[], help="a peer HOST:PORT to fetch from (repeatable)")
    parser.add_argument("--web-seed", action="append", default=[], help="an extra BEP 19 web seed URL (repeatable)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="BitTorrent HOST:PORT (default 127.0.0.1:0)")
    parser.add_argument("--manifest-digest", help="refuse a manifest whose digest is not this sha256:...")
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="fail after this many seconds without data")
    parser.add_argument("--timeout", type=float, help="fail if the whole fetch takes longer (seconds)")
    parser.add_argument("--max-rate-mib", type=float, default=0.0, help="download limit in MiB/s (default: none)")


def run_publish(args: argparse.Namespace) -> int:
    from meshnet.artifacts.publish import PublishOptions, publish
    from meshnet.cli.serve import check_certified, resolve_gguf

    source = resolve_gguf(args.gguf, "publish")
    if not check_certified(source, "publish", allow=args.allow_uncertified):
        return 2
    piece = args.piece_kib * 1024
    if args.piece_kib < 16 or piece & (piece - 1):
        print("meshnet publish: --piece-kib must be a power of 2, at least 16", file=sys.stderr)
        return 2
    opts = PublishOptions(
        ranges=args.ranges,
        layers_per_file=args.layers_per_file,
        web_seeds=tuple(args.web_seed),
        source_repo=args.source_repo,
        revision=args.revision,
        license=args.license,
        model_id=args.model_id,
        model_version=args.model_version,
        piece_length=piece,
    )
    print(f"meshnet: publishing {source} into {args.out} ...", flush=True)
    started = time.monotonic()
    try:
        manifest = publish(source, args.out, opts)
    except MeshnetError as exc:
        print(f"meshnet publish: {exc.message}", file=sys.stderr)
        return 2
    for layers, names in manifest.layer_map:
        sizes = ", ".join(f"{n} ({manifest.file(n).size / MIB:.1f} MiB)" for n in names)
        print(f"meshnet:   layers {layers}: {sizes}")
    if manifest.vocab is not None:  # what a gateway fetches instead of the weights
        print(f"meshnet:   vocabulary: {manifest.vocab.name} ({manifest.vocab.size / MIB:.1f} MiB, metadata only)")
    print(f"meshnet: wrote {args.out / 'manifest.json'} in {time.monotonic() - started:.1f}s")
    print(f"meshnet: model {manifest.model_id} digest {manifest.digest}")
    print(f"meshnet: magnet {manifest.magnet}", flush=True)
    if not args.serve:
        return 0
    from meshnet.artifacts.webseed import RangeServer

    server = RangeServer(args.out, host=args.host, port=args.port)
    print(f"meshnet: web seed for {args.out}: fetch with --web-seed {server.url}", flush=True)
    print(f"meshnet: listening on {server.url.rstrip('/')}", flush=True)
    try:
        with _interruptible():
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def fetch_config(args: argparse.Namespace, dest: Path, layers: Any) -> Any:
    from meshnet.artifacts.fetch import FetchConfig
    from meshnet.artifacts.torrent import parse_endpoint

    return FetchConfig(
        dest=dest,
        layers=layers,
        peers=tuple(parse_endpoint(p, "--peer") for p in args.peer),
        web_seeds=tuple(args.web_seed),
        listen=args.listen,
        stall_timeout_s=args.stall_timeout,
        timeout_s=args.timeout,
        max_download_rate=int(args.max_rate_mib * MIB),
    )


def start_fetch(args: argparse.Namespace, dest: Path, layers_text: str | None, *, label: str) -> Any:
    """Load the manifest, fetch the range's files and return the live swarm (still seeding).

    Raises ``MeshnetError`` (a ``FetchError`` for a failed download); prints progress.
    """
    from meshnet.artifacts.fetch import Swarm, load_source

    manifest, torrent = load_source(args.manifest, expect_digest=args.manifest_digest)
    layers = manifest.parse_layers(layers_text)
    config = fetch_config(args, dest, layers)
    if getattr(args, "tracker", None):
        wanted = {entry.name for entry in manifest.files_for(layers)}
        found = tracker_peers(args.tracker, manifest.digest, wanted)
        config = dataclasses.replace(config, peers=(*config.peers, *found))
    swarm = Swarm(manifest, torrent, config)
    needed = sum(f.size for f in swarm.needed)
    print(
        f"meshnet: {label} {manifest.model_id} ({manifest.digest[:19]}…) layers {layers}: "
        f"{len(swarm.needed)} files, {needed / MIB:.1f} MiB; BitTorrent on {args.listen.rsplit(':', 1)[0]}:"
        f"{swarm.listen_port}",
        flush=True,
    )
    try:
        with _progress_reporter() as report:
            result = swarm.fetch(report)
    except BaseException:
        swarm.close()
        raise
    rate = result.downloaded_bytes / MIB / max(result.seconds, 1e-9)
    print(
        f"meshnet: fetched layers {layers}: needed {result.needed_bytes:,} bytes, resumed {result.resumed_bytes:,} "
        f"already on disk, downloaded {result.downloaded_bytes:,} in {result.seconds:.1f}s ({rate:.1f} MiB/s), "
        f"{result.hash_failures} hash failures; sha256 verified {result.verified} downloaded files, "
        f"{len(result.files) - result.verified} already held (checked by libtorrent's merkle hashes)",
        flush=True,
    )
    return swarm


def tracker_peers(tracker_url: str, digest: str, wanted: set[str]) -> list[tuple[str, int]]:
    """BitTorrent endpoints of live nodes seeding any of the ``wanted`` files of model ``digest``.

    Best effort: an unreachable tracker means no extra peers, not a failed fetch (``--peer`` and
    ``--web-seed`` still work); the fetch's own stall timeout bounds the case of no source at all.
    """
    import httpx

    from meshnet.artifacts.torrent import parse_endpoint

    try:
        response = httpx.get(f"{tracker_url.rstrip('/')}/v1/artifacts/{digest}/peers", timeout=10)
        peers = response.json()["peers"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        print(f"meshnet: tracker {tracker_url} did not answer for peers; using --peer / --web-seed only", flush=True)
        return []
    found = [parse_endpoint(p["bt_peer"], "bt_peer") for p in peers if wanted & set(p["files"])]
    if found:
        print(f"meshnet: the tracker knows {len(found)} peer(s) seeding these files", flush=True)
    return found


def default_artifacts_dir() -> Path:
    from meshnet.cli.paths import cache_home

    return cache_home() / "artifacts"


def fetch_node_shard(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``meshnet node --manifest``: fetch → verify → load. Returns (swarm, shard, advert).

    The swarm keeps seeding the held files while the node serves; close it when the node stops.
    The advert tells the tracker the model's identity (the manifest digest) and the files held,
    so it can point new nodes at this one.
    """
    from meshnet.artifacts.fetch import assemble
    from meshnet.artifacts.plan import shape_from_manifest
    from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig
    from meshnet.cli.node_context import node_context, shape_advert
    from meshnet.cli.paths import default_cache_dir, load_checks_dir
    from meshnet.errors import InvalidRequest
    from meshnet.models.families import require_certified

    if args.backend != "llama":
        raise InvalidRequest("--manifest files load with the llama.cpp backend (--backend llama)", param="backend")
    dest = args.dest or default_artifacts_dir()
    _bt_peer(args, None)  # a listen address no host can dial fails now, before the fetch
    swarm = start_fetch(args, dest, args.layers, label="node fetching")
    try:
        manifest = swarm.manifest
        warning = require_certified(manifest.architecture, allow_uncertified=args.allow_uncertified)
        if warning:
            print(f"meshnet node: warning: {warning}", file=sys.stderr, flush=True)
        layers = manifest.parse_layers(args.layers)
        path, embeddings = assemble(manifest, dest, layers, args.cache_dir or default_cache_dir())
        threads = args.threads or os.cpu_count() or 1
        per_token = shape_from_manifest(manifest).kv_bytes_per_token_per_layer * len(layers)

        def layer_weights() -> list[int]:
            from meshnet.node.placement import ask_from_manifest

            sizes: list[int] = ask_from_manifest(manifest, kv_tokens=0, budget_bytes=0, max_layers=None)["layer_bytes"]
            return sizes[layers.start : layers.stop]

        per_session = node_context(
            args, trained=manifest.context_cap, kv_bytes_per_token=per_token, layer_weights=layer_weights
        )
        config = LlamaShardConfig(
            n_ctx=per_session * args.max_sessions,
            max_sessions=args.max_sessions,
            n_threads=threads,
            idle_ttl_s=args.session_ttl,
            checks_cache=load_checks_dir(args.cache_dir),
            gpu_layers=args.gpu_layers,
        )
        # The model id stays the one the gateway derives from the GGUF name; the digest is in the advert.
        shard = LlamaShard(path, model_id=manifest.model_id, embeddings=embeddings, config=config)
    except BaseException:
        swarm.close()
        raise
    swarm.serve()
    held = _say_seeding(args, swarm)
    advert = {
        "manifest": manifest.digest,
        # One identity per route (docs/tracker.md): a published model is its manifest.
        **shape_advert(manifest.context_cap, f"manifest:{manifest.digest}"),
        "files": list(held),
        "quantization": str(manifest.quantization["file_type"]),
        "threads": threads,
        "bt_peer": _bt_peer(args, swarm),
    }
    return swarm, shard, advert


def run_fetch(args: argparse.Namespace) -> int:
    from meshnet.artifacts.fetch import FetchError

    try:
        swarm = start_fetch(args, args.dest, args.layers, label="fetching")
    except FetchError as exc:
        print(f"meshnet fetch: {exc.message}", file=sys.stderr)
        return 1
    except MeshnetError as exc:
        print(f"meshnet fetch: {exc.message}", file=sys.stderr)
        return 2
    try:
        if args.seed:
            swarm.serve()
            _say_seeding(args, swarm)
            with _interruptible():
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        swarm.close()
    return 0


def _bt_peer(args: argparse.Namespace, swarm: Any) -> str:
    """Where other hosts dial this process's BitTorrent session: its ``--listen`` host, or for a
    wildcard listen the host a node advertises (``--advertise-url``'s, else ``--host``)."""
    import urllib.parse

    from meshnet.artifacts.torrent import peer_address

    public = getattr(args, "public_url", None)
    host = urllib.parse.urlsplit(public).hostname if public else getattr(args, "host", None)
    return peer_address(args.listen, 0 if swarm is None else swarm.listen_port, host)


def _say_seeding(args: argparse.Namespace, swarm: Any) -> tuple[str, ...]:
    held: tuple[str, ...] = swarm.held_files()
    try:
        where = _bt_peer(args, swarm)
    except MeshnetError:  # a plain fetch on every interface: no one address to name
        where = f"{args.listen.rsplit(':', 1)[0]}:{swarm.listen_port}"
    print(f"meshnet: seeding {len(held)} files on {where}", flush=True)
    return held


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (a clean stop) while the body runs."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _progress_reporter() -> Iterator[Callable[[Any], None]]:
    """A rich progress bar on a terminal; otherwise a plain line per second."""
    if sys.stderr.isatty():
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        with Progress("[bold]fetch", BarColumn(), DownloadColumn(), TransferSpeedColumn(), "{task.description}") as bar:
            task = bar.add_task("", total=None)

            def draw(p: Any) -> None:
                bar.update(task, completed=p.done, total=p.wanted or None, description=_sources(p))

            yield draw
        return
    last = [0.0]

    def line(p: Any) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            pct = 100.0 * p.done / p.wanted if p.wanted else 100.0
            print(
                f"meshnet: fetch {p.state} {pct:5.1f}% {p.done / MIB:.1f}/{p.wanted / MIB:.1f} MiB "
                f"at {p.rate / MIB:.1f} MiB/s {_sources(p)}",
                flush=True,
            )

    yield line


def _sources(p: Any) -> str:
    return f"({p.peers} connections, {p.web_seeds} web seeds)"
