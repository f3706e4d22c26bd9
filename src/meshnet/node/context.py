"""How many positions one session may hold on a node: a pure decision, made once at start-up.

The default is the model's trained context (GGUF ``{arch}.context_length``), capped at the
product's cap (``PRODUCT_CONTEXT_CAP``), and lowered to what the node's KV budget holds for *its
own layers* at its ``--max-sessions``: llama.cpp allocates every session's cells up front, so a
context the memory cannot hold would fail at load or swap the machine. An explicit ``--ctx`` is
taken as asked, but never past the trained context or the product cap (positions past the trained
context give garbage, not an error). The node says what it chose and why (``ContextChoice.reason``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.backends.gpu import GpuDevice, discrete_gpus, gpu_label
from meshnet.config import PRODUCT_CONTEXT_CAP
from meshnet.errors import InvalidRequest

__all__ = [
    "CONTEXT_ALIGN",
    "DEFAULT_MEMORY_SHARE",
    "MIN_CONTEXT",
    "PRODUCT_CONTEXT_CAP",
    "ContextChoice",
    "choose_context",
    "kv_budget",
]

MIN_CONTEXT = 16  # fewer than this is no usable session (the --ctx floor of meshnet serve)
# A context lowered to fit memory is rounded down to a multiple of llama.cpp's KV padding, so the
# cells a session gets are the cells it was promised.
CONTEXT_ALIGN = 256
# Without --kv-budget-mb a node takes this share of the memory available at start-up for its KV:
# the rest is left to its weights' page cache, the prefix cache and the other processes.
DEFAULT_MEMORY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class ContextChoice:
    per_session: int  # positions one session may hold
    reason: str  # one sentence for the start-up log: what bounded it


def choose_context(
    *,
    trained: int,
    kv_bytes_per_token: int,
    max_sessions: int,
    budget_bytes: int | None,
    asked: int | None = None,
    budget_source: str = "the KV budget",
) -> ContextChoice:
    """The per-session context of a node whose layers need ``kv_bytes_per_token`` (0: unknown) and
    whose sessions share ``budget_bytes`` of KV (None: no limit known). ``InvalidRequest`` (a usage
    error at start-up) when ``asked`` exceeds the cap or the budget cannot hold a usable session."""
    cap = min(trained, PRODUCT_CONTEXT_CAP) if trained > 0 else PRODUCT_CONTEXT_CAP
    bounded_by = (
        f"the model's trained context {trained:,}"
        if 0 < trained <= PRODUCT_CONTEXT_CAP
        else f"the product cap {PRODUCT_CONTEXT_CAP:,}"
    )
    if asked is not None:
        if asked < MIN_CONTEXT:
            raise InvalidRequest(f"--ctx must be at least {MIN_CONTEXT} tokens, got {asked}", param="ctx")
        if asked > cap:
            raise InvalidRequest(
                f"--ctx {asked:,} exceeds the context cap {cap:,} ({bounded_by}); give at most {cap:,}, or leave "
                "--ctx out to take the most the model and this machine allow",
                param="ctx",
            )
        return ContextChoice(asked, f"--ctx {asked:,} as given (the cap is {cap:,}: {bounded_by})")
    if budget_bytes is None or kv_bytes_per_token <= 0:
        return ContextChoice(cap, f"{bounded_by}; no KV budget limits it")
    fits = budget_bytes // (max_sessions * kv_bytes_per_token)
    if fits >= cap:
        return ContextChoice(
            cap,
            f"{bounded_by}; {budget_source} of {budget_bytes / 2**20:,.0f} MiB holds {fits:,} positions per session "
            f"at --max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers)",
        )
    lowered = fits - fits % CONTEXT_ALIGN if fits >= CONTEXT_ALIGN else fits
    if lowered < MIN_CONTEXT:
        raise InvalidRequest(
            f"{budget_source} of {budget_bytes / 2**20:,.1f} MiB holds only {fits} positions per session at "
            f"--max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers); give more "
            "memory (--kv-budget-mb), fewer --max-sessions or fewer layers",
            param="kv_budget_mb",
        )
    return ContextChoice(
        lowered,
        f"lowered from {cap:,} ({bounded_by}) to fit {budget_source} of {budget_bytes / 2**20:,.0f} MiB at "
        f"--max-sessions {max_sessions} ({kv_bytes_per_token:,} KV bytes/token for these layers)",
    )


def kv_budget(
    host_available: int | None,
    devices: Sequence[GpuDevice] = (),
    *,
    gpu_layers: int = 0,
    layer_weights: Sequence[int] = (),
) -> tuple[int | None, str]:
    """The KV budget of a node without ``--kv-budget-mb``, and what it is, for the start-up log.

    On the CPU: ``DEFAULT_MEMORY_SHARE`` of the host memory available now (``None``: unknown). With
    ``gpu_layers`` of the range's ``len(layer_weights)`` layers offloaded (the last ones; -1: all)
    to discrete GPUs, llama.cpp keeps an offloaded layer's KV on the device beside its weights and
    the other layers' in host memory: the devices give the same share of their free memory after
    the offloaded layers' weights (``layer_weights``, bytes per layer of the range, in order), and
    the budget is the largest KV whose split between the two (by layers) fits both. An integrated
    GPU's memory is the host's, so it adds nothing."""
    host = None if host_available is None else int(host_available * DEFAULT_MEMORY_SHARE)
    host_source = f"{DEFAULT_MEMORY_SHARE:.0%} of the memory available now"
    discrete = discrete_gpus(devices)
    layers = len(layer_weights)
    if gpu_layers == 0 or not discrete or layers == 0:
        return host, host_source
    offloaded = layers if gpu_layers < 0 else min(gpu_layers, layers)
    on_device = offloaded / layers
    weights = sum(layer_weights[layers - offloaded :])
    free = sum(d.memory_free_bytes for d in discrete)
    device = max(0, int((free - weights) * DEFAULT_MEMORY_SHARE))
    label = gpu_label(discrete)
    device_source = f"{DEFAULT_MEMORY_SHARE:.0%} of {label}'s free memory after {offloaded} layers' weights"
    if offloaded == layers or host is None:  # all of the KV on the devices (or the host's share unknown)
        return int(device / on_device), device_source
    by_host = int(host / (1 - on_device))
    by_device = int(device / on_device)
    source = f"{device_source} ({offloaded} of {layers} layers' KV) and {host_source} (the other {layers - offloaded})"
    return min(by_host, by_device), source
