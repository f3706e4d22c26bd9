"""A route over emulated WAN links (3 seams at 20 ms round trip): HTTP per hop vs the decode channel.

Three llama.cpp node processes, each reachable only through a user-space delay proxy
(``tests/wan.py``: 10 ms each way, every byte) and advertised at it (``--public-url``): the gateway
reaches the head, the head the middle and the middle the tail over one emulated link each (and the
tail's token comes back to the gateway over the tail's link). The gateways are measured in
alternating rounds on a copy-heavy request.

The floor a route could reach per token: the nodes' own compute (``compute_ms_per_token`` from the
route's telemetry) + one one-way leg per seam + the leg back to the gateway. Three gateways on the
swarm: HTTP per hop (``--decode-channel off``, every answer walks back through every hop), the
decode channel without drafts, and the decode channel with prompt-lookup drafts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time

from tests.wan import delay_proxy

from benchmarks.bench_serve import stream_text
from benchmarks.bench_speculative import COPY_PROMPT, gateway_swarm
from benchmarks.common import Section, median, route_compute_ms

CORES = os.cpu_count() or 2
ONE_WAY_S = 0.010  # 20 ms round trip per seam
TOKENS = 64
ROUNDS = 3
LAYOUT = ("0:10", "10:20", "20:30")
GATEWAYS = {  # name: gateway flags
    "http": ("--speculative", "off", "--decode-channel", "off"),
    "off": ("--speculative", "off"),
    "ngram": ("--speculative", "ngram"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measured_leg_ms(samples: int = 40) -> float:
    """One one-way leg through a delay proxy as it really is on this machine: half the median round
    trip of a small message to a loopback echo server behind one (the proxy's own cost included)."""

    def echo(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=echo, args=(server,), daemon=True)
        thread.start()
        with (
            delay_proxy(server.getsockname()[1], ONE_WAY_S) as proxy,
            socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client,
        ):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            trips = []
            for _ in range(samples):
                began = time.perf_counter()
                client.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    got += len(client.recv(4096))
                trips.append(time.perf_counter() - began)
        thread.join(10)
    return 1000 * median(trips) / 2


def run() -> Section:
    threads = max(1, CORES // 3)
    legs = len(LAYOUT) + 1  # one one-way leg per seam, and the leg back to the gateway
    section = Section(
        "WAN links: 3 seams at 20 ms round trip; HTTP per hop vs the decode channel, speculative decoding off and on",
        f"python benchmarks/run.py --only wan  (3 llama.cpp nodes, {threads} thread(s) each, each behind a "
        f"user-space delay proxy adding {ONE_WAY_S * 1000:.0f} ms each way; {TOKENS} greedy tokens of a "
        f"copy-heavy request, median of {ROUNDS} alternating rounds)",
    )
    leg = _measured_leg_ms()  # before any node runs: the proxy's cost on an idle machine
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        nodes = []
        for layers in LAYOUT:
            port = _free_port()
            proxy = stack.enter_context(delay_proxy(port, ONE_WAY_S))
            nodes.append(["--layers", layers, "--threads", str(threads), "--port", str(port),
                          "--public-url", f"http://127.0.0.1:{proxy.port}"])  # fmt: skip
        gateways, model = gateway_swarm(stack, tmp, nodes, GATEWAYS)
        ms: dict[str, list[float]] = {mode: [] for mode in GATEWAYS}
        compute: list[float] = []
        texts: dict[str, set[str]] = {mode: set() for mode in GATEWAYS}
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
                    compute.append(route_compute_ms(url, gid))
                elif mode == "ngram":
                    kept = (final["speculation"]["accepted_tokens"], final["speculation"]["drafted_tokens"])
    http, off, on, work = median(ms["http"]), median(ms["off"]), median(ms["ngram"]), median(compute)
    floor = work + legs * ONE_WAY_S * 1000
    same = len(set().union(*texts.values())) == 1
    section.add("route compute per token (all hops)", f"{work:.1f} ms")
    section.add(f"floor: compute + {legs} one-way legs", f"{floor:.1f} ms/token")
    section.add("baseline: no drafts, HTTP per hop (--decode-channel off)", f"{http:.1f} ms/token")
    section.add("HTTP per hop ÷ floor", f"{http / floor:.2f}")
    section.add("no drafts, decode channel", f"{off:.1f} ms/token ({1000 / off:.1f} tok/s)")
    section.add("decode channel ÷ floor", f"{off / floor:.2f}", "≤ 1.10", off / floor <= 1.10)
    section.add("decode channel ÷ HTTP per hop, tokens/s", f"{http / off:.2f}")
    real_floor = work + legs * leg
    section.add(
        f"one leg through the delay proxy, measured (nominal {ONE_WAY_S * 1000:.0f} ms)",
        f"{leg:.2f} ms; floor with measured legs {real_floor:.1f} ms, channel ÷ that {off / real_floor:.2f}",
    )
    section.add("speculative ngram", f"{on:.1f} ms/token ({1000 / on:.1f} tok/s; {kept[0]}/{kept[1]} drafts kept)")
    section.add("ngram ÷ off, tokens/s", f"{off / on:.2f}", "≥ 2", off / on >= 2)
    section.add("greedy text identical (all three)", "yes" if same else "no", "yes", same)
    section.notes.append(
        f"With HTTP per hop every answer walks back through every hop: a plain step pays {2 * len(LAYOUT) + 2} "
        f"one-way legs where the floor counts {legs}. On the decode channel the step goes one way through the "
        "route and the tail sends the token straight back to the gateway. What is left above the floor: the "
        "delay proxy's own cost per leg (measured above, on the idle machine) and each hop's glue (thread "
        "hand-offs; `route` measures it per hop on loopback)."
    )
    return section
