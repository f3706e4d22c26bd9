"""``meshnet node --layers auto``: ask the tracker for a range, load it, serve it; move when told.

The node binds its socket first (as every node does), builds its ask from the manifest or the GGUF
(``node.placement``), asks the tracker (``POST /v1/placement``), then fetches (``--manifest``: only
the assigned range's files) or cuts (``--gguf``) and loads the range, and serves it. When a
heartbeat answer says ``move``, the node drains, its server stops, and this loop loads the new
range and serves it on the same socket — same URL, same node id — so its next registration tells
the tracker the move is done. A new range that fails to load sends the node back to the old one.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest, MeshnetError

__all__ = ["add_placement_arguments", "auto_cap", "check_placement_args", "run_auto_node", "wait_placed"]

GIB = 2**30
_SIZING_CTX = 2048  # KV budget per session when --ctx leaves it to the model


def add_placement_arguments(node: argparse.ArgumentParser) -> None:
    node.add_argument(
        "--memory-gb",
        type=float,
        help="with --layers auto: memory for this node's layers and the KV of its sessions (GiB; default 90%% of "
        "the memory available at start: with --gpu-layers all the GPUs' free memory, with --gpu-layers N the host's "
        "and the GPUs'); the tracker sizes the range to it",
    )
    node.add_argument(
        "--max-layers",
        type=int,
        help="with --layers auto: hold at most this many layers, whatever the memory allows",
    )
    node.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="with --layers auto: when the tracker moves this node to uncovered layers, wait at most this long "
        "for its sessions to end (seconds, default 300)",
    )


def check_placement_args(args: argparse.Namespace) -> None:
    """Usage errors of ``--layers auto`` and its options, before anything loads (exit 2)."""
    from meshnet.cli.serve import usage_error
    from meshnet.node.placement import AUTO

    auto = args.layers == AUTO
    if not auto:
        for flag, value in (("--memory-gb", args.memory_gb), ("--max-layers", args.max_layers)):
            if value is not None:
                usage_error(f"meshnet node: {flag} sizes a range the tracker assigns: give --layers auto with it")
        return
    if not args.tracker:
        usage_error("meshnet node: --layers auto asks the tracker for a range: give --tracker URL")
    if args.hf is not None:
        usage_error("meshnet node: --layers auto serves a GGUF or a manifest, not --hf; give --layers START:STOP")
    if args.memory_gb is not None and not args.memory_gb > 0:
        usage_error(f"meshnet node: --memory-gb is a size in GiB above 0, not {args.memory_gb:g}")
    if args.max_layers is not None and args.max_layers < 1:
        usage_error(f"meshnet node: --max-layers is at least 1, not {args.max_layers}")
    if not args.drain_timeout >= 0:
        usage_error(f"meshnet node: --drain-timeout is 0 seconds or more, not {args.drain_timeout:g}")


def _ask(args: argparse.Namespace, gguf: Path | None) -> tuple[str, dict[str, Any]]:
    """The model id and this node's ask."""
    from meshnet.node.placement import ask_from_gguf, ask_from_manifest, default_budget_bytes

    gpu_layers = getattr(args, "gpu_layers", 0)
    budget = int(args.memory_gb * GIB) if args.memory_gb is not None else default_budget_bytes(gpu_layers)
    kv_tokens = (args.ctx or _SIZING_CTX) * args.max_sessions
    sizing = {"kv_tokens": kv_tokens, "budget_bytes": budget, "max_layers": args.max_layers}
    if gguf is None:
        from meshnet.artifacts.fetch import load_source

        manifest, _ = load_source(args.manifest, expect_digest=args.manifest_digest)
        return manifest.model_id, ask_from_manifest(manifest, **sizing)
    try:
        return gguf.name.removesuffix(".gguf"), ask_from_gguf(gguf, **sizing)
    except (KeyError, ValueError, OSError) as exc:
        raise InvalidRequest(f"cannot read the layer sizes of {gguf}: {exc}", param="gguf") from None


