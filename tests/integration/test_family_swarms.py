"""The seed's target families over the network: a tiny random model of each, converted by llama.cpp's
converter, served by ``meshnet up --gguf TINY.gguf --nodes 3`` (tracker, three llama.cpp node
processes, gateway) gives the same greedy text as one node holding the whole GGUF.

GLM-5.x (``glm-dsa``: MLA + DSA indexer, layers reusing a top-k selection), the Qwen3.5-style
hybrids (``qwen35moe``, ``qwen3next``: linear-attention layers with recurrent state) and
DeepSeek-V4 (``deepseek4``: hyper-connection streams across seams, hash-routed layers, compressed
attention) — the layout
``up`` picks must respect each family's cut rules (``shard_file.range_starts``).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.certify.convert import gguf_for
from tests.certify.tiny import TINY
from tests.procs import meshnet_process

pytestmark = pytest.mark.real

PROMPTS = ("The quick brown fox", "Rivers carve canyons over many years. Bread needs")


def complete(url: str, model: str, prompt: str) -> tuple[str, str]:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers["x-meshnet-generation-id"]


def route_layers(url: str, gid: str) -> list[str]:
    events = httpx.get(f"{url}/v1/generations/{gid}/events", timeout=30).text.splitlines()
    accepted = next(json.loads(e[6:]) for e in events if e.startswith("data: ") and "route.accepted" in e)
    return [n["layers"] for n in accepted["nodes"]]


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("glm-dsa", ["0:2", "2:4", "4:6"]),
        ("qwen35moe", ["0:3", "3:6", "6:9"]),
        ("qwen3next", ["0:3", "3:6", "6:9"]),
        # hash-routed layers on the head, every range with CSA and HCA layers, [4, 64] hc streams
        ("deepseek4", ["0:4", "4:6", "6:9"]),
    ],
)
def test_three_nodes_give_the_whole_models_text(arch: str, layout: list[str], tmp_path: Path) -> None:
    gguf, _ = gguf_for(TINY[arch])
    texts = {}
    for nodes in ("1", "3"):
        args = ["up", "--gguf", str(gguf), "--port", "0", "--nodes", nodes, "--workdir", str(tmp_path / nodes)]
        with meshnet_process(args, ready_timeout_s=300) as swarm:
            texts[nodes] = [complete(swarm.url, gguf.name.removesuffix(".gguf"), prompt) for prompt in PROMPTS]
            if nodes == "3":
                assert route_layers(swarm.url, texts[nodes][0][1]) == layout
    assert [t for t, _ in texts["3"]] == [t for t, _ in texts["1"]]
    assert all(t for t, _ in texts["1"])
