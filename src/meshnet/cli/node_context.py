"""``meshnet node``'s context flags: ``--ctx`` and ``--kv-budget-mb``, resolved at start-up.

The decision itself is ``node.context.choose_context`` (pure); this module reads what it needs
from the command line and the machine (the memory available now) and says the result once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from meshnet.cli.serve import usage_error
from meshnet.errors import InvalidRequest
from meshnet.node.advert import host_hardware
from meshnet.node.context import DEFAULT_MEMORY_SHARE, PRODUCT_CONTEXT_CAP, choose_context, kv_budget

__all__ = ["add_context_arguments", "node_context"]


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ctx",
        type=int,
        default=None,
        help=f"positions one session may hold (default: the model's trained context, at most {PRODUCT_CONTEXT_CAP:,}, "
        "lowered to what --kv-budget-mb holds for this node's layers at --max-sessions)",
    )
    parser.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help=f"memory for the KV of all sessions on this node, in MiB (default: {DEFAULT_MEMORY_SHARE * 100:.0f}%% "
        "of the memory available at start-up, and of the GPUs' free memory after their layers' weights for the "
        "KV of layers offloaded with --gpu-layers); the default context is lowered to fit it",
    )


def node_context(
    args: argparse.Namespace, *, trained: int, kv_bytes_per_token: int, layer_weights: Callable[[], Sequence[int]]
) -> int:
    """The per-session context this node runs with; prints what bounded it (a usage error, exit 2,
    when ``--ctx`` exceeds the cap or the budget holds no usable session). ``layer_weights``: the
    weight bytes of each layer of the range, read only when layers are offloaded to a GPU (whose
    free memory then bounds the KV: ``node.context.kv_budget``)."""
    budget_mb = getattr(args, "kv_budget_mb", None)
    if budget_mb is not None and not budget_mb > 0:
        usage_error(f"meshnet node: --kv-budget-mb is a size in MiB, more than 0, not {budget_mb:g}")
    budget: int | None
    if budget_mb is not None:
        budget, source = int(budget_mb * 2**20), "--kv-budget-mb"
    else:
        available = host_hardware().get("ram_available_bytes")
        gpu_layers = getattr(args, "gpu_layers", 0)
        if gpu_layers:
            from meshnet.backends.gpu import gpu_devices

            budget, source = kv_budget(available, gpu_devices(), gpu_layers=gpu_layers, layer_weights=layer_weights())
        else:
            budget, source = kv_budget(available)
    try:
        choice = choose_context(
            trained=trained,
            kv_bytes_per_token=kv_bytes_per_token,
            max_sessions=args.max_sessions,
            budget_bytes=budget,
            asked=args.ctx,
            budget_source=source,
        )
    except InvalidRequest as exc:
        usage_error(f"meshnet node: {exc.message}")
    print(f"meshnet: context {choice.per_session:,} positions per session: {choice.reason}", flush=True)
    return choice.per_session


def shape_advert(trained: int, identity: str) -> dict[str, Any]:
    """What a node advertises about the model it serves beyond ``ShardInfo`` (docs/tracker.md)."""
    return {"context_length": trained, "identity": identity}
