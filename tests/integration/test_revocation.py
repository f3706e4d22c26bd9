"""Revocation and restart of a private swarm, with real processes: ``meshnet swarm revoke`` takes
a member out of the tracker and the nodes (a gateway: refused everywhere; a node: off the routes at
once), a revoked id does not come back with its old key, and a tracker restarted on the same
directory keeps its members, its used invites and its revocations. Plus the credential cases of
issue #13 not covered elsewhere: an expired certificate and a member of the wrong role."""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from meshnet.security.identity import MemberRequest, SwarmCA, make_csr, new_member_key
from meshnet.security.tls import save_member
from tests.private_swarm import PrivateSwarm, node_urls, private_swarm, start_tracker
from tests.procs import join, member_client, meshnet_cli

pytestmark = pytest.mark.real

NODES = (("head", "0:15"), ("tail", "15:30"), ("tail2", "15:30"))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSwarm]:
    with private_swarm(tmp_path_factory.mktemp("revoke"), NODES, gateway=False) as running:
        running.join("gateway", "gw")
        yield running


def _code(answer: httpx.Response) -> str:
    return str(answer.json()["error"]["code"])


def _until(check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _revoke(directory: Path, member_id: str) -> None:
    out = meshnet_cli("swarm", "revoke", member_id, "--dir", str(directory))
    assert out.returncode == 0, out.stderr
    assert f"revoked member {member_id!r}" in out.stdout


def test_a_revoked_gateway_is_refused_by_the_tracker_and_by_nodes_and_cannot_rejoin_with_its_key(
    swarm: PrivateSwarm,
) -> None:
    mole = swarm.join("gateway", "mole")
    head = swarm.nodes["head"]
    with member_client(mole) as client:
        assert client.get(f"{swarm.tracker.url}/v1/nodes").status_code == 200
        assert client.get(f"{head}/v1/health").status_code == 200
        _revoke(swarm.dir, "mole")
        answer = client.post(f"{swarm.tracker.url}/v1/sessions", json={"model": "x"})
        assert answer.status_code == 401 and _code(answer) == "certificate_revoked", answer.text
        assert _code(client.get(f"{swarm.tracker.url}/v1/nodes")) == "certificate_revoked"
        _until(lambda: client.get(f"{head}/v1/health").status_code == 401)  # from the node's next heartbeat
        assert _code(client.get(f"{head}/v1/health")) == "certificate_revoked"
    with member_client(swarm.admin) as admin:
        assert admin.get(f"{swarm.tracker.url}/v1/swarm/revoked").json()["serials"]
    # a fresh invite does not bring the revoked id back with its old key ...
    token = meshnet_cli("swarm", "invite", "--dir", str(swarm.dir), "--role", "gateway", "--id", "mole").stdout.strip()
    key = load_pem_private_key((mole / "member.key").read_bytes(), password=None)
    body = {"token": token, "csr": make_csr(key, "mole").decode(), "member_id": "mole"}  # type: ignore[arg-type]
    with httpx.Client(verify=ssl.create_default_context(cafile=str(swarm.dir / "ca.pem")), timeout=10) as anon:
        answer = anon.post(f"{swarm.tracker.url}/v1/swarm/join", json=body)
    assert answer.status_code == 401 and _code(answer) == "certificate_revoked", answer.text
    # ... but with a new key it does (the invite stayed unused)
    out = meshnet_cli("swarm", "join", token, "--dir", str(swarm.root / "mole-new"))
    assert out.returncode == 0, out.stderr
    with member_client(swarm.root / "mole-new") as client:
        assert client.get(f"{swarm.tracker.url}/v1/nodes").status_code == 200


def test_a_revoked_node_leaves_the_routes_at_once(swarm: PrivateSwarm) -> None:
    tracker = swarm.tracker.url
    assert set(node_urls(tracker, swarm.admin)) == {"head", "tail", "tail2"}
    _revoke(swarm.dir, "tail2")
    assert set(node_urls(tracker, swarm.admin)) == {"head", "tail"}
    with member_client(swarm.member("gw")) as gw:
        model = gw.get(f"{tracker}/v1/nodes").json()["nodes"][0]["model"]
        for _ in range(4):
            opened = gw.post(f"{tracker}/v1/sessions", json={"model": model, "total_layers": 30})
            assert opened.status_code == 201, opened.text
            assert [h["node_id"] for h in opened.json()["hops"]] == ["head", "tail"]
            gw.delete(f"{tracker}/v1/sessions/{opened.json()['session_id']}")
    time.sleep(6)  # a heartbeat later it is still out: its registrations are refused
    assert set(node_urls(tracker, swarm.admin)) == {"head", "tail"}


def test_an_expired_certificate_and_the_wrong_role_are_refused(swarm: PrivateSwarm, tmp_path: Path) -> None:
    ca = SwarmCA.load(swarm.dir)
    key = new_member_key()
    now = datetime.now(UTC)
    request = MemberRequest(make_csr(key, "old-gw"), role="gateway", not_before=now - timedelta(days=2),
                            expires=now - timedelta(days=1))  # fmt: skip
    save_member(tmp_path / "old", ca.issue(request), key)
    shutil.copy(swarm.dir / "ca.pem", tmp_path / "old" / "ca.pem")
    with member_client(tmp_path / "old") as client:
        try:
            answer = client.get(f"{swarm.tracker.url}/v1/nodes")
        except httpx.TransportError:
            pass  # the handshake refused it
        else:
            assert answer.status_code == 401 and _code(answer) in ("certificate_refused", "certificate_required")
        with pytest.raises(httpx.TransportError):  # a node's handshake checks validity itself
            client.get(f"{swarm.nodes['head']}/v1/health")
    with member_client(swarm.member("head")) as node:  # a node opens no sessions
        answer = node.post(f"{swarm.tracker.url}/v1/sessions", json={"model": "x"})
        assert answer.status_code == 403 and _code(answer) == "forbidden"


def test_a_tracker_restart_keeps_members_used_invites_and_revocations(tmp_path: Path) -> None:
    swarm = tmp_path / "swarm"
    assert meshnet_cli("swarm", "init", str(swarm)).returncode == 0
    with start_tracker(tmp_path) as tracker:
        token = meshnet_cli("swarm", "invite", "--dir", str(swarm), "--role", "gateway", "--id", "keep").stdout
        assert meshnet_cli("swarm", "join", token.strip(), "--dir", str(tmp_path / "keep")).returncode == 0
        join(swarm, "gateway", "gone", tmp_path / "gone")
        _revoke(swarm, "gone")
        first = tracker.url
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(start_tracker(tmp_path))
        with member_client(tmp_path / "keep") as keep:
            assert keep.get(f"{tracker.url}/v1/nodes").status_code == 200
        with member_client(tmp_path / "gone") as gone:
            assert _code(gone.get(f"{tracker.url}/v1/nodes")) == "certificate_revoked"
        again = meshnet_cli("swarm", "join", token.strip(), "--dir", str(tmp_path / "again"), "--tracker", tracker.url)
        assert again.returncode == 2 and "used" in again.stderr, again.stderr
        members = json.loads((swarm / "members.json").read_text())["members"]
        assert {"admin", "keep", "gone"} <= set(members)
    assert first.startswith("https://127.0.0.1:")
