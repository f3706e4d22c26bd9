"""The tracker's HTTP surface: node registration/heartbeat, sticky sessions, the node list (audit
reports and suspensions: ``tracker.audits``).

State: nodes live in memory (they re-register with every heartbeat, so a restarted tracker
refills itself within one heartbeat interval); sessions and their pinned routes are persisted in
the database so a route stays sticky across a tracker restart. The tracker never holds KV.
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import Conflict, InvalidRequest, ModelMismatch
from meshnet.httputil import EXCEPTION_HANDLERS, read_body, service_url, tls_or_default
from meshnet.layers import LayerRange
from meshnet.models.families import family_of_model_type
from meshnet.protocol.prefix import FILTER_BITS, PrefixFilter
from meshnet.protocol.signing import HOP_KEY_CHARS, check_public_key
from meshnet.security.identity import Member
from meshnet.security.membership import (
    CA_PATH,
    JOIN_PATH,
    MAX_JOIN_BODY_BYTES,
    RequireMember,
    SwarmAuthority,
    require_node,
    require_url_in_certificate,
    scope_member,
    tracker_policy,
)
from meshnet.security.revocation import REVOKED_PATH
from meshnet.tracker.audits import AuditsApi, check_auditor_registration
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.limits import REGISTRATIONS, RateLimits
from meshnet.tracker.models import Publications, models_routes
from meshnet.tracker.placement_api import PlacementAdvert, PlacementBook, RoutableNodes, check_advert
from meshnet.tracker.plausibility import SpeedChecks, speed_ceilings
from meshnet.tracker.reliability import Reliability
from meshnet.tracker.routing import Hardware, NodeRecord
from meshnet.tracker.sessions import MAX_BODY_BYTES, SessionsApi, parse_body

__all__ = ["create_tracker_app"]

NODE_TTL_S = 15.0  # three missed 5 s heartbeats
WARM_WINDOW_S = 600.0  # a node that computed anything this recently still has its weights paged in
TAKEOVER_PROBE_S = 2.0  # how long the tracker waits for a registered node to answer before its id may move
MAX_PROBE_TARGETS = 16  # next-hop URLs handed to a node per heartbeat, for it to measure latency to
_RECORD_KEEP_S = 86_400.0  # reliability records of nodes gone this long are forgotten
# What a node may advertise: finite and physically plausible. A speed of 1e-300 positions/s made
# every route estimate infinite (and each route request a 500); 1e12 would win every route.
MIN_TPS, MAX_TPS = 1e-3, 1e7  # positions per second of one layer range (0 = not measured yet)
MAX_LATENCY_MS = 600_000.0
MAX_BYTES = 2**50  # 1 PiB: memory, KV and weight sizes
_Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]


class HardwareAdvert(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    cpu: str | None = Field(None, max_length=256)
    logical_cores: int | None = Field(None, ge=1, le=65_536)
    threads: int | None = Field(None, ge=1, le=65_536)
    ram_total_bytes: _Bytes | None = None
    ram_available_bytes: _Bytes | None = None
    gpu: str | None = Field(None, max_length=256)
    gpu_memory_bytes: _Bytes | None = None  # the GPUs' total memory (node.advert)


class Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    node_id: str = Field(min_length=1, max_length=128)
    url: str = Field(max_length=300)
    model: str = Field(min_length=1)
    layers: str
    total_layers: int = Field(ge=1)
    backend: str = "llama.cpp"
    kv_bytes_free: _Bytes = 0
    # The advertisement (docs/tracker.md); every field is optional so an older node still registers.
    quantization: str | None = Field(None, max_length=64)
    hardware: HardwareAdvert = Field(default_factory=lambda: HardwareAdvert.model_validate({}))
    # positions/s of this layer range; 0 = not measured yet
    prefill_tps: float = Field(0.0, ge=0, le=MAX_TPS, allow_inf_nan=False)
    decode_tps: float = Field(0.0, ge=0, le=MAX_TPS, allow_inf_nan=False)
    queue_depth: int = Field(0, ge=0, le=1_000_000)
    kv_bytes_per_token: _Bytes = 0
    latency_ms: dict[str, Annotated[float, Field(ge=0, le=MAX_LATENCY_MS, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=4 * MAX_PROBE_TARGETS
    )
    # since it last computed anything; None = never
    idle_s: float | None = Field(None, ge=0, le=1e10, allow_inf_nan=False)
    weight_bytes: _Bytes = 0
    heartbeat_s: float = Field(5.0, gt=0, le=NODE_TTL_S)
    manifest: str | None = Field(None, max_length=512)
    files: list[str] = Field(default_factory=list, max_length=100_000)
    bt_peer: str | None = Field(None, pattern=r"^\S+:\d{1,5}$", max_length=300)  # where it seeds them
    numerics: str | None = Field(None, max_length=512)  # what decides its low bits (ShardInfo.numerics)
    wire_dtype: str = Field("float32", pattern=r"^(float32|bfloat16|float16)$")  # the activations it sends
    # The Ed25519 key its answer entries are signed with (protocol.signing); routes hand it to gateways.
    hop_key: str | None = Field(None, min_length=HOP_KEY_CHARS, max_length=HOP_KEY_CHARS)
    architecture: str | None = Field(None, min_length=1, max_length=64)  # GGUF general.architecture
    seam: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1, max_length=4)  # per position
    max_verify: int = Field(0, ge=0, le=1024)  # drafted positions one verify chunk may add (0: no speculation)
    # What it runs, one identity per route (docs/tracker.md): "manifest:sha256:..." or "gguf-sha256:..."
    identity: str | None = Field(None, min_length=1, max_length=128)
    max_positions: int = Field(0, ge=0, le=2**31)  # positions one session may hold on it (0: not said)
    context_length: int = Field(0, ge=0, le=2**31)  # the model's trained context (0: not said)
    # PrefixFilter.encode() of the prompt blocks in its prefix cache (2,732 characters); None: it holds none
    prefix_filter: str | None = Field(None, max_length=FILTER_BITS // 4)
    # A node started with --layers auto: what it can hold (tracker.placement_api; null: placed by hand)
    placement: PlacementAdvert | None = None
    # An auditor re-executes audited hops for gateways and is never routed (tracker.audits).
    auditor: bool = Field(False, strict=True)

    @field_validator("url")
    @classmethod
    def _reachable(cls, url: str) -> str:
        return service_url(url)

    @field_validator("hop_key")
    @classmethod
    def _hop_key(cls, key: str | None) -> str | None:
        return None if key is None else check_public_key(key)

    @field_validator("prefill_tps", "decode_tps")
    @classmethod
    def _measured(cls, tps: float) -> float:
        if 0 < tps < MIN_TPS:
            raise ValueError(f"a measured speed is at least {MIN_TPS:g} positions/s (0 = not measured yet)")
        return tps


class _Tracker:
    """Live nodes (in memory) and every node's reliability record (kept across its expiry)."""

    def __init__(self, db: TrackerDB, revoked: Callable[[], frozenset[str]] | None = None) -> None:
        self.db = db
        self.nodes: dict[str, NodeRecord] = {}
        self.records: dict[str, Reliability] = {}
        self.revoked = revoked  # member ids whose certificate is revoked: off the routes at once
        self.publications = Publications()  # what nodes serve from, for gateways to learn models (tracker.models)

    def live_nodes(self) -> list[NodeRecord]:
        now = time.time()
        cutoff = now - NODE_TTL_S
        gone = self.revoked() if self.revoked is not None else frozenset()
        for node_id in [k for k, n in self.nodes.items() if n.last_seen < cutoff or k in gone]:
            del self.nodes[node_id]
        # A node that is overdue but not yet expired already pays for the heartbeats it missed.
        for node_id, node in self.nodes.items():
            record = self.records.get(node_id)
            if record is not None and now - node.last_seen > 2 * record.interval_s:
                self.nodes[node_id] = replace(node, reliability=record.value(now))
            suspended = self.db.audits.suspended(node_id)  # a failed audit's, or lifted since (tracker.audits)
            if node.suspended != suspended:
                self.nodes[node_id] = replace(self.nodes[node_id], suspended=suspended)
        return list(self.nodes.values())

    def heartbeat(self, node_id: str, interval_s: float) -> float:
        """Count a heartbeat of ``node_id``; its reliability now."""
        now = time.time()
        record = self.records.setdefault(node_id, Reliability())
        record.heartbeat(now, interval_s)
        if len(self.records) > 2 * len(self.nodes) + 1000:
            for gone in [k for k, r in self.records.items() if r.last_update < now - _RECORD_KEEP_S]:
                del self.records[gone]
        return record.value()

    def record_failure(self, node_id: str, reason: str) -> None:
        """A request through ``node_id`` failed because of it: lowers its reliability at once."""
        now = time.time()
        record = self.records.setdefault(node_id, Reliability())
        record.failure(now, reason)
        node = self.nodes.get(node_id)
        if node is not None:
            self.nodes[node_id] = replace(node, reliability=record.value(now))

    def suspend(self, node_id: str) -> None:
        """Take a node reported failed off the live set until its next heartbeat (a dead one sends none)."""
        self.nodes.pop(node_id, None)

    def next_hops(self, node: NodeRecord) -> list[str]:
        """URLs of live nodes a route could send to after ``node``: what it should measure latency to."""
        if node.layers.is_tail or not node.routable:
            return []
        urls = sorted(
            n.url
            for n in self.nodes.values()
            if n.model == node.model
            and n.identity == node.identity  # a route never chains another identity: no latency to measure
            and n.layers.total == node.layers.total
            and n.layers.start == node.layers.stop
            and n.node_id != node.node_id
            and n.routable  # an auditor or a suspended node is never the next hop
        )
        # Many candidates: a different sample each heartbeat, so every pair gets measured in time.
        return urls if len(urls) <= MAX_PROBE_TARGETS else random.sample(urls, MAX_PROBE_TARGETS)


