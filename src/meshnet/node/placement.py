"""A ``--layers auto`` node's side of automatic placement (docs/tracker.md, "Placement").

- ``ask_from_manifest`` / ``ask_from_gguf``: what this node can hold, as the tracker's
  ``PlacementAdvert`` JSON: bytes per layer (the layer's share of its published file, or its GGUF
  tensors, plus the KV budget of ``--max-sessions`` sessions at ``--ctx``), the head's embedding
  table and the tail's lm_head apart, the memory budget, and the boundaries a range may start and
  stop at (the manifest's files, or the model family's cut rules).
- ``request_placement``: ``POST /v1/placement`` before anything is fetched or loaded: the range.
- ``AutoPlacement``: owned by the node's event loop (the heartbeat task). Each heartbeat sends the
  ask; an answer carrying ``move`` starts the drain: the node waits for its sessions to end (the
  tracker routes it no new ones), at most ``drain_timeout_s``, then stops its server, and the CLI
  loads the new range on the same socket and registers with it (``cli.placement``).

Any swarm member may lie, the tracker included: a move is followed only to a range this node's own
ask allows (on its boundaries, within its memory and ``--max-layers``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sized  # the session store: only its live-session count is read
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.layers import LayerRange

if TYPE_CHECKING:
    from meshnet.artifacts.manifest import Manifest

__all__ = [
    "AUTO",
    "AutoPlacement",
    "ask_from_gguf",
    "ask_from_manifest",
    "default_budget_bytes",
    "request_placement",
]

AUTO = "auto"
PLACEMENT_PATH = "/v1/placement"
BUDGET_SHARE = 0.9  # of the memory available at start, when --memory-gb is not given
_ASK_TIMEOUT_S = 10.0
_ASK_FOR_S = 60.0  # a tracker still starting (meshnet up starts them together) gets this long
_DRAIN_POLL_S = 0.5
log = logging.getLogger("meshnet.node")


def default_budget_bytes(gpu_layers: int = 0) -> int:
    """``BUDGET_SHARE`` of the memory the range's layers and KV will live in: this host's available
    memory (``/proc/meminfo``); with every layer offloaded (``gpu_layers`` -1), the discrete GPUs'
    free memory instead; with some (``gpu_layers`` N), both, as llama.cpp splits the layers between
    them. An integrated GPU's memory is the host's."""
    from meshnet.backends.gpu import discrete_gpus, gpu_devices
    from meshnet.node.advert import host_hardware

    hardware = host_hardware()
    available = hardware["ram_available_bytes"] or hardware["ram_total_bytes"]
    device = sum(d.memory_free_bytes for d in discrete_gpus(gpu_devices())) if gpu_layers else 0
    if gpu_layers < 0 and device:
        return int(BUDGET_SHARE * device)
    if not available:
        raise InvalidRequest("cannot read this host's memory: give --memory-gb", param="memory_gb")
    return int(BUDGET_SHARE * (available + device))


def ask_from_manifest(
    manifest: Manifest, *, kv_tokens: int, budget_bytes: int, max_layers: int | None
) -> dict[str, Any]:
    """A published model's ask: each shard file's size spread over its layers (exact at the
    published boundaries, the only places a range may start or stop), the embedding table as the
    head's, and the manifest's KV bytes per layer for ``kv_tokens`` positions."""
    from meshnet.artifacts.manifest import ROLE_EMBEDDINGS

    per_layer = [0] * manifest.layers
    head = 0
    for layers, names in manifest.layer_map:
        for name in names:
            entry = manifest.file(name)
            if entry.role == ROLE_EMBEDDINGS:
                head += entry.size
                continue
            share, extra = divmod(entry.size, len(layers))
            for i in range(layers.start, layers.stop):
                per_layer[i] += share + (extra if i == layers.start else 0)
    kv = manifest.kv_cache.per_layer
    return _advert(
        [w + kv[i] * kv_tokens for i, w in enumerate(per_layer)],
        list(manifest.boundaries),
        budget_bytes=budget_bytes,
        head=head,
        max_layers=max_layers,
    )


def ask_from_gguf(path: Path, *, kv_tokens: int, budget_bytes: int, max_layers: int | None) -> dict[str, Any]:
    """A GGUF's ask from its tensor sizes: ``blk.i.*`` to layer ``i``, the token table to the head
    (its embedding sidecar), ``output.weight`` (or the tied token table) and the final norm to the
    tail, everything else to every range; KV per layer from its attention shape."""
    from meshnet.artifacts.gguf_source import open_gguf
    from meshnet.artifacts.plan import shape_from_fields
    from meshnet.artifacts.shard_file import range_starts_of, trunk_layers

    # Every part of a split set; the lean header reader (not gguf.GGUFReader: seconds over a big vocabulary)
    source = open_gguf(path)
    fields, sizes = source.fields, {t.name: t.nbytes for t in source.tensors}
    arch = str(fields["general.architecture"].contents())
    total = trunk_layers(fields, arch)
    per_layer, base = [0] * total, 0
    for name, size in sizes.items():
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index < total:
                per_layer[index] += size
                continue
        if name not in ("token_embd.weight", "output.weight", "output_norm.weight"):
            base += size  # rope factors, multi-token-prediction blocks: in every shard file
    table = sizes.get("token_embd.weight", 0)
    tail = sizes.get("output.weight", table) + sizes.get("output_norm.weight", 0)
    kv = shape_from_fields(path, fields).kv_bytes_per_token_per_layer * kv_tokens
    bounds = sorted({*range_starts_of(fields), total})
    return _advert(
        [w + kv for w in per_layer],
        bounds,
        budget_bytes=budget_bytes,
        head=table,
        tail=tail,
        base=base,
        max_layers=max_layers,
    )


def _advert(
    layer_bytes: list[int],
    boundaries: list[int],
    *,
    budget_bytes: int,
    head: int = 0,
    tail: int = 0,
    base: int = 0,
    max_layers: int | None,
) -> dict[str, Any]:
    return {
        "layer_bytes": layer_bytes,
        "budget_bytes": budget_bytes,
        "boundaries": boundaries,
        "head_bytes": head,
        "tail_bytes": tail,
        "base_bytes": base,
        "max_layers": max_layers,
    }


def allows(ask: dict[str, Any], layers: LayerRange) -> bool:
    """Whether ``layers`` is a range this node's own ask lets it hold (a move from a lying tracker
    to anything else is refused)."""
    per_layer: list[int] = ask["layer_bytes"]
    if layers.total != len(per_layer) or layers.start not in ask["boundaries"] or layers.stop not in ask["boundaries"]:
        return False
    if ask["max_layers"] is not None and len(layers) > ask["max_layers"]:
        return False
    cost = ask["base_bytes"] + sum(per_layer[layers.start : layers.stop])
    cost += (ask["head_bytes"] if layers.is_head else 0) + (ask["tail_bytes"] if layers.is_tail else 0)
    return bool(cost <= ask["budget_bytes"])


def request_placement(
    tracker_url: str, node_id: str, model: str, ask: dict[str, Any], *, tls: ssl.SSLContext | None = None
) -> tuple[LayerRange, str]:
    """The range the tracker assigns this node, and why. Retries a tracker that does not answer yet
    for ``_ASK_FOR_S``; a refusal (the ask fits nothing, a bad field) is final."""
    body = {"node_id": node_id, "model": model, "total_layers": len(ask["layer_bytes"]), **ask}
    deadline = time.monotonic() + _ASK_FOR_S
    while True:
        try:
            answer = httpx.post(f"{tracker_url}{PLACEMENT_PATH}", json=body, timeout=_ASK_TIMEOUT_S, verify=tls or True)
            break
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise MeshnetError(f"the tracker {tracker_url} did not answer a placement request: {exc}") from None
            time.sleep(0.5)
    try:
        data = answer.json()
    except ValueError:
        data = {}
    if answer.status_code != 200:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise InvalidRequest(f"the tracker refused a placement: {message or answer.text[:300]}", param="layers")
    layers = LayerRange.parse(str(data.get("layers")), len(ask["layer_bytes"]))
    if not allows(ask, layers):
        raise MeshnetError(f"the tracker assigned layers {layers}, which this node cannot hold; not taken")
    return layers, str(data.get("detail") or data.get("reason") or "")


@dataclass
class _Drain:
    target: LayerRange
    reason: str
    task: asyncio.Task[None] | None = None
    done: bool = False  # drained, and the server told to stop: the CLI loads ``target`` next


class AutoPlacement:
    """The move state of one auto-placed node, across the servers it runs one after another."""

    def __init__(self, ask: dict[str, Any], *, drain_timeout_s: float) -> None:
        self.ask = ask
        self.drain_timeout_s = drain_timeout_s
        self.moves = 0
        self._drain: _Drain | None = None
        self._stop: Callable[[], None] | None = None

    @property
    def target(self) -> LayerRange | None:
        """The range to load next, once the running server stopped for a move (and not for a
        Ctrl-C that came while it drained); else None."""
        return self._drain.target if self._drain is not None and self._drain.done else None

    def attach(self, server: Any) -> None:
        """The uvicorn server now running (``cli.serve.serve_app``'s ``on_start``): a drain stops it."""

        def stop() -> None:
            server.should_exit = True

        self._stop = stop

    def take_target(self) -> LayerRange:
        target = self.target
        assert target is not None
        self._drain = None
        self.moves += 1
        return target

    def advert(self) -> dict[str, Any]:
        return self.ask

    def on_answer(self, answer: dict[str, Any], store: Sized, layers: LayerRange) -> None:
        """Read a registration answer (the heartbeat's); a ``move`` starts the drain once."""
        move = answer.get("move")
        if not isinstance(move, dict) or self._drain is not None:
            return
        try:
            target = LayerRange.parse(str(move.get("layers")), layers.total)
        except ValueError:
            log.warning("placement: the tracker's move %r is no layer range; ignored", move.get("layers"))
            return
        if target == layers or not self.allows(target):
            log.warning("placement: the tracker asked for a move to layers %s, which this node cannot hold", target)
            return
        reason = str(move.get("reason") or "")
        self._drain = _Drain(target, reason)
        log.warning(
            "placement: moving from layers %s to %s (%s); draining %d session(s), at most %.0f s",
            layers,
            target,
            reason,
            len(store),
            self.drain_timeout_s,
        )
        self._drain.task = asyncio.get_running_loop().create_task(self._wait_then_stop(store))

    def allows(self, layers: LayerRange) -> bool:
        return allows(self.ask, layers)

    async def _wait_then_stop(self, store: Sized) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while len(store) and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if len(store):
            log.warning(
                "placement: %d session(s) still open after %.0f s; moving anyway", len(store), self.drain_timeout_s
            )
        if self._drain is not None and self._stop is not None:
            self._drain.done = True
            self._stop()

    def cancel(self) -> None:
        """The server stopped for another reason (Ctrl-C): no move."""
        if self._drain is not None and self._drain.task is not None:
            self._drain.task.cancel()
        self._drain = None
