"""Publishing the bundled model and fetching layer ranges with real libtorrent on loopback.

A module-scoped publication and a seeding ``meshnet fetch --seed`` process are shared; each test
fetches into its own folder. Web seeds are this package's Range-capable server, in-process.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.fetch import FetchConfig, Swarm, assemble, load_source
from meshnet.artifacts.webseed import RangeServer
from tests.procs import MESHNET, SEEDING, Proc, meshnet_process, seeder, stop

pytestmark = pytest.mark.real

NAME = "SmolLM2-135M-Instruct.Q4_1"
_FETCHED = re.compile(r"needed ([\d,]+) bytes, resumed ([\d,]+) already on disk, downloaded ([\d,]+)")
_PROGRESS = re.compile(r"fetch downloading\s+([\d.]+)%")


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def meshnet(args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("published")
    done = meshnet(["publish", "--out", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def seed(published: Path) -> Iterator[str]:
    """A process seeding every published file; yields its BitTorrent HOST:PORT."""
    with seeder(["fetch", str(published / "manifest.json"), "--dest", str(published), "--seed"]) as (_, peer, _):
        yield peer


def test_published_files_are_content_addressed(published: Path) -> None:
    manifest, _ = load_source(str(published / "manifest.json"))
    assert manifest.architecture == "llama" and manifest.layers == 30
    assert [str(r) for r, _ in manifest.layer_map] == ["0:10", "10:20", "20:30"]
    for entry in manifest.files:
        path = published / NAME / entry.name
        assert path.stat().st_size == entry.size and sha256(path) == entry.sha256
    assert manifest.magnet.startswith(f"magnet:?xt=urn:btmh:1220{manifest.info_hash_v2}")
    # Publishing is reproducible: same GGUF, same options -> same identity.
    assert manifest.digest == load_source(str(published / "manifest.json"))[0].digest


def test_nodes_from_the_manifest_fetch_only_their_layers_and_the_route_matches(
    published: Path, tmp_path: Path, server: Proc, model_id: str
) -> None:
    manifest_path = str(published / "manifest.json")
    node = ["node", "--manifest", manifest_path, "--threads", "1", "--ctx", "512", "--max-sessions", "2"]
    node += ["--wire-dtype", "float32", "--cache-dir", str(tmp_path / "cache")]
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(
            meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp_path / 'tracker.db'}"])
        )
        # Node A holds every published file (the publisher's folder): it serves 0:10 and seeds all.
        # It takes BitTorrent peers on every interface, and advertises its own host, which others can dial.
        a_args = [*node, "--layers", "0:10", "--dest", str(published), "--tracker", tracker.url]
        a = stack.enter_context(meshnet_process([*a_args, "--listen", "0.0.0.0:0"]))
        peer = SEEDING.search(a.output())
        assert peer is not None and peer.group(1) == "4", a.output()
        assert peer.group(2).startswith("127.0.0.1:"), a.output()
        others = []
        for layers in ("10:20", "20:30"):
            dest = tmp_path / layers.replace(":", "-")
            # 10:20 is told its peer; 20:30 learns it from the tracker (node 0:10 advertised where it seeds).
            source = ["--peer", peer.group(2)] if layers == "10:20" else []
            args = [*node, "--layers", layers, "--dest", str(dest), *source, "--tracker", tracker.url]
            proc = stack.enter_context(meshnet_process(args))
            fetched = _FETCHED.search(proc.output())
            assert fetched is not None, proc.output()
            if not source:
                assert "the tracker knows 1 peer(s) seeding these files" in proc.output()
            needed, downloaded = _num(fetched.group(1)), _num(fetched.group(3))
            assert 0 < downloaded <= 1.05 * needed
            held = sorted(p.name for p in (dest / NAME).iterdir())
            start, stop_ = layers.split(":")
            assert held == [f"blk-{int(start):03d}-{int(stop_):03d}.gguf"]
            others.append(proc)
        gateway = stack.enter_context(meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0"]))
        listing = httpx.get(f"{tracker.url}/v1/nodes", timeout=10).json()
        nodes = listing["nodes"] if isinstance(listing, dict) else listing
        digest = load_source(manifest_path)[0].digest
        assert {n["layers"]: n["bt_peer"].split(":")[0] for n in nodes}["0:10"] == "127.0.0.1"
        assert {n["layers"]: (n["manifest"], len(n["files"])) for n in nodes} == {
            "0:10": (digest, 4),
            "10:20": (digest, 1),
            "20:30": (digest, 1),
        }
        for prompt in ("What is the capital of France?", "List three uses of copper."):
            assert _chat(gateway.url, model_id, prompt) == _chat(server.url, model_id, prompt)


def _chat(url: str, model: str, prompt: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180) as client:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32
        )
    return out.choices[0].message.content or ""


def test_fetched_files_merged_into_one_range_match_the_full_model(published: Path, seed: str, tmp_path: Path) -> None:
    from meshnet.backends.chain import generate
    from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig

    manifest, torrent = load_source(str(published / "manifest.json"))
    host, port = seed.rsplit(":", 1)
    dest = tmp_path / "dl"
    shards = []
    for text in ("0:10", "10:30"):  # 10:30 is the union of two published files, merged locally
        layers = manifest.parse_layers(text)
        swarm = Swarm(manifest, torrent, FetchConfig(dest=dest, layers=layers, peers=((host, int(port)),)))
        try:
            result = swarm.fetch()
        finally:
            swarm.close()
        assert result.downloaded_bytes <= 1.05 * result.needed_bytes
        path, embeddings = assemble(manifest, dest, layers, tmp_path / "cache")
        config = LlamaShardConfig(n_ctx=1024, max_sessions=1, n_threads=2)
        shards.append(LlamaShard(path, model_id=manifest.model_id, embeddings=embeddings, config=config))
    full = LlamaShard(bundled_gguf(), config=LlamaShardConfig(n_ctx=1024, max_sessions=1, n_threads=2))
    try:
        assert [s.info.layers.stop for s in shards] == [10, 30]
        prompt = [1, 9690, 198, 2683, 314, 253, 1345, 563, 253, 36074, 30, 2, 198, 1, 520, 9531, 198]
        assert generate(shards, prompt, 24, chunk=64) == generate([full], prompt, 24, chunk=64)
    finally:
        for shard in [*shards, full]:
            shard.close()


def test_web_seed_only_fetch(published: Path, tmp_path: Path) -> None:
    with contextlib.closing(RangeServer(published).start()) as web:
        done = meshnet(["fetch", str(published / "manifest.json"), "--layers", "10:20", "--dest", str(tmp_path),
                        "--web-seed", web.url])  # fmt: skip
    assert done.returncode == 0, done.stderr
    fetched = _FETCHED.search(done.stdout)
    assert fetched is not None and _num(fetched.group(3)) <= 1.05 * _num(fetched.group(1))
    name = "blk-010-020.gguf"
    assert sha256(tmp_path / NAME / name) == sha256(published / NAME / name)
    assert not any((tmp_path / ".part").rglob("*.gguf"))


def _corrupt_copy(published: Path, root: Path, name: str) -> Path:
    """A web seed folder whose copy of ``name`` has one flipped byte in every 1 MiB piece."""
    data = bytearray((published / NAME / name).read_bytes())
    for offset in range(4096, len(data), 1 << 20):
        data[offset] ^= 0xFF
    (root / NAME).mkdir(parents=True)
    (root / NAME / name).write_bytes(bytes(data))
    return root


def test_corrupt_web_seed_is_caught_and_the_peer_completes_the_file(published: Path, seed: str, tmp_path: Path) -> None:
    name = "blk-010-020.gguf"
    bad = _corrupt_copy(published, tmp_path / "bad", name)
    with contextlib.closing(RangeServer(bad).start()) as web:
        done = meshnet(["fetch", str(published / "manifest.json"), "--layers", "10:20", "--dest",
                        str(tmp_path / "dl"), "--web-seed", web.url, "--peer", seed])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sha256(tmp_path / "dl" / NAME / name) == sha256(published / NAME / name)
    failures = re.search(r"(\d+) hash failures", done.stdout)
    assert failures is not None and int(failures.group(1)) >= 1, done.stdout


def test_a_bad_web_seed_as_only_source_fails_in_bounded_time(published: Path, tmp_path: Path) -> None:
    name = "blk-010-020.gguf"
    bad = _corrupt_copy(published, tmp_path / "bad", name)
    manifest = str(published / "manifest.json")
    with contextlib.closing(RangeServer(bad).start()) as web:
        started = time.monotonic()
        done = meshnet(["fetch", manifest, "--layers", "10:20", "--dest", str(tmp_path / "dl"), "--web-seed", web.url,
                        "--stall-timeout", "5"])  # fmt: skip
        elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fetch stalled" in done.stderr and f"web seed {web.url}" in done.stderr
    assert "failed their hash check" in done.stderr
    assert elapsed < 60
    assert not (tmp_path / "dl" / NAME / name).exists()  # nothing unverified at the final path
    # A dead web seed (nothing listens) fails the same way.
    with contextlib.closing(RangeServer(bad).start()) as gone:
        dead_url = gone.url
    done = meshnet(["fetch", manifest, "--layers", "10:20", "--dest", str(tmp_path / "dl2"), "--web-seed", dead_url,
                    "--stall-timeout", "3"])  # fmt: skip
    assert done.returncode == 1 and "fetch stalled at 0.0%" in done.stderr, done.stderr


def test_a_killed_fetch_resumes_without_downloading_verified_pieces_again(
    published: Path, seed: str, tmp_path: Path
) -> None:
    manifest = str(published / "manifest.json")
    args = ["fetch", manifest, "--layers", "20:30", "--dest", str(tmp_path), "--peer", seed]
    popen = subprocess.Popen([*MESHNET, *args, "--max-rate-mib", "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert popen.stdout is not None
        deadline = time.monotonic() + 60
        for line in iter(popen.stdout.readline, ""):
            match = _PROGRESS.search(line)
            if (match and float(match.group(1)) >= 50.0) or time.monotonic() > deadline:
                break
        popen.send_signal(signal.SIGKILL)
        popen.wait(10)
    finally:
        stop(popen)
        assert popen.stdout is not None
        popen.stdout.close()
    assert popen.returncode == -signal.SIGKILL
    assert not (tmp_path / NAME / "blk-020-030.gguf").exists()
    done = meshnet(args)
    assert done.returncode == 0, done.stderr
    fetched = _FETCHED.search(done.stdout)
    assert fetched is not None, done.stdout
    needed, resumed, downloaded = (_num(g) for g in fetched.groups())
    # the pieces flushed before the kill were kept (a loaded machine flushes behind the progress line)...
    assert resumed >= 0.1 * needed
    assert downloaded <= needed - resumed + (2 << 20)  # ...and not fetched again
    assert sha256(tmp_path / NAME / "blk-020-030.gguf") == sha256(published / NAME / "blk-020-030.gguf")


def test_layers_off_the_published_boundaries_and_bad_manifests_are_usage_errors(
    published: Path, tmp_path: Path
) -> None:
    manifest = str(published / "manifest.json")
    done = meshnet(["fetch", manifest, "--layers", "5:15", "--dest", str(tmp_path)])
    assert done.returncode == 2 and "published boundaries 0, 10, 20, 30" in done.stderr
    broken = tmp_path / "manifest.json"
    broken.write_text((published / "manifest.json").read_text().replace('"architecture":"llama"', '"architecture":"x"'))
    (tmp_path / "model.torrent").write_bytes((published / "model.torrent").read_bytes())
    done = meshnet(["node", "--manifest", str(broken), "--layers", "0:10", "--dest", str(tmp_path)])
    assert done.returncode == 2 and "manifest field 'architecture'" in done.stderr
    done = meshnet(["fetch", manifest, "--dest", str(tmp_path), "--manifest-digest", "sha256:" + "0" * 64])
    assert done.returncode == 2 and "expected sha256:000" in done.stderr
