"""``meshnet node``, ``meshnet tracker`` and ``meshnet gateway``: the processes of a swarm."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from meshnet.cli.artifacts import add_fetch_arguments, fetch_node_shard
from meshnet.cli.member_tls import (
    add_member_tls,
    add_tracker_tls,
    check_covers,
    check_plain_bind,
    member_tls_for,
)
from meshnet.cli.serve import (
    add_allow_uncertified,
    add_api_keys,
    add_chat_template,
    bind_socket,
    check_certified,
    resolve_gguf,
    serve_app,
    setup_logging,
    usage_error,
)
from meshnet.errors import MeshnetError
from meshnet.httputil import is_wildcard, service_url
from meshnet.layers import LayerRange

__all__ = ["add_swarm_commands", "default_cache_dir", "run_node"]

WIRE_DTYPES = ("float32", "bfloat16", "float16")


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshnet" / "shards"


def add_swarm_commands(sub: Any) -> None:
    node = sub.add_parser("node", help="serve one layer range of a GGUF to a route")
    source = node.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, help="full model GGUF (default: the bundled model)")
    source.add_argument("--manifest", help="fetch the range's files from a published manifest (path or URL)")
    source.add_argument(
        "--hf",
        type=Path,
        help="with --backend torch: a saved transformers model folder (config.json + safetensors) of an "
        "architecture the PyTorch backend splits, e.g. DeepSeek-V4 or Qwen3.5-MoE",
    )
    node.add_argument("--model-id", help="with --hf: the model id to serve (default: the folder's name)")
    node.add_argument("--layers", required=True, help="half-open block range START:STOP, e.g. 10:20")
    node.add_argument("--dest", type=Path, help="with --manifest: folder holding fetched files")
    add_fetch_arguments(node)
    node.add_argument("--host", default="127.0.0.1")
    node.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    node.add_argument("--tracker", help="tracker URL to register with, e.g. http://127.0.0.1:8001")
    node.add_argument("--backend", choices=("llama", "torch"), default="llama")
    _add_compute(node)
    node.add_argument("--max-sessions", type=at_least_one, default=4, help="sessions held at once (default 4)")
    node.add_argument(
        "--sample-deadline",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="the longest a tail may take to sample one token (a costly grammar); past it, that generation "
        "fails with grammar_too_costly and the node goes on (default 2)",
    )
    node.add_argument(
        "--max-sessions-per-client",
        type=at_least_one,
        default=None,
        help="in a private swarm: sessions one member (a gateway) may hold on this node at once; one more is "
        "a 429 (default: --max-sessions, i.e. no limit per client; with several gateways, e.g. half of it)",
    )
    add_decode_batch(node)
    node.add_argument(
        "--wire-dtype",
        choices=WIRE_DTYPES,
        default="float32",
        help="activations sent onward (default float32: exact; a lossy dtype makes the text depend on where "
        "routes are cut, and route repair keeps such seams in place)",
    )
    node.add_argument(
        "--node-id", help="stable id (default: the certificate's member id, else derived from port and layers)"
    )
    node.add_argument(
        "--advertise-url",
        "--public-url",
        dest="public_url",
        help="the URL gateways and other nodes reach this node at, advertised to the tracker "
        "(default http(s)://HOST:PORT; set it behind NAT, a reverse proxy or a link emulator)",
    )
    add_member_tls(node)
    add_allow_uncertified(node)
    node.add_argument("--cache-dir", type=Path, default=None, help="where shard files are cut to")
    node.add_argument("--session-ttl", type=float, default=600.0, help="idle seconds before a session's KV is freed")
    node.add_argument("--max-body-mb", type=float, default=256.0, help="largest request body accepted (MiB)")
    node.add_argument(
        "--hop-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the next hop of a route (default 120; hops further up wait 10 s more per hop)",
    )
    node.add_argument(
        "--seam-log-mb",
        type=float,
        default=512.0,
        help="activations kept for route repair, all sessions together (MiB; 0 turns repair from this node off)",
    )
    node.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=128.0,
        help="host memory for cached KV: finished sessions' prompt blocks (for the next turn of a conversation or "
        "a shared system prompt) and standby snapshots stay in the shard's free sequences first and move here when "
        "live sessions need the room (MiB; 0 turns prefix caching off on this node)",
    )

    _add_tracker(sub)

    gateway = sub.add_parser("gateway", help="OpenAI API + telemetry over a route of nodes")
    gateway.add_argument("--gguf", type=Path, help="the model's GGUF, for its tokenizer (default: bundled)")
    gateway.add_argument("--tracker", required=True, help="tracker URL")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--ctx", type=int, default=2048, help="context cap per generation (default 2048)")
    gateway.add_argument("--max-concurrency", type=int, default=4, help="generations in flight (default 4)")
    gateway.add_argument("--prefill-chunk", type=int, default=128, help="tokens per prefill chunk (default 128)")
    gateway.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default="on",
        help="on (default): a generation reuses the KV of its prompt's leading blocks from the route's prefix "
        "caches, and leaves its own there when it ends; off: it prefills every token, and the nodes keep nothing "
        "of its prompt once its session is closed",
    )
    gateway.add_argument(
        "--kv-snapshots",
        choices=("on", "off"),
        default="on",
        help="on (default): in a private swarm, after a prompt of 256 tokens or more each hop copies its KV to a "
        "trusted standby node of the same layers, so a repair after a node dies replays only what came after; "
        "off: repair always replays the whole context",
    )
    gateway.add_argument("--max-queue", type=int, default=64)
    gateway.add_argument(
        "--max-body-mb", type=float, default=16.0, help="largest API request body accepted (MiB, default 16)"
    )
    gateway.add_argument(
        "--billing-spool",
        type=Path,
        default=None,
        help="where billing records wait until the tracker took them, so a restart loses none "
        "(default: ~/.cache/meshnet/billing/<hash of the tracker URL>)",
    )
    add_speculative(gateway)
    add_chat_template(gateway)
    add_api_keys(gateway)
    gateway.add_argument(
        "--core-lease",
        type=Path,
        metavar="FILE",
        help="with --speculative draft: the draft model computes only while it holds this machine's core lease "
        "(the file co-located nodes share; meshnet up does this)",
    )
    add_member_tls(gateway, insecure=False)  # for its clients; its own OpenAI port is the API keys' business
    gateway.add_argument(
        "--trusted-only",
        action="store_true",
        help="route every generation over trusted nodes only (those whose certificate grants the trusted tier: "
        "meshnet swarm invite --trusted); needs --swarm-dir",
    )
    gateway.add_argument(
        "--hop-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the next hop of a route (default 120; hops further up wait 10 s more per hop)",
    )


def _add_tracker(sub: Any) -> None:
    tracker = sub.add_parser("tracker", help="node registry and sticky routes")
    tracker.add_argument("--host", default="127.0.0.1")
    tracker.add_argument("--port", type=int, default=8001)
    tracker.add_argument(
        "--max-sessions-per-client",
        type=at_least_one,
        help="with --swarm: open sessions one member (gateway) may hold at once; one more is 429 (default: no limit)",
    )
    tracker.add_argument("--db", default="sqlite:///.meshnet/tracker.db", help="SQLAlchemy URL (sqlite or postgresql)")
    add_tracker_tls(tracker)


def _add_compute(node: argparse.ArgumentParser) -> None:
    node.add_argument("--threads", type=int, help="compute threads (default: all cores)")
    node.add_argument(
        "--core-lease",
        type=Path,
        metavar="FILE",
        help="share this machine's cores with the other nodes given the same FILE: they compute one at a time, "
        "each with all its threads, and never spin against each other (meshnet up does this)",
    )
    node.add_argument("--ctx", type=int, default=2048, help="context per session in tokens (default 2048)")


def add_speculative(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding through the route (docs/protocol.md, "Speculative decoding")."""
    parser.add_argument(
        "--speculative",
        choices=("off", "ngram", "draft"),
        default="ngram",
        help="draft tokens and verify them in one walk through the route: ngram (prompt lookup in the text so "
        "far), draft (a small model of the same vocabulary, --draft-gguf) or off (default ngram; greedy text is "
        "the same either way)",
    )
    parser.add_argument(
        "--draft-gguf", type=Path, help="with --speculative draft: the draft model, a small GGUF sharing the vocabulary"
    )

    parser.add_argument(
        "--draft-tokens", type=int, default=12, help="most tokens drafted per step (default 12; nodes may allow fewer)"
    )
    parser.add_argument(
        "--decode-channel",
        choices=("on", "off"),
        default="on",
        help="send decode steps over kept-open WebSockets, the tail's token straight back to the gateway "
        "(default on; off: one HTTP request per hop, answers back through every hop)",
    )


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def add_decode_batch(parser: argparse.ArgumentParser) -> None:
    """Batched decode on llama.cpp nodes (docs/protocol.md, "Batched decode")."""
    parser.add_argument(
        "--decode-batch",
        type=at_least_one,
        default=16,
        help="most sessions' decode steps a node computes as one llama.cpp batch (default 16, capped by "
        "--max-sessions; 1: one at a time). Used only where the node measured at load that a batch gives "
        "every session the bits of its own step (with one thread it does)",
    )


