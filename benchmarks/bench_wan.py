"""A route over emulated WAN links: 3 seams at 20 ms round trip each, speculative decoding off and on.

Three llama.cpp node processes, each reachable only through a user-space delay proxy
(``tests/wan.py``: 10 ms each way, every byte) and advertised at it (``--public-url``): the gateway
reaches the head, the head the middle and the middle the tail over one emulated link each. Two
gateways on the same swarm, ``--speculative off`` and ``ngram``, measured in alternating rounds on
a copy-heavy request.

The floor a route could reach per token: the nodes' own compute (``compute_ms_per_token`` from the
route's telemetry) + one one-way leg per seam + the leg back to the gateway. Today every answer
walks back through every hop, so a plain step pays two legs per seam.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time

import httpx
from tests.wan import delay_proxy

from benchmarks.bench_serve import stream_text
from benchmarks.bench_speculative import COPY_PROMPT, two_gateway_swarm
from benchmarks.common import Section, median

CORES = os.cpu_count() or 2
ONE_WAY_S = 0.010  # 20 ms round trip per seam
TOKENS = 64
ROUNDS = 3
LAYOUT = ("0:10", "10:20", "20:30")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _compute_ms(url: str, gid: str) -> float:
    """The route's compute per decoded token, summed over its hops (from the route.health event)."""
    body = httpx.get(f"{url}/v1/generations/{gid}/events", timeout=30).text
    for line in body.splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "route.health" and event["status"] == "ok":
                return float(sum(h["compute_ms_per_token"] for h in event["hops"]))
    raise RuntimeError(f"generation {gid} reported no route health")


def run() -> Section:
    threads = max(1, CORES // 3)
    legs = len(LAYOUT) + 1  # one one-way leg per seam, and the leg back to the gateway
    section = Section(
        "WAN links: 3 seams at 20 ms round trip, speculative decoding off and on",
        f"python benchmarks/run.py --only wan  (3 llama.cpp nodes, {threads} thread(s) each, each behind a "
        f"user-space delay proxy adding {ONE_WAY_S * 1000:.0f} ms each way; {TOKENS} greedy tokens of a "
        f"copy-heavy request, median of {ROUNDS} alternating rounds)",
    )
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        nodes = []
        for layers in LAYOUT:
            port = _free_port()
            proxy = stack.enter_context(delay_proxy(port, ONE_WAY_S))
            nodes.append(["--layers", layers, "--threads", str(threads), "--port", str(port),
                          "--public-url", f"http://127.0.0.1:{proxy.port}"])  # fmt: skip
        gateways, model = two_gateway_swarm(stack, tmp, nodes)
        ms: dict[str, list[float]] = {"off": [], "ngram": []}
        compute: list[float] = []
        texts: dict[str, set[str]] = {"off": set(), "ngram": set()}
        kept = (0, 0)
        for i in range(ROUNDS + 1):  # the first round warms both gateways' route costs up
            for mode, url in gateways.items():
                gid = f"wan-{mode}-{i}-{time.time_ns()}"
                text, times, final = stream_text(url, model, COPY_PROMPT, TOKENS, gid, timeout_s=600)
                if i == 0:
                    continue
                ms[mode].append(1000 * (times[-1] - times[0]) / (final["completion_tokens"] - 1))
                texts[mode].add(text)
                if mode == "off":
                    compute.append(_compute_ms(url, gid))
                else:
                    kept = (final["speculation"]["accepted_tokens"], final["speculation"]["drafted_tokens"])
    off, on, work = median(ms["off"]), median(ms["ngram"]), median(compute)
    floor = work + legs * ONE_WAY_S * 1000
    same = texts["off"] == texts["ngram"] and len(texts["off"]) == 1
    section.add("route compute per token (all hops)", f"{work:.1f} ms")
    section.add(f"floor: compute + {legs} one-way legs", f"{floor:.1f} ms/token")
    section.add("speculative off", f"{off:.1f} ms/token ({1000 / off:.1f} tok/s)")
    section.add("off ÷ floor", f"{off / floor:.2f}", "≤ 1.10", off / floor <= 1.10)
    section.add("speculative ngram", f"{on:.1f} ms/token ({1000 / on:.1f} tok/s; {kept[0]}/{kept[1]} drafts kept)")
    section.add("ngram ÷ off, tokens/s", f"{off / on:.2f}", "≥ 2", off / on >= 2)
    section.add("greedy text identical", "yes" if same else "no", "yes", same)
    section.notes.append(
        f"Where the time goes without drafts: every answer walks back through every hop, so a plain step pays "
        f"{2 * len(LAYOUT)} one-way legs ({2 * len(LAYOUT) * ONE_WAY_S * 1000:.0f} ms) where the floor counts {legs}; "
        "the rest is compute and per-hop HTTP. Sending the token from the tail straight to the gateway "
        "(issue: direct return) would remove the difference."
    )
    return section
