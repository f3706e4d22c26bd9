"""The tracker's HTTP surface: node registration/heartbeat, sticky sessions, the node list.

State: nodes live in memory (they re-register with every heartbeat, so a restarted tracker
refills itself within one heartbeat interval); sessions and their pinned routes are persisted in
the database so a route stays sticky across a tracker restart. The tracker never holds KV.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import InvalidRequest, NotFound
from meshnet.httputil import EXCEPTION_HANDLERS
from meshnet.ids import new_route_id, new_session_id
from meshnet.layers import LayerRange
from meshnet.tracker.db import TrackerDB
from meshnet.tracker.routing import NodeRecord, plan_route

__all__ = ["create_tracker_app"]

NODE_TTL_S = 15.0  # three missed 5 s heartbeats


class Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    node_id: str = Field(min_length=1, max_length=128)
    url: str = Field(pattern=r"^https?://")
    model: str = Field(min_length=1)
    layers: str
    total_layers: int = Field(ge=1)
    backend: str = "llama.cpp"
    kv_bytes_free: int = Field(0, ge=0)


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    model: str = Field(min_length=1)
    total_layers: int | None = Field(None, ge=1)


SchemaT = TypeVar("SchemaT", bound=BaseModel)


def _parse(schema: type[SchemaT], raw: bytes) -> SchemaT:
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"invalid '{where}': {first['msg']}", param=where) from None


class _Tracker:
    def __init__(self, db: TrackerDB) -> None:
        self.db = db
        self.nodes: dict[str, NodeRecord] = {}

    def live_nodes(self) -> list[NodeRecord]:
        cutoff = time.time() - NODE_TTL_S
        for node_id in [k for k, n in self.nodes.items() if n.last_seen < cutoff]:
            del self.nodes[node_id]
        return list(self.nodes.values())


def _node_json(node: NodeRecord) -> dict[str, Any]:
    data = asdict(node)
    data["layers"] = str(node.layers)
    data["total_layers"] = node.layers.total
    return data


def create_tracker_app(db: TrackerDB) -> Starlette:
    tracker = _Tracker(db)

    async def register(request: Request) -> Response:
        reg = _parse(Registration, await request.body())
        try:
            layers = LayerRange.parse(reg.layers, reg.total_layers)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="layers") from None
        node = NodeRecord(
            node_id=reg.node_id,
            url=reg.url.rstrip("/"),
            model=reg.model,
            layers=layers,
            backend=reg.backend,
            kv_bytes_free=reg.kv_bytes_free,
            last_seen=time.time(),
        )
        # A node that expired and came back registers afresh (201), like one never seen.
        fresh = reg.node_id not in {n.node_id for n in tracker.live_nodes()}
        tracker.nodes[reg.node_id] = node
        return JSONResponse({"registered": reg.node_id, "ttl_s": NODE_TTL_S}, status_code=201 if fresh else 200)

    async def list_nodes(_: Request) -> Response:
        return JSONResponse({"nodes": [_node_json(n) for n in tracker.live_nodes()]})

    async def open_session(request: Request) -> Response:
        req = _parse(SessionRequest, await request.body())
        chain = plan_route(tracker.live_nodes(), req.model, req.total_layers)
        session = {
            "session_id": new_session_id(),
            "route_id": new_route_id(),
            "model": req.model,
            "hops": [{"node_id": n.node_id, "url": n.url, "layers": str(n.layers)} for n in chain],
            "created": time.time(),
        }
        db.save_session(session)
        return JSONResponse(session, status_code=201)

    async def get_session(request: Request) -> Response:
        session = db.load_session(request.path_params["session_id"])
        if session is None:
            raise NotFound(f"no session {request.path_params['session_id']} on this tracker")
        return JSONResponse(session)

    async def close_session(request: Request) -> Response:
        if not db.delete_session(request.path_params["session_id"]):
            raise NotFound(f"no session {request.path_params['session_id']} on this tracker")
        return JSONResponse({"deleted": request.path_params["session_id"]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "nodes": len(tracker.live_nodes()), "database": db.url_for_display})

    return Starlette(
        routes=[
            Route("/v1/nodes", register, methods=["POST"]),
            Route("/v1/nodes", list_nodes, methods=["GET"]),
            Route("/v1/sessions", open_session, methods=["POST"]),
            Route("/v1/sessions/{session_id}", get_session, methods=["GET"]),
            Route("/v1/sessions/{session_id}", close_session, methods=["DELETE"]),
            Route("/v1/health", health, methods=["GET"]),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
    )
