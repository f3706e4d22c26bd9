"""A node's shard loaded and served: the part of ``meshnet node`` after its flags are read, shared by
fixed ranges (cli.swarm) and ``--layers auto`` (cli.placement)."""

from __future__ import annotations

import argparse
import os
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from meshnet.cli.member_tls import check_covers
from meshnet.cli.node_context import node_context, shape_advert
from meshnet.cli.paths import default_cache_dir, load_checks_dir
from meshnet.cli.serve import serve_app, usage_error
from meshnet.errors import MeshnetError
from meshnet.httputil import is_wildcard, service_url
from meshnet.layers import LayerRange

__all__ = ["TRACKER_SESSIONS_PER_CLIENT", "check_advertisable", "load_shard", "per_client", "public_url", "serve_node"]

# A member's open sessions on a private swarm's tracker: far above any one gateway's honest use
# (its concurrency and queue), far below what fills the tracker's database.
TRACKER_SESSIONS_PER_CLIENT = 256


def public_url(raw: str | None) -> str | None:
    """``--public-url``, checked: ``http(s)://HOST:PORT`` that peers can dial (hops append their paths)."""
    if raw is None:
        return None
    try:
        return service_url(raw)
    except ValueError as exc:
        usage_error(f"meshnet node: --public-url {exc}")


def check_advertisable(host: str, public_url: str | None) -> None:
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


def per_client(args: argparse.Namespace) -> int:
    """``--max-sessions-per-client`` (at most ``--max-sessions``). By default one slot fewer than
    ``--max-sessions``: a member that squats every session it may hold still leaves one for the
    others, and the usual single gateway loses one slot, which it waits for rather than fails on
    (gateway.route_engine); ``meshnet up`` passes ``--max-sessions`` (its gateway is the only client)."""
    if args.max_sessions_per_client is None:
        return max(1, int(args.max_sessions) - 1)
    if args.max_sessions_per_client > args.max_sessions:
        usage_error(
            f"meshnet node: --max-sessions-per-client {args.max_sessions_per_client} is more than --max-sessions "
            f"{args.max_sessions}; give at most {args.max_sessions}"
        )
    return int(args.max_sessions_per_client)


def serve_node(
    args: argparse.Namespace,
    sock: socket.socket,
    shard: Any,
    advert: dict[str, Any],
    *,
    started: float,
    seeder: Any,
    placement: Any = None,
) -> int:
    from meshnet.memory import release_free_memory

    release_free_memory()  # what the fetch and the load freed, back to the OS before serving
    host, port = sock.getsockname()[:2]
    if args.core_lease is not None:
        from meshnet.cores import CoreLease

        try:
            shard.core_lease = CoreLease(args.core_lease)
        except ValueError as exc:
            usage_error(f"meshnet node: --core-lease: {exc}")
    tls = args.member_tls
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    public = public_url(args.public_url) or url
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
        max_sessions_per_client=per_client(args),
        publication=(seeder.manifest.to_json(), seeder.torrent_bytes) if seeder is not None else None,
        sample_deadline_s=args.sample_deadline,
        auditor=args.auditor,
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
        app = create_node_app(shard, config, placement=placement)
        on_start = None if placement is None else placement.attach  # a --layers auto node's drain stops it
        if tls is None:
            serve_app(app, sock, on_start=on_start)
        else:
            serve_app(RequireMember(app, tls.ca_cert), sock, tls=tls.server_context(), on_start=on_start)
    finally:
        if seeder is not None:
            seeder.close()
    return 0


def load_shard(args: argparse.Namespace, gguf: Path) -> tuple[Any, dict[str, Any]]:
    """The shard, and what the node advertises about it beyond ``ShardInfo`` (node.advert)."""
    from meshnet.backends.llama_vocab import LlamaVocab

    vocab = LlamaVocab(gguf)
    total, model_id = vocab.info.n_layers, vocab.info.model_id
    vocab.close()
    layers = LayerRange.parse(args.layers, total)
    threads = args.threads or os.cpu_count() or 1
    trained, identity, kv_per_token = _model_facts(gguf, layers)
    advert = {"quantization": vocab.info.quantization, "threads": threads, **shape_advert(trained, identity)}
    if args.backend == "torch":
        from meshnet.backends.torch_shard import StoreBudget, TorchShard, set_threads

        set_threads(threads)
        budget = StoreBudget(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl)
        shard = TorchShard.from_gguf(gguf, layers, budget=budget)
        if shard.info.model_id != model_id:
            raise ValueError(f"the torch backend names the model {shard.info.model_id!r}, the gateway {model_id!r}")
        return shard, advert
    from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig

    def layer_weights() -> list[int]:
        from meshnet.node.placement import ask_from_gguf

        sizes: list[int] = ask_from_gguf(gguf, kv_tokens=0, budget_bytes=0, max_layers=None)["layer_bytes"]
        return sizes[layers.start : layers.stop]

    per_session = node_context(args, trained=trained, kv_bytes_per_token=kv_per_token, layer_weights=layer_weights)
    config = LlamaShardConfig(
        n_ctx=per_session * args.max_sessions,
        max_sessions=args.max_sessions,
        n_threads=threads,
        idle_ttl_s=args.session_ttl,
        decode_batch=args.decode_batch,
        checks_cache=load_checks_dir(args.cache_dir),
        gpu_layers=args.gpu_layers,
    )
    if layers.is_full:
        return LlamaShard(gguf, model_id=model_id, config=config), advert
    cache = args.cache_dir or default_cache_dir()
    return LlamaShard.from_model(gguf, layers, cache_dir=cache, model_id=model_id, config=config), advert


def _model_facts(gguf: Path, layers: LayerRange) -> tuple[int, str, int]:
    """The GGUF's trained context, its model identity (artifacts.identity: the same for every range
    of the model, and for the model as one file or as a split set) and the KV bytes per token of
    ``layers`` (artifacts.plan), from one read of every part's header (the lean reader, not gguf-py's:
    seconds and about 0.5 GB over a 150K-token vocabulary)."""
    from meshnet.artifacts.gguf_source import open_gguf
    from meshnet.artifacts.identity import source_identity
    from meshnet.artifacts.plan import shape_from_fields

    source = open_gguf(gguf)
    arch = source.architecture
    context = source.fields.get(f"{arch}.context_length")
    trained = int(context.contents()) if context is not None else 0
    try:
        per_token = shape_from_fields(gguf, source.fields).kv_bytes_per_token_per_layer * len(layers)
    except (MeshnetError, KeyError, ValueError):  # an architecture plan cannot size: the budget does not bound it
        per_token = 0
    return trained, source_identity(source), per_token
