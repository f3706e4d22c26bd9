"""Shared benchmark plumbing: machine description, medians, a markdown section record."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Section:
    title: str
    command: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # metric, value, goal, verdict
    notes: list[str] = field(default_factory=list)

    def add(self, metric: str, value: str, goal: str = "", met: bool | None = None) -> None:
        verdict = "" if met is None else ("met" if met else "**missed**")
        self.rows.append((metric, value, goal, verdict))

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", f"Command: `{self.command}`", ""]
        lines += ["| metric | value | goal | |", "|---|---|---|---|"]
        lines += [f"| {m} | {v} | {g} | {ok} |" for m, v, g, ok in self.rows]
        if self.notes:
            lines += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import llama_cpp

        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = "not installed"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    ).stdout.strip()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB RAM; {platform.system()} {platform.release()}; "
        f"Python {sys.version.split()[0]}; llama-cpp-python {llama_version}; commit {commit or 'uncommitted'}"
    )


def timed_decode(chain: Any, sid: Any, prompt: list[int], steps: int) -> tuple[float, Any, int]:
    """Prefill ``prompt`` through an in-process ``chain`` (sessions already open), then time ``steps``
    greedy decode steps: ``(tokens per second, the last logits, the next position)``."""
    import numpy as np

    from meshnet.backends.chain import decode_chain, prefill_chain

    logits = prefill_chain(chain, sid, prompt, chunk=64)
    position = len(prompt)
    started = time.perf_counter()
    for _ in range(steps):
        logits = decode_chain(chain, sid, position, int(np.argmax(logits)))
        position += 1
    return steps / (time.perf_counter() - started), logits, position


def decode_rate(tokens: int, times: list[float]) -> float:
    """Decode tokens/s of a stream: (tokens - 1) over the time from its first text chunk to its last."""
    return (tokens - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def route_compute_ms(url: str, gid: str) -> float:
    """A generation's compute per decoded token, summed over its route's hops (its route.health event)."""
    body = httpx.get(f"{url}/v1/generations/{gid}/events", timeout=30).text
    for line in body.splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "route.health" and event["status"] == "ok":
                return float(sum(h["compute_ms_per_token"] for h in event["hops"]))
    raise RuntimeError(f"generation {gid} reported no route health")


def stream_completion(
    url: str, body: dict[str, Any], gid: str, on_token: Callable[[int], None] | None = None
) -> list[float]:
    """Stream ``POST /v1/completions`` of ``body`` as generation ``gid``: the arrival times of its text
    chunks (keep-alive chunks during prefill carry no text); ``on_token(n)`` after the n-th."""
    times: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      headers={"X-Meshnet-Generation-Id": gid}, timeout=300) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    return times


def wait_registered(tracker_url: str, count: int, timeout_s: float = 120.0) -> None:
    """Wait until ``count`` nodes are registered with the open swarm's tracker at ``tracker_url``."""
    deadline = time.monotonic() + timeout_s
    while len(httpx.get(f"{tracker_url}/v1/nodes", timeout=10).json()["nodes"]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("nodes did not register")
        time.sleep(0.2)