def _load(args: argparse.Namespace, gguf: Path | None) -> tuple[Any, Any, dict[str, Any]]:
    """(seeder or None, shard, advert) for ``args.layers``."""
    from meshnet.cli.artifacts import fetch_node_shard
    from meshnet.cli.node_run import load_shard

    if gguf is None:
        seeder, shard, advert = fetch_node_shard(args)
        return seeder, shard, advert
    shard, advert = load_shard(args, gguf)
    return None, shard, advert


def run_auto_node(args: argparse.Namespace, sock: socket.socket, gguf: Path | None) -> int:
    """The node's life: placed, loaded, served; again for every move. Closes ``sock``."""
    from meshnet.artifacts.fetch import FetchError
    from meshnet.cli.node_run import serve_node
    from meshnet.node.placement import AutoPlacement, request_placement

    tls = args.member_tls
    args.node_id = args.node_id or (tls.member_id if tls else f"node-{sock.getsockname()[1]}")
    try:
        model, ask = _ask(args, gguf)
        layers, why = request_placement(
            args.tracker.rstrip("/"), args.node_id, model, ask, tls=tls.client_context() if tls else None
        )
    except MeshnetError as exc:
        sock.close()
        print(f"meshnet node: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidRequest) else 1
    print(f"meshnet: the tracker placed node {args.node_id} on layers {layers} of {model}: {why}", flush=True)
    placement = AutoPlacement(ask, drain_timeout_s=args.drain_timeout)
    previous = None
    try:
        while True:
            args.layers = str(layers)
            started = time.monotonic()
            try:
                seeder, shard, advert = _load(args, gguf)
            except (MeshnetError, ValueError) as exc:
                print(f"meshnet node: {getattr(exc, 'message', exc)}", file=sys.stderr, flush=True)
                if previous is None:
                    return 1 if isinstance(exc, FetchError) else 2
                print(f"meshnet: could not load layers {layers}; back to layers {previous}", flush=True)
                layers, previous = previous, None
                continue
            serve_node(args, sock.dup(), shard, advert, started=started, seeder=seeder, placement=placement)
            if placement.target is None:
                return 0
            previous, layers = layers, placement.take_target()
            print(f"meshnet: node {args.node_id} drained; moving from layers {previous} to {layers}", flush=True)
    finally:
        sock.close()


def auto_cap(serving: list[Any], starts: list[int] | None) -> int | None:
    """``meshnet up``: the ``--max-layers`` that makes equal ``--layers auto`` nodes, placed one
    after another, end up on exactly the ranges ``serving`` (its equal split); ``None`` when no
    such cap exists (some splits of few layers over many nodes), and up places its nodes by hand.
    Checked by running the tracker's own decision (``tracker.placement``) on the empty swarm."""
    from meshnet.tracker.placement import Ask, Holder, choose_range, reserved_throughput

    total = serving[0].total
    cap = max(len(r) for r in serving)
    bounds = tuple(sorted({*(starts if starts is not None else range(total)), total}))
    ask = Ask(total, (1,) * total, total, bounds, max_layers=cap)
    holders: list[Holder] = []
    for i in range(len(serving)):
        got = choose_range(ask, holders).layers
        holders.append(Holder(f"node-{i}", got, reserved_throughput(got), live=False))
    return cap if [h.layers for h in holders] == list(serving) else None


def wait_placed(tracker_url: str, node_ids: set[str], deadline: float, tls: Any = None) -> None:
    """``meshnet up``: wait until every one of ``node_ids`` holds its range (a reservation or a
    registration), so nodes placed by hand after them (spares) cannot change where they go."""
    import httpx

    while time.monotonic() < deadline:
        try:
            placed = {r["node_id"] for r in httpx.get(f"{tracker_url}/v1/placement", timeout=5, verify=tls or True)
                      .json()["reservations"]}  # fmt: skip
            placed |= {n["node_id"] for n in httpx.get(f"{tracker_url}/v1/nodes", timeout=5, verify=tls or True)
                       .json()["nodes"]}  # fmt: skip
            if node_ids <= placed:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"nodes {sorted(node_ids)} were not placed by the tracker in time")
