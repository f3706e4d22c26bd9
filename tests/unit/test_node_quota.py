"""Per-client session quotas on a node (``meshnet node --max-sessions-per-client``): a member may
hold that many sessions open on a node; one more is a 429 with Retry-After that changes nothing."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from meshnet.errors import RateLimited
from meshnet.httputil import error_response
from meshnet.ids import SessionId
from meshnet.node.app import _quota_client
from meshnet.node.service import NodeConfig, NodeService
from meshnet.protocol.hops import LocalTransport
from meshnet.protocol.messages import AnswerKind, HopRequest, Verb
from meshnet.security.identity import Member
from tests.unit.test_node_service import MixShard, ids_payload


def open_request(sid: str) -> HopRequest:
    return HopRequest(Verb.PREFILL, SessionId(sid), 0, 3, ids_payload([1, 2, 3]), model="mix", route_id="r",
                      sample=True)  # fmt: skip


def test_a_client_past_its_sessions_gets_a_429_and_others_and_its_own_sessions_go_on() -> None:
    service = NodeService(MixShard("0:12"), NodeConfig("n", "http://n", max_sessions_per_client=2), LocalTransport())

    async def main() -> None:
        for sid in ("a1", "a2"):
            answer = await service.handle(open_request(sid), client="gw-a")
            assert answer is not None and answer.kind is AnswerKind.TOKEN
        with pytest.raises(RateLimited) as refused:
            await service.handle(open_request("a3"), client="gw-a")
        assert refused.value.status == 429 and refused.value.retry_after_s > 0
        assert "member 'gw-a' holds 2 sessions on node n" in refused.value.message
        assert "--max-sessions-per-client 2" in refused.value.message
        assert SessionId("a3") not in service.shard.store.ids() and len(service.shard.store) == 2  # nothing changed
        # another member has its own quota, and a request with no known client (open swarm) has none
        assert await service.handle(open_request("b1"), client="gw-b") is not None
        assert await service.handle(open_request("x1")) is not None
        # a session of the full client goes on; closing one makes room for a new one
        step = HopRequest(Verb.DECODE, SessionId("a1"), 3, 1, ids_payload([4]), model="mix", route_id="r", sample=True)
        assert await service.handle(step, client="gw-a") is not None
        await service.delete(SessionId("a1"))
        assert await service.handle(open_request("a3"), client="gw-a") is not None

    asyncio.run(main())


def test_the_429_has_the_error_shape_and_retry_after() -> None:
    response = error_response(RateLimited("member 'gw' holds 2 sessions", retry_after_s=5))
    assert response.status_code == 429 and response.headers["Retry-After"] == "5"
    error = json.loads(bytes(response.body))["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"


def _member(role: str, member_id: str) -> Member:
    return Member("swarm", member_id, role, False, datetime.now(UTC) + timedelta(days=1))


def test_the_quota_counts_the_calling_member_but_not_a_forwarding_node() -> None:
    """A node forwards the route a gateway asked the tracker for; its sessions are that gateway's."""
    assert _quota_client({"meshnet.member": _member("gateway", "gw")}) == "gw"
    assert _quota_client({"meshnet.member": _member("admin", "ops")}) == "ops"
    assert _quota_client({"meshnet.member": _member("node", "head")}) is None
    assert _quota_client({}) is None  # an open swarm: no certificates, no per-client quota


def test_the_per_client_quota_has_sane_defaults() -> None:
    """Issue 28: by default no member may take a node whole (one slot stays for the others), and a
    private tracker bounds a member's open sessions; an explicit value still wins."""
    from meshnet.cli.main import _build_parser
    from meshnet.cli.node_run import TRACKER_SESSIONS_PER_CLIENT, per_client

    parse = _build_parser().parse_args
    assert per_client(parse(["node", "--layers", "0:1"])) == 3  # --max-sessions 4
    assert per_client(parse(["node", "--layers", "0:1", "--max-sessions", "1"])) == 1
    assert per_client(parse(["node", "--layers", "0:1", "--max-sessions", "8", "--max-sessions-per-client", "8"])) == 8
    assert parse(["tracker"]).max_sessions_per_client == TRACKER_SESSIONS_PER_CLIENT == 256