def _node_json(node: NodeRecord, *, probation: bool = False) -> dict[str, Any]:
    """How ``GET /v1/nodes`` lists a node; ``probation`` (a private swarm's tracker) adds whether it
    serves on probation (tracker.plausibility)."""
    listed = {
        "node_id": node.node_id,
        "url": node.url,
        "model": node.model,
        "layers": str(node.layers),
        "total_layers": node.layers.total,
        "backend": node.backend,
        "kv_bytes_free": node.kv_bytes_free,
        "last_seen": node.last_seen,
        "quantization": node.quantization,
        "hardware": asdict(node.hardware),
        "prefill_tps": node.prefill_tps,
        "decode_tps": node.decode_tps,
        # What routes use: the advertised speeds capped at their physical ceilings ("capped": either
        # was), and the observed floor on its seconds per decode position (null: none; tracker.plausibility).
        "prefill_tps_used": node.prefill_tps_used,
        "decode_tps_used": node.decode_tps_used,
        "capped": node.prefill_tps_used < node.prefill_tps or node.decode_tps_used < node.decode_tps,
        "decode_floor_s": node.decode_floor_s or None,
        "queue_depth": node.queue_depth,
        "kv_bytes_per_token": node.kv_bytes_per_token,
        "latency_ms": dict(node.latency_ms),
        "warm": node.warm,
        "weight_bytes": node.weight_bytes,
        "reliability": node.reliability,
        "manifest": node.manifest,
        "files": list(node.files),
        "bt_peer": node.bt_peer,
        "numerics": node.numerics,
        "wire_dtype": node.wire_dtype,
        "hop_key": node.hop_key,
        "architecture": node.architecture,
        "seam": list(node.seam) if node.seam is not None else None,
        "max_verify": node.max_verify,
        "trusted": node.trusted,
        "identity": node.identity,
        "max_positions": node.max_positions,
        "context_length": node.trained_context,
        # Whether its latest heartbeat advertised prefix-cached blocks; the 2 KiB filter is the router's.
        "holds_prefixes": node.prefix_filter is not None,
        "auditor": node.auditor,  # never routed: it re-executes audited hops (tracker.audits)
        "suspended": node.suspended,  # why a failed audit keeps it off every route; null: it does not
    }
    if probation:
        listed["probation"] = node.probation
    return listed


