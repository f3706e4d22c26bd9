"""A private swarm end to end: ``meshnet swarm init``, a tracker with ``--swarm``, two nodes and a
gateway that joined with invites, all talking mutual TLS on loopback; outsiders are refused."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshnet.ids import SessionId
from meshnet.protocol.http_binding import encode_request, encode_reroute
from meshnet.protocol.messages import HopRequest, Payload, RerouteRequest, Verb
from meshnet.protocol.wire import encode_tensor
from meshnet.security.identity import SwarmCA
from meshnet.security.invites import mint_invite
from meshnet.security.join import join_swarm
from tests.private_swarm import wait_nodes
from tests.procs import Proc, join, member_client, meshnet_cli, meshnet_process

pytestmark = pytest.mark.real

NODE_ARGS = ["--threads", "1", "--ctx", "256", "--max-sessions", "2"]


@pytest.fixture(scope="module")
def private_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Proc, dict[str, str], Proc]]:
    root = tmp_path_factory.mktemp("private")
    swarm = root / "swarm"
    assert meshnet_cli("swarm", "init", str(swarm)).returncode == 0
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(
            meshnet_process(["tracker", "--swarm", str(swarm), "--port", "0", "--db", f"sqlite:///{root}/t.db"])
        )
        assert tracker.url.startswith("https://127.0.0.1:")
        head = join(swarm, "node", "head", root / "head")
        tail = join(swarm, "node", "tail", root / "tail")
        gateway = join(swarm, "gateway", "gw", root / "gw")
        for layers, credentials in (("0:15", head), ("15:30", tail)):
            node = ["node", "--layers", layers, "--swarm-dir", str(credentials), "--tracker", tracker.url]
            stack.enter_context(meshnet_process([*node, "--port", "0", *NODE_ARGS]))
        nodes = wait_nodes(tracker.url, swarm / "admin", {"head", "tail"})
        gw = stack.enter_context(
            meshnet_process(["gateway", "--swarm-dir", str(gateway), "--tracker", tracker.url, "--port", "0"])
        )
        yield swarm, tracker, nodes, gw


def test_a_chat_completion_runs_over_mutual_tls(private_swarm: tuple[Path, Proc, dict[str, str], Proc]) -> None:
    swarm, _, nodes, gateway = private_swarm
    assert all(url.startswith("https://127.0.0.1:") for url in nodes.values())
    model = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12, "temperature": 0}
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    # decode steps went over the nodes' TLS WebSockets (wss), not only HTTPS hop requests
    with member_client(swarm / "admin") as admin:
        metrics = admin.get(f"{nodes['head']}/metrics").text
    steps = [line for line in metrics.splitlines() if line.startswith("meshnet_node_channel_steps_total")]
    assert steps and float(steps[0].split()[-1]) > 0, steps
    view = httpx.get(f"{gateway.url}/v1/swarm", timeout=30).json()
    assert {n["node_id"]: n["health"]["status"] for n in view["nodes"]} == {"head": "ok", "tail": "ok"}


def test_outsiders_are_refused_by_tracker_and_nodes(
    private_swarm: tuple[Path, Proc, dict[str, str], Proc], tmp_path: Path
) -> None:
    swarm, tracker, nodes, _ = private_swarm
    anonymous = ssl.create_default_context(cafile=str(swarm / "ca.pem"))
    with httpx.Client(verify=anonymous, timeout=10) as client:
        answer = client.get(f"{tracker.url}/v1/nodes")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "certificate_required"
        with pytest.raises(httpx.TransportError):  # the node's handshake wants a client certificate
            client.get(f"{nodes['head']}/v1/health")
    # a member of another swarm (its own tracker and CA) fails the handshake with this one's node
    other = SwarmCA.init(tmp_path / "other", name="other")
    with meshnet_process(
        ["tracker", "--swarm", str(other.directory), "--port", "0", "--db", f"sqlite:///{tmp_path}/o.db"]
    ) as foreign:
        token = mint_invite(other, role="node", member_id="spy", tracker_url=foreign.url)
        spy = join_swarm(token, tmp_path / "spy")
    with httpx.Client(verify=spy.client_context(), timeout=10) as client, pytest.raises(httpx.TransportError):
        client.get(f"{nodes['head']}/v1/health")


def test_a_member_without_the_trackers_ticket_cannot_open_or_steer_a_session(
    private_swarm: tuple[Path, Proc, dict[str, str], Proc],
) -> None:
    """Route tickets: a member (here, the gateway's own credentials) that knows a node's address
    can neither open a session on it without a tracker-signed ticket, nor point a session at hops
    of its choosing, nor reroute one; the tracker's ticket opens it, and only along its hops."""
    swarm, tracker, nodes, _ = private_swarm
    ids = encode_tensor(np.array([[1, 2, 3]], dtype=np.int32), "int32")

    def prefill(client: httpx.Client, sid: str, route_id: str, ticket: str | None, hops: str) -> httpx.Response:
        request = HopRequest(Verb.PREFILL, SessionId(sid), 0, 3, Payload(ids), route_id=route_id,
                             next_hops=(hops,), sample=True, ticket=ticket)  # fmt: skip
        path, headers, body = encode_request(request)
        return client.post(f"{nodes['head']}{path}", content=body, headers=headers)

    with member_client(swarm.parent / "gw") as client:
        plan = client.post(f"{tracker.url}/v1/sessions", json={"model": _model(client, tracker), "total_layers": 30})
        assert plan.status_code == 201, plan.text
        session = plan.json()
        sid, route_id, ticket = session["session_id"], session["route_id"], session["ticket"]
        refused = prefill(client, sid, route_id, None, nodes["tail"])
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "route_ticket_missing"
        forged = ticket[:-4] + ("AAAA" if not ticket.endswith("AAAA") else "BBBB")
        refused = prefill(client, sid, route_id, forged, nodes["tail"])
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "route_ticket_invalid"
        refused = prefill(client, "another-session", route_id, ticket, nodes["tail"])
        assert refused.json()["error"]["code"] == "route_ticket_mismatch"
        refused = prefill(client, sid, route_id, ticket, "https://127.0.0.1:9")  # a hop the ticket does not name
        assert refused.status_code == 401 and "along its ticket" in refused.json()["error"]["message"]
        answer = prefill(client, sid, route_id, ticket, nodes["tail"])
        assert answer.status_code == 200 and isinstance(answer.json()["token"], int), answer.text
        # a reroute needs the tracker's repair ticket, not the route ticket
        path, headers = encode_reroute(RerouteRequest(SessionId(sid), (nodes["tail"],), route_id, ticket=ticket))
        refused = client.post(f"{nodes['head']}{path}", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "route_ticket_mismatch"
        client.delete(f"{nodes['head']}/v1/sessions/{sid}")
        client.delete(f"{tracker.url}/v1/sessions/{sid}")


def _model(client: httpx.Client, tracker: Proc) -> str:
    return str(client.get(f"{tracker.url}/v1/nodes").json()["nodes"][0]["model"])


def test_a_node_runs_only_as_its_certificate_says(
    private_swarm: tuple[Path, Proc, dict[str, str], Proc], tmp_path: Path
) -> None:
    swarm, tracker, _, _ = private_swarm
    head = swarm.parent / "head"
    out = meshnet_cli("node", "--layers", "0:15", "--swarm-dir", str(head), "--node-id", "tail", "--port", "0")
    assert out.returncode == 2 and "not the certificate's id 'head'" in out.stderr, out.stderr
    out = meshnet_cli("node", "--layers", "0:15", "--swarm-dir", str(swarm.parent / "gw"), "--port", "0")
    assert out.returncode == 2 and "needs a node certificate" in out.stderr, out.stderr
    out = meshnet_cli(
        "gateway", "--swarm-dir", str(swarm.parent / "gw"), "--tracker", tracker.url.replace("https", "http")
    )
    assert out.returncode == 2 and "over https" in out.stderr, out.stderr


def test_up_tls_runs_the_local_swarm_as_a_private_one(tmp_path: Path) -> None:
    up = ["up", "--tls", "--port", "0", "--nodes", "2", "--threads", "1", "--ctx", "256", "--workdir", str(tmp_path)]
    with meshnet_process(up, ready_timeout_s=300) as swarm:
        assert f"private swarm {tmp_path / 'swarm'}" in swarm.output()
        view = httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()
        assert view["tracker"].startswith("https://") and len(view["nodes"]) == 2
        assert all(n["url"].startswith("https://") and n["health"]["status"] == "ok" for n in view["nodes"])
        model = httpx.get(f"{swarm.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{swarm.url}/v1/completions", json=body, timeout=120).status_code == 200
        anonymous = ssl.create_default_context(cafile=str(tmp_path / "swarm" / "ca.pem"))
        with httpx.Client(verify=anonymous, timeout=10) as client:
            assert client.get(f"{view['tracker']}/v1/nodes").status_code == 401
