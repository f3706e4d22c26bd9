"""A gateway without weights, and two models in one swarm, with real processes and real llama.cpp.

Two publications, each with a Range-capable web seed baked into its manifest: the bundled
SmolLM2-135M (model A, cut 0:10 / 10:20 / 20:30) and a second, different model made from it (its
first 6 blocks only: model B, cut 0:3 / 3:6). One tracker; two nodes per model fetch their files
from the manifests; one gateway is given only A's manifest URL (no GGUF): it fetches A's vocabulary
artifact, learns B from the tracker (B's nodes hand their manifest over), and routes each request to
its own model's nodes. Every text is compared with ``meshnet serve`` on the full GGUF.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.fetch import load_source
from meshnet.artifacts.webseed import RangeServer
from tests.procs import MESHNET, Proc, meshnet_process, stop

pytestmark = pytest.mark.real

MODEL_B = "SmolLM2-6L.Q4_1"
B_LAYERS = 6
PROMPTS = ("What is the capital of France?", "List three uses of copper.")
NODE_ARGS = ["--threads", "1", "--ctx", "512", "--max-sessions", "2", "--wire-dtype", "float32"]


def truncated_model(source: Path, out: Path, blocks: int) -> Path:
    """``source`` with only its first ``blocks`` blocks: a different model (other weights, other text)
    with the same tokenizer, as a GGUF llama.cpp loads whole."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = blocks if field.name == f"{arch}.block_count" else field.contents()
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < blocks]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


def publish(gguf: Path | None, out: Path, *args: str) -> None:
    command = [*MESHNET, "publish", *([str(gguf)] if gguf else []), "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr


@dataclass(frozen=True)
class Publication:
    folder: Path
    url: str  # the web seed serving ``folder``; its manifest is at url + "manifest.json"

    @property
    def manifest_url(self) -> str:
        return f"{self.url}manifest.json"


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return truncated_model(bundled_gguf(), tmp_path_factory.mktemp("b") / f"{MODEL_B}.gguf", B_LAYERS)


@pytest.fixture(scope="module")
def publications(tmp_path_factory: pytest.TempPathFactory, model_b: Path) -> Iterator[tuple[Publication, Publication]]:
    with contextlib.ExitStack() as stack:
        found = []
        for name, gguf, ranges in (("a", None, "0:10,10:20,20:30"), ("b", model_b, "0:3,3:6")):
            folder = tmp_path_factory.mktemp(f"pub-{name}")
            web = stack.enter_context(contextlib.closing(RangeServer(folder).start()))
            publish(gguf, folder, "--ranges", ranges, "--web-seed", web.url)
            found.append(Publication(folder, web.url))
        yield found[0], found[1]


@dataclass(frozen=True)
class Swarm:
    tracker: Proc
    gateway: Proc
    nodes: dict[str, list[str]]  # model id -> its nodes' URLs
    gateway_dest: Path
    procs: dict[str, Proc]  # node URL -> its process


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, publications: tuple[Publication, Publication]) -> Iterator[Swarm]:
    a, b = publications
    root = tmp_path_factory.mktemp("swarm")
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(
            meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{root / 'tracker.db'}"])
        )
        nodes: dict[str, list[str]] = {}
        procs: dict[str, Proc] = {}
        for model, publication, ranges in (("a", a, ("0:10", "10:30")), ("b", b, ("0:3", "3:6"))):
            for layers in ranges:
                dest = root / f"{model}-{layers.replace(':', '-')}"
                args = ["node", "--manifest", publication.manifest_url, "--layers", layers, "--dest", str(dest)]
                args += ["--cache-dir", str(root / "cache"), "--tracker", tracker.url, "--port", "0", *NODE_ARGS]
                proc = stack.enter_context(meshnet_process(args))
                nodes.setdefault(load_source(publication.manifest_url)[0].model_id, []).append(proc.url)
                procs[proc.url] = proc
        dest = root / "gateway"
        args = ["gateway", "--manifest", a.manifest_url, "--tracker", tracker.url, "--port", "0", "--dest", str(dest)]
        gateway = stack.enter_context(meshnet_process([*args, "--ctx", "1024"]))
        yield Swarm(tracker, gateway, nodes, dest, procs)


def listed(url: str) -> list[str]:
    return sorted(m.id for m in client(url).models.list().data)


def wait_listed(url: str, expected: list[str], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := listed(url)) != expected:
        assert time.monotonic() < deadline, f"/v1/models lists {got}, not {expected}"
        time.sleep(0.5)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)


def chat(url: str, model: str, prompt: str) -> tuple[str, dict[str, Any]]:
    out = client(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24
    )
    return out.choices[0].message.content or "", out.to_dict().get("meshnet", {})


