"""KV snapshots for route repair, real processes: a private swarm of trusted nodes with two middles of
the same layers. After a long prompt's prefill the serving middle snapshots its KV to the other;
``kill -9`` of the serving middle mid-stream is repaired by restoring that snapshot and replaying
only the positions generated after it — and the streamed text is exactly the text without the kill."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.private_swarm import PrivateSwarm, private_swarm
from tests.procs import member_client

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "Read these notes. " + " ".join(
    f"Note {i}: the lamp in hall {i % 7} is {i * 5 % 11} steps away." for i in range(24)
)
NODES = (("head", "0:10"), ("mid-a", "10:20"), ("mid-b", "10:20"), ("tail", "20:30"))
NODE_ARGS = ["--threads", "1", "--ctx", "4096", "--max-sessions", "2"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSwarm]:
    with private_swarm(tmp_path_factory.mktemp("snapshots"), NODES, trusted=True, node_args=NODE_ARGS) as swarm:
        yield swarm


def chat(swarm: PrivateSwarm, gid: str, kill_at: int | None = None) -> tuple[str, str | None]:
    """The streamed text and the node killed after ``kill_at`` chunks (the route's middle)."""
    assert swarm.gateway is not None
    url, killed = swarm.gateway.url, None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=32, stream=True,
        extra_headers={"X-Meshnet-Generation-Id": gid},
    )  # fmt: skip
    text = ""
    for n, chunk in enumerate(chunks):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if n == kill_at:
            route = httpx.get(f"{url}/v1/generations/{gid}", timeout=10).json()["route"]
            killed = route[1]["node"]
            kill(swarm, killed)
    return text, killed


def kill(swarm: PrivateSwarm, member_id: str) -> None:
    for proc in swarm.procs:
        if f"--swarm-dir {swarm.member(member_id)} " in " ".join(proc.popen.args) + " ":  # type: ignore[arg-type]
            os.kill(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(10)
            return
    raise AssertionError(f"no process runs node {member_id}")


def test_a_killed_middle_is_repaired_from_its_snapshot_and_the_text_is_unchanged(swarm: PrivateSwarm) -> None:
    expected, _ = chat(swarm, "gen-snap-baseline")
    text, killed = chat(swarm, "gen-snap-kill", kill_at=6)
    assert text == expected
    assert swarm.gateway is not None
    body = httpx.get(f"{swarm.gateway.url}/v1/generations/gen-snap-kill/events", timeout=30).text
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    prompt = next(e for e in events if e["type"] == "prefill.completed")["prompt_tokens"]
    retries = [e for e in events if e["type"] == "route.retry"]
    assert len(retries) == 1 and retries[0]["kind"] == "repair" and retries[0]["failed_node"] == killed
    standby = "mid-b" if killed == "mid-a" else "mid-a"
    assert [n["node"] for n in retries[0]["nodes"]] == ["head", standby, "tail"]
    # restored at the prompt's end: only the positions generated before the kill were replayed
    assert prompt >= 256 and 0 < retries[0]["replayed_positions"] < 16, (prompt, retries[0])
    with member_client(swarm.admin) as admin:
        held = admin.get(f"{swarm.nodes[standby]}/v1/health").json()["prefix_cache"]
    assert held["snapshots"] == 0  # taken by the restore


def test_snapshot_endpoints_refuse_callers_without_the_trackers_ticket(swarm: PrivateSwarm) -> None:
    with member_client(swarm.admin) as admin:
        url = swarm.nodes["tail"]
        refused = admin.post(f"{url}/v1/snapshots/ses-x", content=b"MNSS")
        assert refused.status_code == 401 and "ticket" in refused.json()["error"]["message"]
        refused = admin.post(f"{url}/v1/sessions/ses-x/restore", headers={"X-Meshnet-Route-Id": "r"})
        assert refused.status_code == 401
