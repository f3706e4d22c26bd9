"""``meshnet swarm init|invite|join`` against a real ``meshnet tracker --swarm`` over mutual TLS."""

from __future__ import annotations

import json
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshnet.cli.main import main
from meshnet.cli.swarm_admin import parse_duration
from meshnet.protocol.signing import HopKey
from meshnet.security.identity import SwarmCA
from meshnet.security.invites import mint_invite, peek_invite
from meshnet.security.tls import Credentials
from tests.procs import MESHNET, Proc, meshnet_process


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def swarm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("swarm") / "swarm"
    assert main(["swarm", "init", str(directory), "--name", "test swarm"]) == 0
    return directory


@pytest.fixture(scope="module")
def tracker(swarm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    db = tmp_path_factory.mktemp("db") / "tracker.db"
    with meshnet_process(["tracker", "--swarm", str(swarm_dir), "--port", "0", "--db", f"sqlite:///{db}"]) as proc:
        yield proc


def _invite(capsys: pytest.CaptureFixture[str], swarm_dir: Path, *args: str) -> str:
    capsys.readouterr()
    assert main(["swarm", "invite", "--dir", str(swarm_dir), *args]) == 0
    return capsys.readouterr().out.strip()


def _join(capsys: pytest.CaptureFixture[str], token: str, directory: Path, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["swarm", "join", token, "--dir", str(directory), *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _client(credentials: Path | None, swarm_dir: Path) -> httpx.Client:
    import ssl

    if credentials is None:
        context = ssl.create_default_context(cafile=str(swarm_dir / "ca.pem"))
    else:
        context = Credentials.at(credentials).client_context()
    return httpx.Client(verify=context, timeout=10)


def test_init_writes_the_ca_and_an_admin_credential_with_private_keys_0600(swarm_dir: Path) -> None:
    assert _mode(swarm_dir) == 0o700 and _mode(swarm_dir / "ca.key") == 0o600
    admin = Credentials.at(swarm_dir / "admin")
    assert admin.exists() and _mode(admin.key_path) == 0o600
    member = admin.member()
    assert (member.role, member.member_id) == ("admin", "admin")
    assert main(["swarm", "init", str(swarm_dir)]) == 2  # never overwrites a swarm


def test_invite_and_join_round_trip(
    tracker: Proc, swarm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert json.loads((swarm_dir / "tracker.json").read_text())["url"] == tracker.url
    token = _invite(capsys, swarm_dir, "--role", "node", "--trusted", "--expires", "10m", "--id", "node-a")
    invite = peek_invite(token)
    assert (invite.role, invite.trusted, invite.member_id, invite.tracker_url) == ("node", True, "node-a", tracker.url)
    assert 590 <= invite.expires_at - time.time() <= 601  # whole seconds, rounded up
    code, out = _join(capsys, token, tmp_path / "a")
    assert code == 0, out
    credentials = Credentials.at(tmp_path / "a")
    assert _mode(credentials.directory) == 0o700 and _mode(credentials.key_path) == 0o600
    member = credentials.member()
    assert (member.role, member.member_id, member.trusted) == ("node", "node-a", True)
    assert credentials.ca_path.read_bytes() == (swarm_dir / "ca.pem").read_bytes()
    registry = json.loads((swarm_dir / "members.json").read_text())["members"]
    assert registry["node-a"]["role"] == "node"


def test_an_invite_admits_one_member(
    tracker: Proc, swarm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = _invite(capsys, swarm_dir, "--role", "gateway")
    code, out = _join(capsys, token, tmp_path / "one")
    assert code == 2 and "give one with --id" in out  # an unpinned invite: the joiner names itself
    assert _join(capsys, token, tmp_path / "one", "--id", "gw-one")[0] == 0
    code, out = _join(capsys, token, tmp_path / "two", "--id", "gw-two")
    assert code == 2 and "invite already used" in out, out
    assert not (tmp_path / "two").exists()
    assert peek_invite(token).nonce in json.loads((swarm_dir / "invites.json").read_text())["used"]


def test_an_expired_invite_and_another_swarms_invite_are_refused(
    tracker: Proc, swarm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = SwarmCA.load(swarm_dir)
    old = mint_invite(
        ca, role="node", member_id="late", tracker_url=tracker.url, now=time.time() - 7200, expires_in_s=60
    )
    code, out = _join(capsys, old, tmp_path / "late")
    assert code == 2 and "expired" in out, out
    other = SwarmCA.init(tmp_path / "other", name="other")
    foreign = mint_invite(other, role="node", member_id="spy", tracker_url=tracker.url)
    code, out = _join(capsys, foreign, tmp_path / "spy")
    assert code == 2 and "another swarm's CA" in out, out
    code, out = _join(capsys, foreign, tmp_path / "spy", "--tracker", tracker.url.replace("https", "http"))
    assert code == 2 and "serves https" in out, out
    assert not (tmp_path / "late").exists() and not (tmp_path / "spy").exists()


def test_a_live_member_id_cannot_be_taken_by_another_key(
    tracker: Proc, swarm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _join(capsys, _invite(capsys, swarm_dir, "--role", "node", "--id", "keeper"), tmp_path / "keeper")[0] == 0
    token = _invite(capsys, swarm_dir, "--role", "node")
    code, out = _join(capsys, token, tmp_path / "thief", "--id", "keeper")
    assert code == 2 and "held by another key" in out, out
    assert _join(capsys, token, tmp_path / "honest", "--id", "newcomer")[0] == 0  # the refusal left it unused


def test_the_tracker_takes_members_only_and_a_node_registers_as_itself(
    tracker: Proc, swarm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _join(capsys, _invite(capsys, swarm_dir, "--role", "node", "--id", "reg"), tmp_path / "reg")[0] == 0
    with _client(None, swarm_dir) as anonymous:
        answer = anonymous.get(f"{tracker.url}/v1/nodes")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "certificate_required"
        assert anonymous.get(f"{tracker.url}/v1/swarm/ca").content == (swarm_dir / "ca.pem").read_bytes()
        assert anonymous.post(f"{tracker.url}/v1/swarm/join", content=b"{}").status_code == 400
    body = {"url": "https://127.0.0.1:9", "model": "m", "layers": "0:1", "total_layers": 1,
            "hop_key": HopKey.generate().public}  # fmt: skip
    with _client(tmp_path / "reg", swarm_dir) as node:
        answer = node.post(f"{tracker.url}/v1/nodes", json={**body, "node_id": "someone-else"})
        assert answer.status_code == 403 and answer.json()["error"]["param"] == "node_id"
        assert node.post(f"{tracker.url}/v1/nodes", json={**body, "node_id": "reg"}).status_code == 201
        assert node.post(f"{tracker.url}/v1/sessions", json={}).status_code == 403  # sessions are a gateway's
    with _client(swarm_dir / "admin", swarm_dir) as admin:
        assert [n["node_id"] for n in admin.get(f"{tracker.url}/v1/nodes").json()["nodes"]] == ["reg"]


def test_durations_and_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert [parse_duration(t) for t in ("90", "90s", "30m", "24h", "7d", "1w")] == [
        90, 90, 1800, 86400, 7 * 86400, 7 * 86400
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(["swarm", "invite", "--dir", str(tmp_path), "--role", "node", "--expires", "soon"])
    assert exit_.value.code == 2
    assert main(["swarm", "invite", "--dir", str(tmp_path / "none"), "--role", "node"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["swarm", "join", "mninv1.garbage", "--dir", str(tmp_path / "m")]) == 2
    assert "malformed invite" in capsys.readouterr().err


def _meshnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=60, check=False)


def test_plain_http_off_loopback_needs_insecure(tmp_path: Path) -> None:
    node = ["node", "--layers", "0:10", "--port", "0"]
    out = _meshnet(*node, "--host", "0.0.0.0", "--advertise-url", "http://10.1.2.3:9000")
    assert out.returncode == 2 and "--insecure" in out.stderr, out.stderr
    out = _meshnet("tracker", "--port", "0", "--host", "0.0.0.0", "--db", f"sqlite:///{tmp_path}/t.db")
    assert out.returncode == 2 and "--swarm DIR" in out.stderr, out.stderr
    out = _meshnet(*node, "--swarm-dir", str(tmp_path / "nothing"))
    assert out.returncode == 2 and "does not exist" in out.stderr, out.stderr
