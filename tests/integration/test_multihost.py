"""A private swarm over several hosts for real: each process in its own network namespace.

Six namespaces joined by veth links to one bridge (``tests/netns.py``): the tracker, the gateway
and four nodes of the bundled model (head 0:10, two middles 10:20, tail 20:30), each with its own
address. The swarm is made as the README's multi-host recipe says: ``meshnet swarm init`` and
``invite`` on the tracker's host, ``meshnet swarm join --san ADDRESS`` on each member's own host
against the tracker's address, TLS everywhere, nodes bound to ``0.0.0.0`` with ``--advertise-url``,
the gateway's OpenAI port on its own address behind an API key. The official ``openai`` client, in
the root namespace, streams through the bridge: the text is token-identical to ``meshnet serve``'s,
and stays so when the serving middle is killed with SIGKILL mid-generation (route repair through
the spare, in yet another namespace). Skipped where namespaces cannot be built (not root, no ``ip``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from meshnet.security.tls import Credentials
from tests.netns import HostNetwork, unavailable
from tests.procs import MESHNET, Proc, meshnet_process

pytestmark = pytest.mark.real

NODES = {"head": "0:10", "mid-a": "10:20", "mid-b": "10:20", "tail": "20:30"}
TRUSTED = {"head", "mid-a", "tail"}  # mid-b joins untrusted: the tier comes from its certificate
NODE_PORT, TRACKER_PORT, GATEWAY_PORT = 7000, 8001, 8000
API_KEY = "multihost-test-key-0123456789"
PROMPT = "Name three facts about the moon."
N_TOKENS = 48


@dataclass
class Hosts:
    net: HostNetwork
    swarm: Path
    tracker: str
    gateway: str
    nodes: dict[str, Proc]
    model: str


def _meshnet(*args: str, prefix: list[str] | None = None) -> str:
    done = subprocess.run([*(prefix or []), *MESHNET, *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"meshnet {' '.join(args[:2])}: {done.stderr}"
    return done.stdout


def _join(net: HostNetwork, swarm: Path, host: str, role: str, *, trusted: bool = False) -> Path:
    """Invite on the tracker's side (here: files only), join on the member's own host."""
    token = _meshnet(
        "swarm", "invite", "--dir", str(swarm), "--role", role, "--id", host, *(["--trusted"] if trusted else [])
    ).strip()
    into = swarm.parent / host
    _meshnet("swarm", "join", token, "--dir", str(into), "--san", net.addresses[host], prefix=net.exec_prefix(host))
    return into


def _admin(swarm: Path) -> httpx.Client:
    return httpx.Client(verify=Credentials.at(swarm / "admin").client_context(), timeout=15)


def _registered(tracker: str, swarm: Path, want: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 120
    with _admin(swarm) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                nodes: list[dict[str, object]] = client.get(f"{tracker}/v1/nodes").json()["nodes"]
                if len(nodes) >= want:
                    return nodes
            time.sleep(0.3)
    raise TimeoutError(f"{want} nodes did not register with {tracker} in 120 s")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    if reason := unavailable():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("multihost")
    net = HostNetwork(["tracker", "gateway", *NODES])
    try:
        with contextlib.ExitStack() as stack:
            net.build()
            yield _start(net, root, stack)
    finally:  # the processes are stopped (ExitStack) before their namespaces go
        failures = net.close()
        left = net.leftovers()
        assert not failures and not left, f"test network not removed: {failures} {left}"


def _start(net: HostNetwork, root: Path, stack: contextlib.ExitStack) -> Hosts:
    swarm = root / "swarm"
    _meshnet("swarm", "init", str(swarm))
    address = net.addresses
    tracker = f"https://{address['tracker']}:{TRACKER_PORT}"
    tracker_args = ["tracker", "--swarm", str(swarm), "--host", "0.0.0.0", "--port", str(TRACKER_PORT)]
    tracker_args += ["--advertise-url", tracker, "--db", f"sqlite:///{root}/tracker.db"]
    stack.enter_context(meshnet_process(tracker_args, prefix=net.exec_prefix("tracker")))
    assert json.loads((swarm / "tracker.json").read_text())["url"] == tracker  # what invites name
    nodes: dict[str, Proc] = {}
    for name, layers in NODES.items():
        member = _join(net, swarm, name, "node", trusted=name in TRUSTED)
        args = ["node", "--layers", layers, "--swarm-dir", str(member), "--tracker", tracker]
        public = f"https://{address[name]}:{NODE_PORT}"
        args += ["--host", "0.0.0.0", "--port", str(NODE_PORT), "--advertise-url", public]
        args += ["--threads", "1", "--ctx", "1024", "--max-sessions", "2", "--session-ttl", "120", "--hop-timeout", "4"]
        nodes[name] = stack.enter_context(meshnet_process(args, prefix=net.exec_prefix(name)))
    listed = _registered(tracker, swarm, len(NODES))
    member = _join(net, swarm, "gateway", "gateway")
    keys = root / "keys.txt"
    keys.write_text(API_KEY + "\n")
    args = ["gateway", "--swarm-dir", str(member), "--tracker", tracker, "--host", address["gateway"]]
    args += ["--port", str(GATEWAY_PORT), "--api-keys", str(keys), "--billing-spool", str(root / "spool")]
    args += ["--prefill-chunk", "32", "--hop-timeout", "4"]
    gateway = stack.enter_context(meshnet_process(args, prefix=net.exec_prefix("gateway")))
    assert gateway.url == f"http://{address['gateway']}:{GATEWAY_PORT}"
    return Hosts(net, swarm, tracker, gateway.url, nodes, str(listed[0]["model"]))


def _stream(hosts: Hosts, gid: str, on_chunk: object = None) -> str:
    text = ""
    with openai.OpenAI(base_url=f"{hosts.gateway}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        chunks = client.chat.completions.create(
            model=hosts.model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=N_TOKENS,
            stream=True, extra_headers={"X-Meshnet-Generation-Id": gid},
        )  # fmt: skip
        for n, chunk in enumerate(chunks):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if callable(on_chunk):
                on_chunk(n)
    return text


def _gateway_get(hosts: Hosts, path: str) -> httpx.Response:
    return httpx.get(f"{hosts.gateway}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)


def test_every_member_is_reached_at_its_own_namespace_address(hosts: Hosts) -> None:
    with _admin(hosts.swarm) as admin:
        listed = {n["node_id"]: n for n in admin.get(f"{hosts.tracker}/v1/nodes").json()["nodes"]}
    expected = {name: f"https://{hosts.net.addresses[name]}:{NODE_PORT}" for name in NODES}
    assert {name: node["url"] for name, node in listed.items()} == expected  # not 127.0.0.1, not 0.0.0.0
    assert {name: node["trusted"] for name, node in listed.items()} == {name: name in TRUSTED for name in NODES}
    assert len(set(hosts.net.addresses.values())) == len(hosts.net.addresses)
    # the gateway, in its own namespace, reached every node's address over mutual TLS
    view = _gateway_get(hosts, "/v1/swarm").json()
    assert view["tracker"] == hosts.tracker
    assert {n["node_id"]: (n["url"], n["health"]["status"]) for n in view["nodes"]} == {
        name: (url, "ok") for name, url in expected.items()
    }
    # the API key is enforced on the gateway's namespace address
    assert httpx.get(f"{hosts.gateway}/v1/models", timeout=10).status_code == 401


def test_the_openai_client_streams_serves_text_across_hosts(hosts: Hosts, server: Proc) -> None:
    text = _stream(hosts, "gen-multihost")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        single = client.chat.completions.create(
            model=hosts.model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=N_TOKENS
        )
    assert text and text == single.choices[0].message.content
    route = _gateway_get(hosts, "/v1/generations/gen-multihost").json()["route"]
    assert [hop["layers"] for hop in route] == ["0:10", "10:20", "20:30"]
    assert all(hop["url"] == f"https://{hosts.net.addresses[hop['node']]}:{NODE_PORT}" for hop in route)


def test_a_trusted_only_gateway_routes_over_trusted_nodes_only(hosts: Hosts) -> None:
    """A second gateway with ``--trusted-only`` (same member credentials, another port): its route
    leaves out mid-b, whose certificate is untrusted, and its text is the same."""
    root = hosts.swarm.parent
    args = ["gateway", "--swarm-dir", str(root / "gateway"), "--tracker", hosts.tracker, "--trusted-only"]
    args += ["--host", hosts.net.addresses["gateway"], "--port", str(GATEWAY_PORT + 2), "--no-auth"]
    args += ["--billing-spool", str(root / "spool-trusted")]
    with meshnet_process(args, prefix=hosts.net.exec_prefix("gateway")) as gateway:
        trusted = Hosts(hosts.net, hosts.swarm, hosts.tracker, gateway.url, hosts.nodes, hosts.model)
        assert _stream(trusted, "gen-trusted") == _stream(hosts, "gen-any")
        snapshot = _gateway_get(trusted, "/v1/generations/gen-trusted").json()
        assert [hop["node"] for hop in snapshot["route"]] == ["head", "mid-a", "tail"]
    with _admin(hosts.swarm) as admin:  # the tracker kept the flag with the session (its repairs honour it)
        session = admin.get(f"{hosts.tracker}/v1/sessions/{snapshot['session_id']}").json()
    assert session["trusted_only"] is True


def test_kill_9_of_the_serving_middle_is_repaired_across_hosts_with_identical_text(hosts: Hosts) -> None:
    expected = _stream(hosts, "gen-multihost-baseline")
    killed: list[str] = []

    def on_chunk(n: int) -> None:
        if n == 12 and not killed:
            route = _gateway_get(hosts, "/v1/generations/gen-multihost-kill").json()["route"]
            killed.append(next(hop["node"] for hop in route if hop["layers"] == "10:20"))
            proc = hosts.nodes[killed[0]]
            proc.popen.kill()  # SIGKILL to the node's own pid (`ip netns exec` execs it)
            proc.popen.wait(10)

    assert _stream(hosts, "gen-multihost-kill", on_chunk) == expected
    body = _gateway_get(hosts, "/v1/generations/gen-multihost-kill/events").text
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    retries = [e for e in events if e["type"] == "route.retry"]
    assert len(retries) == 1 and retries[0]["kind"] == "repair" and retries[0]["failed_node"] == killed[0], retries
    spare = next(n for n in retries[0]["nodes"] if n["layers"] == "10:20")["node"]
    assert spare != killed[0] and spare in NODES
