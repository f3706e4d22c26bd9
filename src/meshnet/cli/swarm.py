"""``meshnet node``, ``meshnet tracker`` and ``meshnet gateway``: the processes of a swarm."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshnet.cli.artifacts import add_fetch_arguments, fetch_node_shard
from meshnet.cli.member_tls import (
    add_member_tls,
    add_tracker_tls,
    check_plain_bind,
    member_tls_for,
)
from meshnet.cli.node_context import add_context_arguments
from meshnet.cli.node_run import (
    TRACKER_SESSIONS_PER_CLIENT,
    check_advertisable,
    load_shard,
    per_client,
    public_url,
    serve_node,
)
from meshnet.cli.placement import add_placement_arguments, check_placement_args
from meshnet.cli.serve import (
    add_allow_uncertified,
    add_api_keys,
    add_chat_template,
    add_gpu_layers,
    bind_socket,
    check_certified,
    resolve_gguf,
    setup_logging,
    usage_error,
    whole_at_least,
)
from meshnet.cli.vocab import add_gateway_source
from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange

__all__ = ["add_swarm_commands", "run_node"]

WIRE_DTYPES = ("float32", "bfloat16", "float16")


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
    node.add_argument(
        "--layers",
        required=True,
        help="half-open block range START:STOP, e.g. 10:20; or auto: the tracker assigns the range the swarm "
        "needs most, sized to --memory-gb (needs --tracker; docs/tracker.md, Placement)",
    )
    add_placement_arguments(node)
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
        "a 429, which a gateway waits out (default: --max-sessions minus one, so no member can take the node "
        "whole; meshnet up, whose own gateway is the only client, gives it every slot)",
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
        "--auditor",
        action="store_true",
        help="serve as an auditor: never on a route; re-executes audited sessions' hops of these layers for "
        "gateways and signs what they give (a private swarm takes auditors from trusted members only; "
        "docs/security.md, Audit sampling)",
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
    _add_gateway(sub)


def _add_gateway(sub: Any) -> None:
    gateway = sub.add_parser("gateway", help="OpenAI API + telemetry over a route of nodes")
    add_gateway_source(gateway)  # --gguf | --manifest, and a manifest's fetch options (cli.vocab)
    gateway.add_argument("--tracker", required=True, help="tracker URL")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument(
        "--ctx",
        type=int,
        default=None,
        help="context cap per generation (default: the model's trained context, at most 131,072; each route's "
        "nodes may hold less, and a generation stops at its route's)",
    )
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
        "--audit-rate",
        type=float,
        default=None,
        metavar="R",
        help="audit this fraction of sessions, secretly: re-executed after the fact on trusted auditor nodes "
        "(meshnet node --auditor) and compared bit for bit; a hop that fails is reported to the tracker, which "
        "voids its pay and suspends it (default 0.05 with --swarm-dir, 0 in an open swarm; docs/security.md)",
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
        default=TRACKER_SESSIONS_PER_CLIENT,
        help="with --swarm: open sessions one member (gateway) may hold at once; one more is 429 "
        f"(default {TRACKER_SESSIONS_PER_CLIENT})",
    )
    tracker.add_argument("--db", default="sqlite:///.meshnet/tracker.db", help="SQLAlchemy URL (sqlite or postgresql)")
    add_tracker_tls(tracker)


def _add_compute(node: argparse.ArgumentParser) -> None:
    node.add_argument("--threads", type=int, help="compute threads (default: all cores)")
    add_gpu_layers(node, what="this node's range (--backend llama)")
    node.add_argument(
        "--core-lease",
        type=Path,
        metavar="FILE",
        help="share this machine's cores with the other nodes given the same FILE: they compute one at a time, "
        "each with all its threads, and never spin against each other (meshnet up does this)",
    )
    add_context_arguments(node)


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
        "--draft-tokens",
        type=at_least_one,
        default=12,
        help="most tokens drafted per step (default 12; nodes may allow fewer)",
    )
    parser.add_argument(
        "--draft-min",
        type=whole_number,
        default=0,
        help="drafts every step sends when the drafter has that many, whether or not the route's measured costs "
        "say they pay; a draft model reads the text before the step (default 0: only as many as pay, the draft "
        "model reading on a thread meanwhile; at most --draft-tokens)",
    )
    parser.add_argument(
        "--pipeline-rounds",
        type=at_least_one,
        default=4,
        help="most verify rounds in flight on the decode channel, each sent before the verdict on the one before "
        "it while the measured acceptance makes that pay (default 4; 1: one round at a time)",
    )
    parser.add_argument(
        "--decode-channel",
        choices=("on", "off"),
        default="on",
        help="send decode steps over kept-open WebSockets, the tail's token straight back to the gateway "
        "(default on; off: one HTTP request per hop, answers back through every hop)",
    )
    parser.add_argument(
        "--relay",
        choices=("on", "off"),
        default="on",
        help="on the decode channel, let the route's tail send a plain step's next step to the head itself, so "
        "the token's loop skips the gateway (default on; off: the gateway sends every step)",
    )


def whole_number(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return whole_at_least(text, 0, "a whole number of at least 0")


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    return whole_at_least(text, 1, "a whole number of at least 1")


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
    from meshnet.memory import fix_mmap_threshold, limit_heap_arenas

    limit_heap_arenas()  # before any thread: a node's memory is its weights and KV (meshnet.memory)
    fix_mmap_threshold()
    setup_logging()
    check_advertisable(args.host, public_url(args.public_url))  # a bad one fails now, not after loading the model
    per_client(args)  # likewise
    check_placement_args(args)  # likewise
    for flag, mib in (("--seam-log-mb", args.seam_log_mb), ("--prefix-cache-mb", args.prefix_cache_mb)):
        if not mib >= 0:
            usage_error(f"meshnet node: {flag} is a size in MiB, 0 or more (0 turns it off), not {mib:g}")
    _check_offload(args)  # before the port, the fetch and the model: a CPU build says what to rebuild
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
    if args.layers == "auto":
        from meshnet.cli.placement import run_auto_node

        return run_auto_node(args, sock, gguf)
    started = time.monotonic()
    seeder = None  # with --manifest: the BitTorrent swarm that fetched the files and keeps seeding them
    try:
        if gguf is None:
            seeder, shard, advert = fetch_node_shard(args)
        else:
            shard, advert = load_shard(args, gguf)
    except (MeshnetError, ValueError) as exc:
        sock.close()
        print(f"meshnet node: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1 if isinstance(exc, FetchError) else 2
    return serve_node(args, sock, shard, advert, started=started, seeder=seeder)


def _check_offload(args: argparse.Namespace) -> None:
    """``--gpu-layers`` on a node that can offload them: a llama.cpp node on a GPU build (else exit 2)."""
    if not args.gpu_layers:
        return
    if args.backend != "llama" or args.hf is not None:
        usage_error("meshnet node: --gpu-layers offloads llama.cpp layers; give it to a --backend llama node")
    from meshnet.backends.gpu import offload_error

    problem = offload_error(args.gpu_layers)
    if problem is not None:
        usage_error(f"meshnet node: {problem}")


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
    return serve_node(args, sock, shard, advert, started=started, seeder=None)
