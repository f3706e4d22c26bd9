"""``meshnet`` entry point: argument parsing and dispatch. Exit codes: 0 ok, 1 runtime failure, 2 usage."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshnet import __version__
from meshnet.cli.artifacts import add_artifact_commands
from meshnet.cli.serve import add_allow_uncertified, add_api_keys, add_chat_template, add_gpu_layers
from meshnet.cli.swarm import add_decode_batch, add_speculative, add_swarm_commands, at_least_one
from meshnet.cli.swarm_admin import add_swarm_admin_commands

__all__ = ["main"]


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="KV/state and seam bytes of a model at a context length")
    plan.add_argument("config", type=Path, help="a config.json (or its folder), a .gguf or a manifest.json")
    plan.add_argument("--context", type=int, default=131072, help="tokens of context (default 131072)")
    plan.add_argument("--layers", help="only this layer range, START:STOP")
    plan.add_argument("--cache-dtype", help="KV cache dtype (default: the config's dtype; f16 for a GGUF)")
    plan.add_argument("--seam-dtype", default="bfloat16", help="activation dtype on the wire (default bfloat16)")
    plan.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill chunk (default 2048)")
    plan.add_argument(
        "--nodes",
        type=int,
        help="also audit serving it over this many nodes (a config.json): weights counted per layer, memory per node",
    )
    plan.add_argument(
        "--weight-bits", type=float, default=4.5, help="with --nodes: bits per weight (default 4.5, about Q4_K_M)"
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet", description="Meshnet: run GGUF models, alone or split over a swarm of nodes."
    )
    parser.add_argument("--version", action="version", version=f"meshnet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve one GGUF on this machine with the OpenAI API")
    serve.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--threads", type=int, help="llama.cpp threads (default: all cores)")
    add_gpu_layers(serve)
    serve.add_argument("--ctx", type=int, help="context window in tokens (default: the context cap)")
    serve.add_argument("--batch", type=int, default=512, help="prefill chunk / llama.cpp batch (default 512)")
    serve.add_argument("--model-id", help="model id clients use (default: the GGUF file name)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait (default 64)")
    serve.add_argument(
        "--max-body-mb", type=float, default=16.0, help="largest API request body accepted (MiB, default 16)"
    )
    add_chat_template(serve)
    add_api_keys(serve)

    shard = sub.add_parser("shard", help="layer-range shard files")
    shard_sub = shard.add_subparsers(dest="shard_command", required=True, metavar="ACTION")
    make = shard_sub.add_parser("make", help="cut a layer range out of a full GGUF into a loadable shard GGUF")
    make.add_argument("--gguf", type=Path, help="full model GGUF (default: the bundled model)")
    make.add_argument("--layers", required=True, help="half-open block range START:STOP, e.g. 10:20")
    make.add_argument("--out", type=Path, required=True, help="shard file to write (.gguf)")
    make.add_argument("--keep-vocab", action="store_true", help="keep the full vocabulary on a non-tail shard (slower)")
    add_allow_uncertified(make)

    add_swarm_commands(sub)
    add_swarm_admin_commands(sub)
    add_artifact_commands(sub)
    _add_plan_parser(sub)
    _add_up_parser(sub)

    chat = sub.add_parser("chat", help="chat with a Meshnet server from the terminal")
    chat.add_argument("prompt", nargs="?", help="one prompt; without it, an interactive session starts")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server URL (default http://127.0.0.1:8000)")
    chat.add_argument("--model", help="model id (default: the server's first model)")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--no-status", action="store_true", help="hide the live status line")
    return parser


def _add_up_parser(sub: Any) -> None:
    up = sub.add_parser("up", help="run a whole local swarm: tracker, N nodes, gateway")
    up.add_argument("--gguf", type=Path, help="GGUF to split (default: the bundled model)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    up.add_argument("--nodes", type=int, default=3, help="shard node processes, spares included (default 3)")
    up.add_argument(
        "--spares",
        type=int,
        default=0,
        help="of those, spares holding every layer but the head's: route repair replaces a failed node with one",
    )
    up.add_argument("--backend", choices=("llama", "torch"), default="llama")
    up.add_argument(
        "--audit-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="audit this fraction of sessions: one more (trusted) node per layer range runs as an auditor, "
        "never routed, and re-executes audited sessions bit for bit (default 0: up's own nodes are trusted; "
        "docs/security.md, Audit sampling)",
    )
    up.add_argument(
        "--threads", type=int, help="threads per node (default: cores / nodes, at least 1; with --core-lease all cores)"
    )
    up.add_argument(
        "--core-lease",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let each node compute with all the cores, one node at a time (a machine-wide lease), instead of "
        "splitting the cores between the nodes (measured slower on 2 cores: benchmarks/RESULTS.md, route)",
    )
    add_gpu_layers(up, what="each llama.cpp node's range")
    up.add_argument(
        "--ctx",
        type=int,
        help="context per session (default: the model's trained context, at most 131,072, lowered to what each "
        "node's share of the memory holds)",
    )
    up.add_argument(
        "--max-sessions",
        type=at_least_one,
        default=4,
        help="sessions each node holds at once, and generations the gateway runs at once (default 4)",
    )
    add_decode_batch(up)
    up.add_argument(
        "--wire-dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="activations between nodes (default float32: exact, and loopback bandwidth is free)",
    )
    up.add_argument("--workdir", help="where logs and the tracker database go (default: a temp dir)")
    add_speculative(up)
    add_chat_template(up)
    add_api_keys(up)
    add_allow_uncertified(up)
    up.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run it as a private swarm (the default): a CA under the workdir, every member joined with an invite, "
        "mutual TLS and route tickets between tracker, nodes and gateway (the gateway's OpenAI port stays plain "
        "HTTP on loopback); --no-tls: plain HTTP, any process on this machine can reach the tracker and nodes",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        from meshnet.cli.serve import run_serve

        return run_serve(args)
    if args.command in ("node", "tracker", "gateway", "up"):
        from meshnet.cli import hubs, swarm, up

        runner = {"node": swarm.run_node, "tracker": hubs.run_tracker, "gateway": hubs.run_gateway}
        return runner[args.command](args) if args.command in runner else up.run_up(args)
    if args.command == "swarm":
        from meshnet.cli.swarm_admin import run_swarm

        return run_swarm(args)
    if args.command == "plan":
        from meshnet.cli.shard import run_plan

        return run_plan(args)
    if args.command == "shard":
        from meshnet.cli.shard import run_shard_make

        return run_shard_make(args)
    if args.command in ("publish", "fetch"):
        from meshnet.cli import artifacts

        return artifacts.run_publish(args) if args.command == "publish" else artifacts.run_fetch(args)
    if args.command == "chat":
        from meshnet.cli.chat import run_chat

        return run_chat(args)
    raise AssertionError(args.command)  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
