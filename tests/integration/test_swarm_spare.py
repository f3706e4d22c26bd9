"""``meshnet up --nodes 4 --spares 1`` survives ``kill -9`` of any non-head node during a streamed chat.

The user sees the same tokens as without the kill; the only trace is a ``route.retry`` telemetry event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "Name five rivers and one fact about each."}]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    workdir = tmp_path_factory.mktemp("spare")
    args = ["up", "--port", "0", "--nodes", "4", "--spares", "1", "--workdir", str(workdir)]
    with meshnet_process(args, ready_timeout_s=300) as proc:
        yield proc


def chat(up: Proc, gid: str, kill_at: int | None = None, victim: list[str] | None = None) -> str:
    url = up.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
    text = ""
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, stream=True,  # type: ignore[arg-type]
        extra_headers={"X-Meshnet-Generation-Id": gid},
    )  # fmt: skip
    for n, chunk in enumerate(chunks):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if n == kill_at and victim is not None:
            route = httpx.get(f"{url}/v1/generations/{gid}", timeout=10).json()["route"]
            # The hop after the head: the spare (replaced by the middle and the tail, a two-hop replay), or
            # the middle (no node serves just 10:20 any more: the spare replaces the middle and the tail).
            victim.append(route[1]["node"])
            kill_node(up, victim[0])
    return text


def kill_node(up: Proc, node_id: str) -> None:
    """SIGKILL the ``meshnet node`` child of ``meshnet up`` that runs ``node_id``."""
    for proc in psutil.Process(up.popen.pid).children(recursive=True):
        cmdline = proc.cmdline()
        if "node" in cmdline and "--node-id" in cmdline and cmdline[cmdline.index("--node-id") + 1] == node_id:
            proc.kill()
            proc.wait(10)
            return
    raise AssertionError(f"no process runs node {node_id}")


def events(url: str, gid: str) -> list[dict[str, object]]:
    body = httpx.get(f"{url}/v1/generations/{gid}/events", timeout=30).text
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


def test_a_streamed_chat_survives_kill_9_of_a_non_head_node(swarm: Proc) -> None:
    nodes = httpx.get(f"{swarm.url}/v1/swarm", timeout=10).json()["nodes"]
    assert sorted(n["layers"] for n in nodes) == ["0:10", "10:20", "10:30", "20:30"]
    expected = chat(swarm, "gen-spare-baseline")
    victim: list[str] = []
    started = time.monotonic()
    assert chat(swarm, "gen-spare-kill", kill_at=10, victim=victim) == expected
    assert time.monotonic() - started < 120
    retries = [e for e in events(swarm.url, "gen-spare-kill") if e["type"] == "route.retry"]
    assert len(retries) == 1 and retries[0]["kind"] == "repair" and retries[0]["failed_node"] == victim[0]
    layers = [n["layers"] for n in retries[0]["nodes"]]  # type: ignore[attr-defined]
    assert layers in (["0:10", "10:20", "20:30"], ["0:10", "10:30"]) and victim[0] not in str(retries[0]["nodes"])
    assert swarm.popen.poll() is None  # `meshnet up` keeps the swarm running