def _registered_layers(reg: Registration) -> LayerRange:
    """The layers a registration names, checked, and its placement ask checked against them."""
    try:
        layers = LayerRange.parse(reg.layers, reg.total_layers)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="layers") from None
    check_advert(reg.placement, reg.total_layers)
    return layers


def _listed(node: NodeRecord, placements: PlacementBook, *, probation: bool) -> dict[str, Any]:
    """A node in ``GET /v1/nodes``: its advertisement and how it was placed (null: by hand)."""
    return {**_node_json(node, probation=probation), "placement": placements.describe(node.node_id)}


def _prefix_filter(text: str | None) -> PrefixFilter | None:
    """The advertised filter; ``None`` when it holds nothing (routing then skips the node's lookups)."""
    if text is None:
        return None
    try:
        held = PrefixFilter.decode(text)
    except ValueError as exc:
        raise InvalidRequest(
            f"{exc}: send PrefixFilter.encode() of the blocks the node holds, or null when it holds none",
            param="prefix_filter",
        ) from None
    return held or None


def _check_same_model(node: NodeRecord, live: list[NodeRecord]) -> None:
    """Every node of one model id must serve the same model: the same layer count, architecture and
    seam. A node that does not (another GGUF under the same name, another family) would join routes
    and compute garbage at its seams; it is refused before it is ever routed to."""
    for other in live:
        if other.model != node.model or other.node_id == node.node_id:
            continue
        differ = []
        if other.layers.total != node.layers.total:
            differ.append(f"{node.layers.total} layers, not {other.layers.total}")
        mine, theirs = (family_of_model_type(n.architecture or "") for n in (node, other))
        if node.architecture and other.architecture and mine != theirs:  # a torch node names its HF model_type
            differ.append(f"architecture {node.architecture!r}, not {other.architecture!r}")
        if node.seam and other.seam and node.seam != other.seam:
            differ.append(f"seam {list(node.seam)}, not {list(other.seam)}")
        if differ:
            raise ModelMismatch(
                f"node {node.node_id} serves model {node.model!r} with {'; '.join(differ)} as node "
                f"{other.node_id} does: it is another model under the same name. Serve the same GGUF, or give "
                "this one its own model id"
            )


