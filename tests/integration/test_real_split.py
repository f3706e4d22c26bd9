"""A real pretrained model published the way big models are: a llama.cpp split set.

Qwen2.5-Coder 0.5B (qwen2, Q4_K_M; ``tests/realmodels.py``) is rewritten as a 3-file split set by
gguf-py's own splitter. ``meshnet serve`` and ``meshnet up`` both take its first file, and the
route gives serve's greedy text through the official ``openai`` client; ``meshnet publish`` of the
set streams it. Peak and resident memory of publish and of every node are printed (``-s`` shows
them) and bounded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from meshnet.cli.paths import default_cache_dir
from tests.procs import Proc, meshnet_peak_rss, meshnet_process, up_nodes
from tests.realmodels import real_model, write_split

pytestmark = pytest.mark.real

MODEL = "qwen2.5-coder-0.5b"
MODEL_ID = "qwen2.5-coder-0.5b-instruct-q4_k_m"
PROMPTS = ("Write a Python function that reverses a string.", "What does HTTP status 404 mean?")


@pytest.fixture(scope="module")
def split_set(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_split(real_model(MODEL), tmp_path_factory.mktemp("real-split"), 200 << 20)


@pytest.fixture(scope="module")
def served(split_set: list[Path]) -> Iterator[Proc]:
    with meshnet_process(["serve", "--gguf", str(split_set[0]), "--port", "0", "--threads", "2", "--ctx", "2048"]) as p:
        yield p


def _chat(url: str, prompt: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24
        )
    return out.choices[0].message.content or ""


def test_up_on_the_first_file_of_a_split_set_gives_serves_text(
    split_set: list[Path], served: Proc, tmp_path: Path
) -> None:
    assert len(split_set) == 3
    expected = [_chat(served.url, p) for p in PROMPTS]
    assert all(expected)
    args = ["up", "--gguf", str(split_set[0]), "--port", "0", "--nodes", "3", "--workdir", str(tmp_path)]
    with meshnet_process([*args, "--ctx", "2048", "--max-sessions", "2"], ready_timeout_s=600) as up:
        assert [_chat(up.url, p) for p in PROMPTS] == expected
        held = {layers: _held(node, layers) for layers, node in up_nodes(up).items()}
    print(f"\nreal split {MODEL}: node RSS / files / KV budget (MiB):",
          {k: tuple(round(v / 2**20) for v in t) for k, t in sorted(held.items())})  # fmt: skip
    assert len(held) == 3
    for rss, files, kv in held.values():
        # A node holds its range and its KV, and a fixed cost (interpreter, libraries, llama.cpp's
        # compute buffers); never the model's vocabulary parsed, nor pages of the whole model.
        assert rss <= 1.2 * (files + kv) + _FIXED_COST


# What a node process holds beyond its files and KV: Python with its libraries (~70 MiB) and
# llama.cpp's compute buffers and vocabulary (~40-80 MiB at this model's size), measured here.
_FIXED_COST = 160 << 20
_KV_BYTES = 2 * 2 * 64 * 2  # per token per layer: K and V, 2 KV heads of 64 dims, f16


def _held(node: psutil.Process, layers: str) -> tuple[int, int, int]:
    """A node's resident bytes, the bytes of the GGUF files it maps, and its KV budget."""
    start, stop = (int(v) for v in layers.split(":"))
    # The shard it cut (LlamaShard.from_model caches it by the source's identity) and a head's table.
    shard = max(default_cache_dir().glob(f"{MODEL_ID}.*.{start}-{stop}.gguf"), key=lambda p: p.stat().st_mtime)
    embd = shard.with_name(shard.name.removesuffix(".gguf") + ".embd.gguf")
    files = shard.stat().st_size + (embd.stat().st_size if embd.is_file() else 0)
    kv = _KV_BYTES * (stop - start) * 2048 * 2
    return node.memory_info().rss, files, kv


def test_publish_of_a_split_set_streams_it_and_a_node_serves_it(
    split_set: list[Path], served: Proc, tmp_path: Path
) -> None:
    out = tmp_path / "published"
    # publish in a process of its own: pytest's holds the split set it wrote
    peak = meshnet_peak_rss(["publish", str(split_set[0]), "--out", str(out), "--layers-per-file", "8"])
    model_size = sum(p.stat().st_size for p in split_set)
    print(f"\nreal split {MODEL}: publish peak RSS {peak / 2**20:.0f} MiB = {peak / model_size:.3f} x the model")
    doc = json.loads((out / "manifest.json").read_bytes())
    assert [s["name"] for s in doc["gguf_splits"]] == [p.name for p in split_set]
    assert doc["model"]["id"] == MODEL_ID
    # The vocabulary and the interpreter are a fixed cost; the model's bytes are streamed, never held.
    assert peak < 0.3 * model_size
    assert {f["layers"] for f in doc["files"]} == {"0:8", "8:16", "16:24"}

    # A node serves the publication (its three files merged into one range) and gives serve's text.
    db = f"sqlite:///{tmp_path / 'tracker.db'}"
    node = ["node", "--manifest", str(out / "manifest.json"), "--layers", "0:24", "--dest", str(out)]
    node += ["--threads", "2", "--ctx", "2048", "--max-sessions", "1", "--cache-dir", str(tmp_path / "cache")]
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", db]))
        stack.enter_context(meshnet_process([*node, "--tracker", tracker.url], ready_timeout_s=600))
        gateway = ["gateway", "--gguf", str(split_set[0]), "--tracker", tracker.url, "--port", "0", "--ctx", "2048"]
        gw = stack.enter_context(meshnet_process(gateway, ready_timeout_s=300))
        assert _chat(gw.url, PROMPTS[0]) == _chat(served.url, PROMPTS[0])
