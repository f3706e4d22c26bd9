"""Route repair after ``kill -9`` with a KV snapshot vs repair by replay, at ~2K tokens of context.

Swarm: a private swarm (mutual TLS, route tickets, every node of the trusted tier): tracker, head
0:10, five middles 10:20, tail 20:30, and two gateways — one with ``--kv-snapshots on`` (after the
prompt's prefill the serving middle copies its KV to a standby middle), one with ``off`` (repair
replays the whole context into the replacement from the head's seam log, as before). One llama.cpp
thread per node. Each round streams a greedy completion of a ~2K-token prompt through each gateway
and kills the middle serving it after a few tokens; the time is from the kill to the first token
after the stall it caused (the longest gap between tokens after the kill, as in ``bench repair``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.private_swarm import private_swarm
from tests.procs import join, meshnet_process

from benchmarks.common import Section, median, stream_completion

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = " ".join(f"Fact {i}: the river flows north in spring and the bridge {i} is stone." for i in range(110))
KILL_AFTER = 4
AFTER_KILL = 24
ROUNDS = 2
MIDDLES = 2 * ROUNDS + 1
NODE_ARGS = ["--threads", "1", "--ctx", "8192", "--max-sessions", "2"]


def _stream(url: str, gid: str, on_token: Callable[[int], None] | None) -> list[float]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": KILL_AFTER + AFTER_KILL, "temperature": 0}
    return stream_completion(url, body, gid, on_token)


def run() -> Section:
    section = Section(
        "Route repair after kill -9 with a KV snapshot vs by replay (~2K tokens of context)",
        "python benchmarks/run.py --only snapshot  (private swarm: tracker, head, 5 middles 10:20, tail, two "
        f"gateways; 1 llama.cpp thread per node; median of {ROUNDS})",
    )
    middles = [(f"mid-{i}", "10:20") for i in range(MIDDLES)]
    nodes = [("head", "0:10"), *middles, ("tail", "20:30")]
    stalls: dict[str, list[float]] = {"on": [], "off": []}
    replayed: dict[str, list[int]] = {"on": [], "off": []}
    prompt_tokens = 0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        swarm = stack.enter_context(private_swarm(root, nodes, trusted=True, node_args=NODE_ARGS, gateway=False))
        gateways = {}
        for mode in ("on", "off"):
            credentials = join(swarm.dir, "gateway", f"gw-{mode}", root / f"gw-{mode}")
            args = [
                "gateway",
                "--swarm-dir",
                str(credentials),
                "--tracker",
                swarm.tracker.url,
                "--port",
                "0",
                "--ctx",
                "4096",
            ]
            gateways[mode] = stack.enter_context(meshnet_process([*args, "--kv-snapshots", mode]))
        procs = {mid: proc for (mid, _), proc in zip(nodes, swarm.procs, strict=True)}
        _stream(gateways["off"].url, "bench-warm", None)
        for i in range(ROUNDS):
            for mode in ("on", "off"):
                url, gid, killed = gateways[mode].url, f"bench-{mode}-{i}", []  # type: ignore[var-annotated]

                def on_token(n: int, url: str = url, gid: str = gid, killed: list[float] = killed) -> None:
                    if n == KILL_AFTER and not killed:
                        route = httpx.get(f"{url}/v1/generations/{gid}", timeout=10).json()["route"]
                        victim = procs[route[1]["node"]]
                        killed.append(time.perf_counter())
                        os.kill(victim.popen.pid, signal.SIGKILL)
                        victim.popen.wait(10)

                times = _stream(url, gid, on_token)
                after = [t for t in times if t > killed[0]]
                gaps = [b - a for a, b in zip([killed[0], *after], after, strict=False)]
                stalls[mode].append(after[gaps.index(max(gaps))] - killed[0])
                text = httpx.get(f"{url}/v1/generations/{gid}/events", timeout=30).text
                events = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: ")]
                retry = [e for e in events if e["type"] == "route.retry"]
                if len(retry) != 1 or retry[0]["kind"] != "repair":
                    raise RuntimeError(f"expected one route repair, telemetry says {retry}")
                replayed[mode].append(retry[0]["replayed_positions"])
                prompt_tokens = next(e for e in events if e["type"] == "prefill.completed")["prompt_tokens"]
    ratio = median(stalls["on"]) / median(stalls["off"])
    section.add("context at the kill", f"{prompt_tokens + KILL_AFTER - 1} tokens")
    section.add("repair with a snapshot: kill → first token after the stall",
                f"{median(stalls['on']):.3f} s ({median(replayed['on']):.0f} positions replayed)")  # fmt: skip
    section.add("repair by replay: kill → first token after the stall",
                f"{median(stalls['off']):.3f} s ({median(replayed['off']):.0f} positions replayed)")  # fmt: skip
    section.add("snapshot ÷ replay", f"{ratio:.2f}", "≤ 0.5", ratio <= 0.5)
    section.notes += [
        "With snapshots the standby middle restores the dead middle's KV of the whole prompt (taken right after "
        "the prefill) and the head replays only the tokens generated since; by replay the replacement recomputes "
        "its 10 layers over the whole context from the head's seam log.",
        "What is left in the snapshot repair: noticing the failure (the dead hop's connection error), the "
        "tracker's repair, opening the session on the snapshot (loaded into a free llama.cpp sequence of the "
        "standby when it arrived) and the short replay.",
    ]
    return section
