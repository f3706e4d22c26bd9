"""A node's registrations with its tracker (``heartbeat``): the advertisement every
``heartbeat_s``, the candidate next hops probed in the background, revocations learned, an
automatic placement told what the tracker answered, and the manifest handed over when asked."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

import httpx

from meshnet.httputil import error_message
from meshnet.node.advert import LatencyProber, advert_fields, host_hardware
from meshnet.node.placement import AutoPlacement
from meshnet.node.service import NodeService
from meshnet.security.revocation import RevokedSerials

__all__ = ["heartbeat"]


async def heartbeat(
    node: NodeService,
    client: httpx.AsyncClient,
    tracker_url: str,
    revoked: RevokedSerials | None = None,
    placement: AutoPlacement | None = None,
) -> None:
    """Register, then re-register every ``heartbeat_s``: a restarted tracker relearns us by itself.

    Each registration carries the advertisement (``node.advert``); the tracker answers with the
    candidate next hops, which are probed in the background and reported on the next heartbeat.
    """
    info = node.info
    log = logging.getLogger("meshnet.node")
    extra = dict(node.config.advert)
    threads = extra.pop("threads", None)
    prober = LatencyProber()
    probing: asyncio.Task[None] | None = None
    reported = False
    try:
        while True:
            node.traffic.news.clear()
            body = {
                "node_id": node.config.node_id,
                "url": node.config.url,
                "model": info.model_id,
                "layers": str(info.layers),
                "total_layers": info.layers.total,
                "backend": info.backend,
                "kv_bytes_free": node.shard.store.free_bytes(),
                "heartbeat_s": node.config.heartbeat_s,
                "wire_dtype": node.config.wire_dtype,
                "hop_key": node.config.hop_key.public,  # what its entries are signed with (protocol.signing)
                "auditor": node.config.auditor,  # never routed; re-executes audited sessions (node.audit)
                "hardware": host_hardware(threads),
                **advert_fields(node.shard, node.traffic, prober),
                "prefix_filter": node.prefix_cache.filter().encode() if node.prefix_cache is not None else None,
                **extra,
                **({"placement": placement.advert()} if placement is not None else {}),
            }
            try:
                response = await client.post(f"{tracker_url}/v1/nodes", json=body, timeout=5.0)
                if response.status_code >= 400:
                    log.warning("tracker refused registration: %s", error_message(response))
                else:
                    answer = response.json()
                    if revoked is not None and isinstance(answer.get("revoked"), list):
                        revoked.update(answer["revoked"])
                    if answer.get("manifest_wanted") and node.config.publication is not None:
                        await _hand_over(client, tracker_url, node.config.publication, log)
                    if placement is not None:
                        placement.on_answer(answer, node.shard.store, info.layers)
                    if probing is None or probing.done():
                        hops = answer.get("next_hops") or []
                        probing = asyncio.create_task(prober.probe(client, [str(h) for h in hops]))
                        probing.add_done_callback(_consume)
                reported = False
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                if not reported:  # say it once per outage, not every heartbeat
                    log.warning("tracker %s unreachable (%s); retrying", tracker_url, exc)
                    reported = True
            with contextlib.suppress(TimeoutError):  # the self-benchmark finishing wakes us early
                await asyncio.wait_for(node.traffic.news.wait(), node.config.heartbeat_s)
    finally:
        if probing is not None:
            probing.cancel()


async def _hand_over(client: httpx.AsyncClient, tracker_url: str, publication: tuple[bytes, bytes], log: Any) -> None:
    """Give the tracker the manifest and torrent this node serves from (it asked: it holds none).
    Best effort: a failure is logged, and the next heartbeat's answer asks again."""
    manifest, torrent = publication
    body = {"manifest": manifest.decode(), "torrent": base64.b64encode(torrent).decode()}
    try:
        response = await client.post(f"{tracker_url}/v1/manifests", json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        log.warning("could not hand the manifest to the tracker: %s", exc)
        return
    if response.status_code >= 400:
        log.warning("the tracker refused the manifest: %s", error_message(response))


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # logged by the prober itself