def _check_signing(reg: Registration, certified: Member | None, *, private: bool) -> None:
    """A private swarm's node signs its answers (a hop key); an auditor its statements (tracker.audits)."""
    if private and reg.hop_key is None:
        raise InvalidRequest(
            "a private swarm takes only nodes that sign their answers: register with a hop_key "
            "(a Meshnet node sends one; upgrade this one)",
            param="hop_key",
        )
    if reg.auditor:
        check_auditor_registration(hop_key=reg.hop_key, certified=certified, private=private)


def _admit_member(request: Request, reg: Registration, limits: RateLimits) -> Member | None:
    """A private swarm's registration comes from the node it names, within its rate limit, at an
    https URL whose host its certificate lists; the member, for its trust tier."""
    require_node(request.scope, reg.node_id)
    limits.check(reg.node_id, REGISTRATIONS, time.time())  # a heartbeat flood is refused, not counted
    if not reg.url.startswith("https://"):  # members speak mutual TLS: no plain URL to aim peers at
        raise InvalidRequest(f"a private swarm's node serves https, not {reg.url}", param="url")
    require_url_in_certificate(request.scope, reg.url)
    return scope_member(request.scope)


def create_tracker_app(
    db: TrackerDB,
    *,
    swarm: SwarmAuthority | None = None,
    client_tls: ssl.SSLContext | None = None,
    max_sessions_per_client: int | None = None,
) -> Any:
    """The tracker's ASGI app. With ``swarm`` it is a private swarm's tracker: it admits members
    (``POST /v1/swarm/join``, ``GET /v1/swarm/ca``), takes every other request only from members
    (``RequireMember`` with ``tracker_policy``; serve it over TLS that asks for client
    certificates), and takes a registration only from the node it names. ``client_tls`` is the
    context its own requests to nodes go out with (the takeover probe)."""
    tracker = _Tracker(db, None if swarm is None else swarm.revoked_ids)
    # Observed floors, and (where certificates carry tiers) probation: GET /v1/nodes shows them, the
    # sessions API keeps them.
    speeds = SpeedChecks(probation=swarm is not None)
    limits = RateLimits()  # per member: registrations here, failure reports and repairs in SessionsApi
    placements = PlacementBook()  # automatic placement: reservations and moves (tracker.placement_api)

    async def register(request: Request) -> Response:
        reg = parse_body(Registration, await read_body(request, MAX_BODY_BYTES, "the tracker"))
        certified = None if swarm is None else _admit_member(request, reg, limits)
        _check_signing(reg, certified, private=swarm is not None)
        layers = _registered_layers(reg)
        # Not refused: an honest node never reaches its ceilings, and a node that claims more only
        # gets routed as if it had claimed them (GET /v1/nodes shows both).
        prefill_ceiling, decode_ceiling = speed_ceilings(reg.weight_bytes, len(layers))
        node = NodeRecord(
            node_id=reg.node_id,
            url=reg.url,
            model=reg.model,
            layers=layers,
            backend=reg.backend,
            kv_bytes_free=reg.kv_bytes_free,
            last_seen=time.time(),
            quantization=reg.quantization,
            hardware=Hardware(**reg.hardware.model_dump()),
            prefill_tps=reg.prefill_tps,
            decode_tps=reg.decode_tps,
            prefill_tps_ceiling=prefill_ceiling,
            decode_tps_ceiling=decode_ceiling,
            queue_depth=reg.queue_depth,
            kv_bytes_per_token=reg.kv_bytes_per_token,
            latency_ms={url.rstrip("/"): ms for url, ms in reg.latency_ms.items()},
            warm=reg.idle_s is not None and reg.idle_s <= WARM_WINDOW_S,
            weight_bytes=reg.weight_bytes,
            manifest=reg.manifest,
            files=tuple(reg.files),
            bt_peer=reg.bt_peer,
            numerics=reg.numerics,
            wire_dtype=reg.wire_dtype,
            hop_key=reg.hop_key,
            architecture=reg.architecture,
            seam=tuple(reg.seam) if reg.seam is not None else None,
            max_verify=reg.max_verify,
            trusted=certified is not None and certified.trusted,
            identity=reg.identity,
            max_positions=reg.max_positions,
            trained_context=reg.context_length,
            prefix_filter=_prefix_filter(reg.prefix_filter),
            auditor=reg.auditor,
            suspended=db.audits.suspended(reg.node_id),  # listed, heartbeats and all, but never routed
        )
        _check_same_model(node, tracker.live_nodes())
        live = {n.node_id: n for n in tracker.live_nodes()}
        held = live.get(reg.node_id)
        if held is not None and held.url != node.url and await _still_answers(held):
            raise Conflict(
                f"node id {reg.node_id!r} is registered by a live node at {held.url}, which still answers as "
                f"{reg.node_id!r}; give this node another --node-id, or stop that one first (a restarted node "
                "takes its id back as soon as the old address stops answering)",
                param="node_id",
            )
        # A node that expired and came back registers afresh (201), like one never seen.
        fresh = held is None
        node = replace(node, reliability=tracker.heartbeat(reg.node_id, reg.heartbeat_s))
        tracker.nodes[reg.node_id] = node
        answer: dict[str, Any] = {"registered": reg.node_id, "ttl_s": NODE_TTL_S, "next_hops": tracker.next_hops(node),
                                  **tracker.publications.wanted(node.manifest)}  # fmt: skip
        if node.routable:  # an auditor or a suspended node holds no place in the placement
            answer.update(placements.heartbeat(node, reg.placement, speeds.apply(tracker.live_nodes())))
        if swarm is not None:  # the node refuses these peers too (security.revocation)
            answer["revoked"] = sorted(swarm.revocations.serials())
        return JSONResponse(answer, status_code=201 if fresh else 200)

    async def _still_answers(held: NodeRecord) -> bool:
        """Whether the node registered under an id still serves at its address as that id: then a
        registration of the id from another address is a takeover, not a restart, and is refused."""
        try:
            async with httpx.AsyncClient(timeout=TAKEOVER_PROBE_S, verify=tls_or_default(client_tls)) as client:
                answer = await client.get(f"{held.url}/v1/health")
            return answer.status_code == 200 and answer.json().get("node_id") == held.node_id
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    async def list_nodes(_: Request) -> Response:
        live = speeds.apply(tracker.live_nodes())
        return JSONResponse({"nodes": [_listed(n, placements, probation=speeds.probation) for n in live]})

    async def artifact_peers(request: Request) -> Response:
        """Nodes seeding files of a published model (by manifest digest): where a new node fetches from."""
        digest = request.path_params["digest"]
        peers = [
            {"node_id": n.node_id, "bt_peer": n.bt_peer, "layers": str(n.layers), "files": list(n.files)}
            for n in tracker.live_nodes()
            if n.manifest == digest and n.bt_peer
        ]
        return JSONResponse({"manifest": digest, "peers": peers})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "nodes": len(tracker.live_nodes()), "database": db.url_for_display})

    async def join(request: Request) -> Response:
        assert swarm is not None
        return JSONResponse(swarm.join(await read_body(request, MAX_JOIN_BODY_BYTES, "the tracker")), status_code=201)

    async def swarm_ca(_: Request) -> Response:
        assert swarm is not None
        return Response(swarm.ca.cert_pem, media_type="application/x-pem-file")

    async def revoked(_: Request) -> Response:
        assert swarm is not None
        return JSONResponse({"serials": sorted(swarm.revocations.serials())})

    sessions = SessionsApi(
        RoutableNodes(tracker, placements),  # a node draining for a move (or never routed) takes no new session
        db,
        signer=None if swarm is None else swarm.signer,
        max_sessions_per_client=max_sessions_per_client,
        speeds=speeds,
        limits=limits,
    )
    membership = [
        Route(JOIN_PATH, join, methods=["POST"]),
        Route(CA_PATH, swarm_ca, methods=["GET"]),
        Route(REVOKED_PATH, revoked, methods=["GET"]),
    ]
    app = Starlette(
        routes=[
            Route("/v1/nodes", register, methods=["POST"]),
            Route("/v1/nodes", list_nodes, methods=["GET"]),
            Route("/v1/artifacts/{digest}/peers", artifact_peers, methods=["GET"]),
            *models_routes(tracker.live_nodes, tracker.publications),
            Route("/v1/health", health, methods=["GET"]),
            *placements.routes(lambda: speeds.apply(tracker.live_nodes()), members=swarm is not None),
            *sessions.routes(),
            *AuditsApi(db, sessions, tracker.live_nodes, swarm).routes(),
            *(membership if swarm is not None else []),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
    )
    if swarm is None:
        return app
    return RequireMember(app, swarm.ca.cert, policy=tracker_policy, revoked=swarm.revocations.serials)