def run_node(args: argparse.Namespace) -> int:
    setup_logging()
    _check_advertisable(args.host, _public_url(args.public_url))  # a bad one fails now, not after loading the model
    _per_client(args)  # likewise
    for flag, mib in (("--seam-log-mb", args.seam_log_mb), ("--prefix-cache-mb", args.prefix_cache_mb)):
        if not mib >= 0:
            usage_error(f"meshnet node: {flag} is a size in MiB, 0 or more (0 turns it off), not {mib:g}")
    args.member_tls = member_tls_for(args, "node", "node")
    if args.member_tls is None:
        check_plain_bind(args.host, args.insecure, "node", "join a private swarm and give --swarm-dir DIR")
    elif args.node_id not in (None, args.member_tls.member_id):
        usage_error(f"meshnet node: --node-id {args.node_id} is not the certificate's id {args.member_tls.member_id!r}")
    from meshnet.artifacts.fetch import FetchError

    if args.hf is not None:
        return _run_hf_node(args)
    gguf = None if args.manifest else resolve_gguf(args.gguf, "node")
    if gguf is not None and not check_certified(gguf, "node", allow=args.allow_uncertified, backend=args.backend):
        return 2
    sock = bind_socket(args.host, args.port)
    started = time.monotonic()
    seeder = None  # with --manifest: the BitTorrent swarm that fetched the files and keeps seeding them
    try:
        if gguf is None:
            seeder, shard, advert = fetch_node_shard(args)
        else:
            shard, advert = _load_shard(args, gguf)
    except (MeshnetError, ValueError) as exc:
        sock.close()
        print(f"meshnet node: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1 if isinstance(exc, FetchError) else 2
    return _serve_node(args, sock, shard, advert, started=started, seeder=seeder)


def _run_hf_node(args: argparse.Namespace) -> int:
    """A PyTorch node over a saved transformers model folder (``--hf``): one layer range of it."""
    from meshnet.backends.hf_config import hf_model_type, load_hf_shard
    from meshnet.backends.torch_shard import StoreBudget, set_threads
    from meshnet.models.families import family_of_model_type, require_certified

    if args.backend != "torch":
        print("meshnet node: --hf needs --backend torch (llama.cpp nodes serve GGUFs)", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        model_type, total = hf_model_type(args.hf)
        warning = require_certified(
            family_of_model_type(model_type), backend="torch", allow_uncertified=args.allow_uncertified
        )
        if warning:
            print(f"meshnet node: warning: {warning}", file=sys.stderr, flush=True)
        layers = LayerRange.parse(args.layers, total)
        set_threads(args.threads or os.cpu_count() or 1)
        budget = StoreBudget(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl)
        shard = load_hf_shard(args.hf, layers, model_id=args.model_id or args.hf.name, budget=budget)
    except (MeshnetError, ValueError, OSError) as exc:
        print(f"meshnet node: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    sock = bind_socket(args.host, args.port)
    advert = {"quantization": "F32", "threads": args.threads or os.cpu_count() or 1}
    return _serve_node(args, sock, shard, advert, started=started, seeder=None)


def _public_url(raw: str | None) -> str | None:
    """``--public-url``, checked: ``http(s)://HOST:PORT`` that peers can dial (hops append their paths)."""
    if raw is None:
        return None
    try:
        return service_url(raw)
    except ValueError as exc:
        usage_error(f"meshnet node: --public-url {exc}")


def _check_advertisable(host: str, public_url: str | None) -> None:
    """A node bound to every interface cannot advertise the address it bound: it needs ``--public-url``."""
    if is_wildcard(host) and public_url is None:
        usage_error(
            f"meshnet node: --host {host} listens on every interface, and http://{host}:PORT is not an address "
            "other hosts can reach; give --advertise-url (or --public-url) https://THIS-MACHINE'S-ADDRESS:PORT "
            "(what the tracker hands to gateways and the hop before this one)"
        )


def _ticket_verifier(tls: Any) -> Any:
    """A swarm member's node takes sessions only with the tracker's route tickets."""
    if tls is None:
        return None
    try:
        return tls.ticket_verifier()
    except MeshnetError as exc:
        usage_error(f"meshnet node: {exc.message}")


def _per_client(args: argparse.Namespace) -> int | None:
    """``--max-sessions-per-client`` (at most ``--max-sessions``); ``None``: no limit per client. Not
    half by default: one gateway, the usual client of a swarm (and the only one of ``meshnet up``),
    would get half of every node."""
    if args.max_sessions_per_client is None:
        return None
    if args.max_sessions_per_client > args.max_sessions:
        usage_error(
            f"meshnet node: --max-sessions-per-client {args.max_sessions_per_client} is more than --max-sessions "
            f"{args.max_sessions}; give at most {args.max_sessions}"
        )
    return int(args.max_sessions_per_client)


def _serve_node(
    args: argparse.Namespace, sock: socket.socket, shard: Any, advert: dict[str, Any], *, started: float, seeder: Any
) -> int:
    host, port = sock.getsockname()[:2]
    if args.core_lease is not None:
        from meshnet.cores import CoreLease

        try:
            shard.core_lease = CoreLease(args.core_lease)
        except ValueError as exc:
            usage_error(f"meshnet node: --core-lease: {exc}")
    tls = args.member_tls
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    public = _public_url(args.public_url) or url
    if tls is not None:
        if not public.startswith("https://"):
            usage_error(f"meshnet node: a swarm member serves https; --advertise-url {public} must be https://")
        check_covers(tls, urllib.parse.urlsplit(public).hostname or "", "node")
    from meshnet.node.app import NodeConfig, create_node_app
    from meshnet.security.membership import RequireMember

    info = shard.info
    node_id = args.node_id or (tls.member_id if tls else f"node-{port}-{info.layers.start}-{info.layers.stop}")
    if not args.sample_deadline > 0:
        usage_error(f"meshnet node: --sample-deadline must be > 0 seconds, got {args.sample_deadline}")
    config = NodeConfig(
        node_id=node_id,
        url=public,
        wire_dtype=args.wire_dtype,
        max_body_bytes=int(args.max_body_mb * 2**20),
        hop_timeout_s=args.hop_timeout,
        seam_log_bytes=int(args.seam_log_mb * 2**20),
        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        sweep_interval_s=min(5.0, max(0.2, args.session_ttl / 2)),
        tracker_url=args.tracker.rstrip("/") if args.tracker else None,
        advert=tuple(advert.items()),
        client_tls=tls.client_context() if tls else None,
        tickets=_ticket_verifier(tls),
        max_sessions_per_client=_per_client(args),
        sample_deadline_s=args.sample_deadline,
    )
    print(
        f"meshnet: node {node_id} holds layers {info.layers} of {info.model_id} ({info.backend}, "
        f"{info.weight_bytes / 2**20:.1f} MiB of weights, {info.kv.bytes_per_token} KV bytes/token) "
        f"loaded in {time.monotonic() - started:.1f}s",
        flush=True,
    )
    if public != url:
        print(f"meshnet: advertised as {public}", flush=True)
    print(f"meshnet: listening on {url}", flush=True)
    try:
        app = create_node_app(shard, config)
        if tls is None:
            serve_app(app, sock)
        else:
            serve_app(RequireMember(app, tls.ca_cert), sock, tls=tls.server_context())
    finally:
        if seeder is not None:
            seeder.close()
    return 0


def _load_shard(args: argparse.Namespace, gguf: Path) -> tuple[Any, dict[str, Any]]:
    """The shard, and what the node advertises about it beyond ``ShardInfo`` (node.advert)."""
    from meshnet.backends.llama_vocab import LlamaVocab

    vocab = LlamaVocab(gguf)
    total, model_id = vocab.info.n_layers, vocab.info.model_id
    vocab.close()
    layers = LayerRange.parse(args.layers, total)
    threads = args.threads or os.cpu_count() or 1
    advert = {"quantization": vocab.info.quantization, "threads": threads}
    if args.backend == "torch":
        from meshnet.backends.torch_shard import StoreBudget, TorchShard, set_threads

        set_threads(threads)
        budget = StoreBudget(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl)
        shard = TorchShard.from_gguf(gguf, layers, budget=budget)
        if shard.info.model_id != model_id:
            raise ValueError(f"the torch backend names the model {shard.info.model_id!r}, the gateway {model_id!r}")
        return shard, advert
    from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig

    config = LlamaShardConfig(
        n_ctx=args.ctx * args.max_sessions,
        max_sessions=args.max_sessions,
        n_threads=threads,
        idle_ttl_s=args.session_ttl,
        decode_batch=args.decode_batch,
    )
    if layers.is_full:
        return LlamaShard(gguf, model_id=model_id, config=config), advert
    cache = args.cache_dir or default_cache_dir()
    return LlamaShard.from_model(gguf, layers, cache_dir=cache, model_id=model_id, config=config), advert