def test_a_gateway_holding_only_the_manifest_gives_serves_text(swarm: Swarm, server: Proc, model_id: str) -> None:
    # All the gateway holds of the model is the vocabulary artifact: metadata, no tensor.
    held = sorted(p.relative_to(swarm.gateway_dest).as_posix() for p in swarm.gateway_dest.rglob("*") if p.is_file())
    assert held == [f"{model_id}/vocab.gguf"]
    assert (swarm.gateway_dest / model_id / "vocab.gguf").stat().st_size < bundled_gguf().stat().st_size / 20
    assert "no weights on this gateway" in swarm.gateway.output()
    wait_listed(swarm.gateway.url, sorted([model_id, MODEL_B]))
    for prompt in PROMPTS:
        text, telemetry = chat(swarm.gateway.url, model_id, prompt)
        assert text and text == chat(server.url, model_id, prompt)[0]
        assert {hop["url"] for hop in telemetry["route"]} == set(swarm.nodes[model_id])


def test_two_models_in_one_swarm_each_routed_to_its_own_nodes(swarm: Swarm, model_b: Path, model_id: str) -> None:
    wait_listed(swarm.gateway.url, sorted([model_id, MODEL_B]))  # B learned from the tracker
    assert f"vocabulary of {MODEL_B}" in swarm.gateway.output()  # fetched, verified, loaded vocab-only
    with meshnet_process(["serve", "--gguf", str(model_b), "--port", "0", "--threads", "1", "--ctx", "1024"]) as ref:
        for prompt in PROMPTS:
            text, telemetry = chat(swarm.gateway.url, MODEL_B, prompt)
            assert text == chat(ref.url, MODEL_B, prompt)[0]
            assert {hop["url"] for hop in telemetry["route"]} == set(swarm.nodes[MODEL_B])
            assert [hop["layers"] for hop in telemetry["route"]] == ["0:3", "3:6"]
            assert text != chat(swarm.gateway.url, model_id, prompt)[0]  # another model, another text


def test_an_unknown_model_is_openais_404(swarm: Swarm) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        chat(swarm.gateway.url, "gpt-9", "hello")
    body = err.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", "model", "model_not_found")


def test_a_tampered_vocabulary_is_refused(
    swarm: Swarm, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, model_b: Path
) -> None:
    # A publication without a baked-in web seed, served by a web seed whose vocabulary was altered.
    folder = tmp_path_factory.mktemp("pub-tampered")
    publish(model_b, folder, "--ranges", "0:3,3:6", "--model-id", "tampered")
    vocab = folder / "tampered" / "vocab.gguf"
    data = bytearray(vocab.read_bytes())
    data[len(data) // 2] ^= 0xFF
    vocab.write_bytes(bytes(data))
    with contextlib.closing(RangeServer(folder).start()) as web:
        args = ["gateway", "--manifest", f"{web.url}manifest.json", "--tracker", swarm.tracker.url, "--port", "0",
                "--dest", str(tmp_path / "dest"), "--stall-timeout", "5", "--learn-models", "off"]  # fmt: skip
        done = subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    # libtorrent's piece check bans the web seed (the fetch stalls), or the file's SHA-256 check catches it.
    assert "failed their hash check" in done.stderr or "SHA-256 differs from the manifest" in done.stderr
    assert not (tmp_path / "dest" / "tampered" / "vocab.gguf").exists()  # nothing unverified where it would load
    shutil.rmtree(folder)


def test_a_model_leaves_the_list_when_its_nodes_are_gone(swarm: Swarm, model_id: str) -> None:
    """Last in this module: it stops a node of model B."""
    listing = httpx.get(f"{swarm.tracker.url}/v1/models", timeout=10).json()["models"]
    assert {m["id"]: m["routable"] for m in listing} == {model_id: True, MODEL_B: True}
    assert all(m["manifests"] and m["manifests"][0]["held"] for m in listing)
    tail = swarm.nodes[MODEL_B][-1]
    stop(swarm.procs[tail].popen)
    wait_listed(swarm.gateway.url, [model_id], timeout_s=60)  # the tracker's node TTL is 15 s
    listing = httpx.get(f"{swarm.tracker.url}/v1/models", timeout=10).json()["models"]
    b = next(m for m in listing if m["id"] == MODEL_B)
    assert not b["routable"] and "no node serves layers 3:6" in b["reason"]
    with pytest.raises(openai.APIStatusError) as err:
        chat(swarm.gateway.url, MODEL_B, "hello")
    assert err.value.status_code == 503  # still served here, but no route right now
