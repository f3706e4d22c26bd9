"""A real pretrained model, published as big models are, served over several hosts (issue 27's recipe).

Qwen2.5-Coder 0.5B (Q4_K_M, a real GGUF from the package index) is written as a llama.cpp split set
of three files and published from its first file (streamed: peak RSS recorded). Each process runs in
its own network namespace (``tests/netns.py``): a seeder on the publisher's host, the tracker, three
nodes started together with ``--manifest M --layers auto`` that ask the tracker for a range, fetch
only that range's files over BitTorrent from the seeder, and serve them; and a gateway that holds
only the manifest (and the torrent), fetching the vocabulary artifact and no weights. The official
``openai`` client in the root namespace gets the text ``meshnet serve`` gives on the same file. Every
node's peak RSS is printed beside its files and KV budget. Skipped where namespaces cannot be built.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from meshnet.artifacts.fetch import PART_DIR
from meshnet.artifacts.manifest import read_manifest
from meshnet.security.tls import Credentials
from tests.netns import HostNetwork, unavailable
from tests.procs import MESHNET, Proc, meshnet_peak_rss, meshnet_process, peak_rss, seeder
from tests.realmodels import real_model, write_split

pytestmark = pytest.mark.real

MODEL = "qwen2.5-coder-0.5b"
NODES = ("n1", "n2", "n3")
NODE_PORT, TRACKER_PORT, GATEWAY_PORT, SEED_PORT = 7000, 8001, 8000, 6881
PROMPT = "Write a Python function that reverses a string."
N_TOKENS = 32


@dataclass
class Scene:
    net: HostNetwork
    swarm: Path
    tracker: str
    gateway: Proc
    nodes: dict[str, Proc]
    dests: dict[str, Path]
    published: Path
    split_set: list[Path]
    publish_peak: int


def _meshnet(*args: str, prefix: list[str] | None = None, timeout: float = 120) -> str:
    command = [*(prefix or []), *MESHNET, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"meshnet {' '.join(args[:2])}: {done.stderr}"
    return done.stdout


def _join(net: HostNetwork, swarm: Path, host: str, role: str) -> Path:
    trusted = ["--trusted"] if role == "node" else []  # the operator's own nodes: off probation
    token = _meshnet("swarm", "invite", "--dir", str(swarm), "--role", role, "--id", host, *trusted).strip()
    into = swarm.parent / host
    _meshnet("swarm", "join", token, "--dir", str(into), "--san", net.addresses[host], prefix=net.exec_prefix(host))
    return into


def _admin(swarm: Path) -> httpx.Client:
    return httpx.Client(verify=Credentials.at(swarm / "admin").client_context(), timeout=15)


def _nodes(tracker: str, swarm: Path, want: int, timeout_s: float = 600) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout_s
    with _admin(swarm) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError, KeyError, ValueError):
                nodes: list[dict[str, object]] = client.get(f"{tracker}/v1/nodes").json()["nodes"]
                if len(nodes) >= want:
                    return nodes
            time.sleep(0.5)
    raise TimeoutError(f"{want} nodes did not register with {tracker} in {timeout_s:.0f} s")


def _publish(split_set: list[Path], out: Path) -> int:
    """Publish the split set from its first file; the publisher's own peak RSS in bytes."""
    return meshnet_peak_rss(["publish", str(split_set[0]), "--out", str(out), "--layers-per-file", "8"])


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    if reason := unavailable():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("multihost-real")
    split_set = write_split(real_model(MODEL), root / "split", 200 << 20)
    published = root / "published"
    peak = _publish(split_set, published)
    net = HostNetwork(["publisher", "tracker", "gateway", *NODES])
    try:
        with contextlib.ExitStack() as stack:
            net.build()
            yield _start(net, root, stack, split_set, published, peak)
    finally:  # the processes are stopped (ExitStack) before their namespaces go
        failures = net.close()
        left = net.leftovers()
        assert not failures and not left, f"test network not removed: {failures} {left}"


def _start(
    net: HostNetwork, root: Path, stack: contextlib.ExitStack, split_set: list[Path], published: Path, peak: int
) -> Scene:
    address = net.addresses
    manifest = str(published / "manifest.json")
    seed = ["fetch", manifest, "--dest", str(published), "--seed", "--listen", f"{address['publisher']}:{SEED_PORT}"]
    _, seed_peer, _ = stack.enter_context(seeder(seed, prefix=net.exec_prefix("publisher"), ready_timeout_s=300))
    swarm = root / "swarm"
    _meshnet("swarm", "init", str(swarm))
    tracker = f"https://{address['tracker']}:{TRACKER_PORT}"
    tracker_args = ["tracker", "--swarm", str(swarm), "--host", "0.0.0.0", "--port", str(TRACKER_PORT)]
    tracker_args += ["--advertise-url", tracker, "--db", f"sqlite:///{root}/tracker.db"]
    stack.enter_context(meshnet_process(tracker_args, prefix=net.exec_prefix("tracker")))
    nodes: dict[str, Proc] = {}
    dests: dict[str, Path] = {}
    starting = []
    for name in NODES:  # started together: the tracker's reservations keep them off each other's range
        member = _join(net, swarm, name, "node")
        dests[name] = root / f"{name}-files"
        args = ["node", "--manifest", manifest, "--layers", "auto", "--max-layers", "8", "--dest", str(dests[name])]
        args += ["--peer", seed_peer, "--listen", f"0.0.0.0:{SEED_PORT}", "--swarm-dir", str(member)]
        args += ["--tracker", tracker, "--host", "0.0.0.0", "--port", str(NODE_PORT)]
        args += ["--advertise-url", f"https://{address[name]}:{NODE_PORT}"]
        args += ["--threads", "1", "--ctx", "2048", "--max-sessions", "2", "--session-ttl", "120"]
        starting.append((name, meshnet_process(args, prefix=net.exec_prefix(name), ready_timeout_s=600)))
    for name, ctx in starting:
        nodes[name] = stack.enter_context(ctx)
    _nodes(tracker, swarm, len(NODES))
    # The gateway's host holds the manifest and its torrent, nothing else: it fetches the vocabulary.
    gw_dir = root / "gateway-files"
    gw_dir.mkdir()
    for name in ("manifest.json", "model.torrent"):
        shutil.copy(published / name, gw_dir / name)
    member = _join(net, swarm, "gateway", "gateway")
    args = ["gateway", "--swarm-dir", str(member), "--tracker", tracker, "--host", address["gateway"]]
    args += ["--port", str(GATEWAY_PORT), "--no-auth", "--manifest", str(gw_dir / "manifest.json")]
    args += ["--dest", str(gw_dir), "--peer", seed_peer, "--billing-spool", str(root / "spool")]
    gateway = stack.enter_context(meshnet_process(args, prefix=net.exec_prefix("gateway"), ready_timeout_s=300))
    return Scene(net, swarm, tracker, gateway, nodes, dests, published, split_set, peak)


def _chat(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=N_TOKENS
        )
    return out.choices[0].message.content or ""


def test_publish_of_the_split_set_streams_it(scene: Scene) -> None:
    size = sum(p.stat().st_size for p in scene.split_set)
    ratio = scene.publish_peak / size
    print(f"\nmultihost {MODEL}: publish peak RSS {scene.publish_peak / 2**20:.0f} MiB = {ratio:.3f} x the model")
    assert len(scene.split_set) == 3
    assert scene.publish_peak < 0.5 * size  # never the model in memory (0.21 x measured here: a fixed cost)


def test_auto_placed_nodes_cover_the_model_each_holding_only_its_files(scene: Scene) -> None:
    manifest = read_manifest(scene.published / "manifest.json")
    with _admin(scene.swarm) as admin:
        listed = {str(n["node_id"]): n for n in admin.get(f"{scene.tracker}/v1/nodes").json()["nodes"]}
    ranges = sorted((str(n["layers"]) for n in listed.values()), key=lambda r: int(r.split(":")[0]))
    assert ranges == ["0:8", "8:16", "16:24"]
    for name, node in listed.items():
        assert node["placement"] is not None  # placed by the tracker, not by hand
        # the BitTorrent address other hosts can dial: the node's own, never 0.0.0.0
        assert node["bt_peer"] == f"{scene.net.addresses[name]}:{SEED_PORT}", node
        layers = manifest.parse_layers(str(node["layers"]))
        wanted = {f.name for f in manifest.files_for(layers)}
        fetched = [p for p in scene.dests[name].rglob("*") if p.is_file() and PART_DIR not in p.parts]
        held = {p.name for p in fetched if p.suffix == ".gguf"}
        assert held and held <= wanted, (name, held, wanted)  # its range's files only, no other layers
        files = sum(p.stat().st_size for p in fetched if p.suffix == ".gguf")
        peak = peak_rss(scene.nodes[name].popen.pid)
        print(f"\nmultihost {MODEL} node {name} {node['layers']}: peak RSS {peak >> 20} MiB, files {files >> 20} MiB")


def test_a_gateway_holding_only_the_manifest_gives_serves_text(scene: Scene) -> None:
    serve = ["serve", "--gguf", str(scene.split_set[0]), "--port", "0", "--threads", "2", "--ctx", "2048"]
    with meshnet_process(serve) as served:
        expected = _chat(served.url)
    assert expected
    assert _chat(scene.gateway.url) == expected
    held = sorted(p.name for p in (scene.published.parent / "gateway-files").rglob("*.gguf"))
    assert held == ["vocab.gguf"], held  # the vocabulary artifact, no layer file
    assert "no weights on this gateway" in scene.gateway.output()
    views = json.loads(httpx.get(f"{scene.gateway.url}/v1/models", timeout=30).text)["data"]
    assert [v["id"] for v in views] == [read_manifest(scene.published / "manifest.json").model_id]
