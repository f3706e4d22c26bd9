"""The networked route (`meshnet up`, 3 llama.cpp node processes) vs `meshnet serve`, over HTTP.

A second gateway on the same nodes sends decode steps as HTTP requests per hop
(``--decode-channel off``), a third sends every step itself (``--relay off``: the tail relays
none), measured in alternating rounds with the default: the per-hop overhead of each is measured
against the nodes' own compute.

Both run on this machine at once but are measured one after the other (idle llama.cpp threads
sleep), alternating rounds so drift hits both. Decode tok/s is measured the same way as in
bench_serve: (chunks - 1) / (last chunk - first chunk) of a greedy stream.
"""

from __future__ import annotations

import os
import tempfile
import time

import httpx
import numpy as np
from tests.procs import meshnet_process, tracker_url

from benchmarks.bench_serve import DECODE_PROMPT, _rate, _stream
from benchmarks.common import Section, median, route_compute_ms
from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.gguf_header import read_header
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.protocol.channel import decode_frame, read_step, step_frame
from meshnet.protocol.messages import HopEntry, HopRequest, Payload, TokenAnswer, Verb, answer_from_json
from meshnet.protocol.signing import HopKey, check_signatures
from meshnet.protocol.wire import encode_tensor
from meshnet.routes import Hop
from meshnet.sampling import Sampler, SamplingParams, _log_z, check_draw

CORES = os.cpu_count() or 2
CTX = 4096
DECODE_TOKENS = 128
ROUNDS = 4
SECURITY_PAIRS = 16  # security on ÷ off is a ~5% question: paired back-to-back streams, median of their ratios
LONG_PROMPT = " ".join(f"Fact {i}: the sky is blue and the grass is green." for i in range(150))  # ~2K tokens


def _seam_bytes(node_urls: list[str]) -> list[float]:
    out = []
    for url in node_urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("meshnet_node_seam_bytes_total "):
                out.append(float(line.split()[1]))
    return out


def _decode_steps_bytes(url: str, model: str, nodes: list[str], context: int) -> list[float]:
    """Seam body bytes per decode step sent by each non-tail node, at a context of about ``context``."""
    prompt = " ".join(["word"] * max(1, context - 2))
    steps = 32
    before = _seam_bytes(nodes)
    _, final = _stream(url, model, prompt, steps + 1)  # the first token comes from prefill
    after = _seam_bytes(nodes)
    prefill = final["prompt_tokens"] * 576 * 4  # float32 activations of the whole prompt
    return [(a - b - prefill) / steps for a, b in zip(after[:-1], before[:-1], strict=True)]


def _hop_times(node_urls: list[str]) -> list[tuple[float, float, float]]:
    """Each node's decode steps, their compute seconds and their seconds on the hop, so far."""
    names = ("meshnet_node_decode_steps_total", "meshnet_node_decode_compute_seconds_total",
             "meshnet_node_decode_handle_seconds_total")  # fmt: skip
    out = []
    for url in node_urls:
        values = dict.fromkeys(names, 0.0)
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name in values:
                values[name] = float(value)
        steps, compute, handle = (values[n] for n in names)
        out.append((steps, compute, handle))
    return out


def _overhead_ms(url: str, model: str, hops: int) -> tuple[float, float]:
    """(ms per decoded token, per-hop overhead in ms = (step - the hops' own compute) ÷ hops)."""
    gid = f"overhead-{time.time_ns()}"
    times, _ = _stream(url, model, DECODE_PROMPT, DECODE_TOKENS, gid)
    step = 1000 / _rate(times)
    return step, (step - route_compute_ms(url, gid)) / hops


def _signing_ms(hops: int, repeats: int = 2000) -> float:
    """What signed entries add to one decode step of a ``hops``-hop route, in ms of CPU: every hop
    signs its entry (the tail over its token too; over the decode channel the others only once the
    step has gone on: off the token's path), and the gateway checks the tail's (the others' once, at
    the end: protocol.signing ``tail_only``), on an answer parsed from the JSON a route sends."""
    keys = [HopKey.generate() for _ in range(hops)]
    route = tuple(Hop(f"n{i}", f"http://n{i}", LayerRange(i, i + 1, hops), key=k.public) for i, k in enumerate(keys))

    def entry(i: int) -> HopEntry:
        return HopEntry(f"n{i}", f"{i}:{i + 1}", 7.931, 1234, "0c1f" * 8, None if i == hops - 1 else "9a3e" * 8, 1)

    def step() -> TokenAnswer:
        *before, tail = keys
        signed = [k.sign("sess", entry(i)) for i, k in enumerate(before)]
        answer = TokenAnswer((tail.sign("sess", entry(hops - 1)),), position=1235, token=4242, logprob=-0.1734)
        return tail.sign_answer("sess", answer).after(*signed)

    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        answer = answer_from_json(200, step().to_json())
        check_signatures("sess", route, answer, tail_only=True)
        times.append(time.perf_counter() - began)
    signing = median(times)
    plain = []  # the same without signing or checking: building and parsing the answer
    for _ in range(repeats):
        began = time.perf_counter()
        answer = TokenAnswer(tuple(entry(i) for i in range(hops)), position=1235, token=4242, logprob=-0.1734)
        answer_from_json(200, answer.to_json())
        plain.append(time.perf_counter() - began)
    return 1000 * max(0.0, signing - median(plain))


def _cold_parse_us(repeats: int = 200) -> tuple[float, float, float]:
    """A middle hop's reading of a decode step's ``STEP`` frame (frame, header, request), in µs: in a
    warm loop, right after streaming 64 MiB through the caches (as a shard call does: the bundled
    model's 10 layers are ~25 MiB of weights), and after 10 ms asleep (the hop between two steps)."""
    values = np.zeros((1, 1, 576), dtype=np.float32)
    request = HopRequest(Verb.DECODE, SessionId("ses-93d3d8237cecfc0f239081fb"), 40, 1,
                         Payload(encode_tensor(values, "float32")), model="SmolLM2-135M-Instruct.Q4_1",
                         route_id="rte-deadb9cba43845c8bf5f1021")  # fmt: skip
    data = step_frame(request, 7, ["H9BDZ4L3einVFBHU0dpexA"])
    flood = np.ones(64 << 20, dtype=np.uint8)

    def read() -> float:
        began = time.perf_counter()
        read_step(decode_frame(data)).request(1 << 26)
        return 1e6 * (time.perf_counter() - began)

    warm = [read() for _ in range(repeats)]
    flooded, slept = [], []
    for _ in range(repeats // 2):
        flood.sum()
        flooded.append(read())
        time.sleep(0.01)
        slept.append(read())
    return median(warm), median(flooded), median(slept)


def _draw_ms(vocab: int, repeats: int = 300) -> float:
    """What committing to its draw adds to a greedy tail's sampling of one token over ``vocab``
    logits (the top 20 and their probabilities: sampling.Draw), plus the gateway's re-derivation, in ms."""
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32) * 3
    sampler = Sampler(SamplingParams(temperature=0.0, seed=1))
    committed, plain = [], []
    for i in range(repeats):
        began = time.perf_counter()
        token, _, draw = sampler.sample_committed(logits, i)
        check_draw(sampler.params, draw, token, i)
        committed.append(time.perf_counter() - began)
        began = time.perf_counter()
        token = int(np.argmax(logits))  # what greedy sampling did without a commitment: argmax and logprob
        float(logits[token]) - _log_z(logits)
        plain.append(time.perf_counter() - began)
    return 1000 * max(0.0, median(committed) - median(plain))


def run() -> Section:
    threads_per_node = max(1, CORES // 3)
    section = Section(
        "Networked route: `meshnet up` (3 llama.cpp nodes) vs `meshnet serve`, both over HTTP",
        f"python benchmarks/run.py --only route  (serve: {CORES} threads; `meshnet up` as it runs by default: a "
        f"private swarm (mutual TLS, route tickets), the cores split between the nodes ({threads_per_node} "
        f"thread(s) each); beside it the same with --no-tls, and --no-tls --core-lease ({CORES} threads per node, "
        f"one computing at a time); float32 seams on loopback; ctx {CTX}, {DECODE_TOKENS} greedy tokens, median "
        f"of {ROUNDS})",
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory() as tmp_plain,
        tempfile.TemporaryDirectory() as tmp_split,
    ):
        serve_args = ["serve", "--port", "0", "--threads", str(CORES), "--ctx", str(CTX)]
        # plain decoding (drafts would change the bytes and the work per step); the decode channel is the default
        up_args = ["up", "--port", "0", "--nodes", "3", "--ctx", str(CTX), "--speculative", "off"]
        with (
            meshnet_process(serve_args) as serve,
            meshnet_process([*up_args, "--workdir", tmp], ready_timeout_s=300) as swarm,
            meshnet_process([*up_args, "--workdir", tmp_plain, "--no-tls"], ready_timeout_s=300) as plain,
            meshnet_process([*up_args, "--workdir", tmp_split, "--no-tls", "--core-lease"], ready_timeout_s=300)
            as split,
            meshnet_process(
                ["gateway", "--tracker", tracker_url(plain), "--port", "0", "--speculative", "off",
                 "--decode-channel", "off"]
            ) as http_gateway,
            meshnet_process(
                ["gateway", "--tracker", tracker_url(plain), "--port", "0", "--speculative", "off", "--relay", "off"]
            ) as gateway_sends,
        ):  # fmt: skip
            urls = {"serve": serve.url, "route": swarm.url, "plain": plain.url, "split": split.url}
            model = httpx.get(f"{serve.url}/v1/models", timeout=10).json()["data"][0]["id"]
            view = httpx.get(f"{plain.url}/v1/swarm", timeout=30).json()["nodes"]
            nodes = [n["url"] for n in sorted(view, key=lambda n: int(n["layers"].split(":")[0]))]
            for url in (*urls.values(), http_gateway.url, gateway_sends.url):
                _stream(url, model, "warm up", 8)
            overhead: dict[str, list[tuple[float, float]]] = {"channel": [], "http": [], "tls": [], "sends": []}
            spent = [(0.0, 0.0, 0.0)] * len(nodes)  # the nodes' decode counters over the default gateway's rounds
            for r in range(ROUNDS):  # it and the same nodes' gateway that relays nothing, alternating
                for name in ("channel", "sends") if r % 2 == 0 else ("sends", "channel"):
                    before = _hop_times(nodes)
                    overhead[name].append(_overhead_ms(plain.url if name == "channel" else gateway_sends.url, model, 3))
                    if name == "channel":
                        after = _hop_times(nodes)
                        spent = [tuple(t + a - b for t, a, b in zip(total, x, y, strict=True))
                                 for total, x, y in zip(spent, after, before, strict=True)]  # fmt: skip
            for _ in range(ROUNDS):
                overhead["http"].append(_overhead_ms(http_gateway.url, model, 3))
                overhead["tls"].append(_overhead_ms(swarm.url, model, 3))
            decode: dict[str, list[float]] = {name: [] for name in urls}
            prefill: dict[str, list[float]] = {name: [] for name in urls}
            order = list(urls.items())
            for r in range(ROUNDS):
                # each round starts with another setup: none is always the one measured right after serve
                for name, url in order[r % len(order) :] + order[: r % len(order)]:
                    times, _ = _stream(url, model, DECODE_PROMPT, DECODE_TOKENS)
                    decode[name].append(_rate(times))
                    # a prompt no node has cached (its first block differs): a cold prefill, not a prefix cache hit
                    _, final = _stream(url, model, f"Round {r}, {name}. {LONG_PROMPT}", 1)
                    prefill[name].append(final["prompt_tokens"] / final["prefill_seconds"])
                    long_tokens = final["prompt_tokens"]
            pair_ratios = []
            for r in range(SECURITY_PAIRS):
                pair = {}
                for name in ("route", "plain") if r % 2 == 0 else ("plain", "route"):
                    times, _ = _stream(urls[name], model, DECODE_PROMPT, DECODE_TOKENS)
                    pair[name] = _rate(times)
                pair_ratios.append(pair["route"] / pair["plain"])
            seam_100 = _decode_steps_bytes(plain.url, model, nodes, 100)
            seam_2000 = _decode_steps_bytes(plain.url, model, nodes, 2000)
    rate = {name: median(values) for name, values in decode.items()}
    fill = {name: median(values) for name, values in prefill.items()}
    d_ratio, p_ratio = rate["route"] / rate["serve"], fill["route"] / fill["serve"]
    section.add("serve decode", f"{rate['serve']:.1f} tok/s")
    section.add("route decode (meshnet up's default: private swarm)", f"{rate['route']:.1f} tok/s")
    section.add("route ÷ serve decode", f"{d_ratio:.3f}", "≥ 0.85", d_ratio >= 0.85)
    section.add("route decode, --no-tls", f"{rate['plain']:.1f} tok/s")
    security = median(pair_ratios)
    section.add(
        f"security on ÷ off, decode (TLS and tickets ÷ --no-tls; median of {SECURITY_PAIRS} back-to-back pairs)",
        f"{security:.3f}", "≥ 0.95", security >= 0.95,
    )  # fmt: skip
    shown = ", ".join(f"{x:.2f}" for x in sorted(pair_ratios))
    section.add("security on ÷ off, each pair (sorted)", shown)
    vocab = read_header(bundled_gguf()).fields["tokenizer.ggml.tokens"].count  # what the route's tail samples over
    signing_ms, draw_ms, step_ms = _signing_ms(3), _draw_ms(vocab), 1000 / rate["route"]
    section.add(
        "signed entries: signing (3 hops) + the gateway's check of the tail's, per decode step", f"{signing_ms:.3f} ms"
    )
    section.add(f"committed draw: the tail's top 20 + the gateway's check ({vocab} logits)", f"{draw_ms:.3f} ms")
    warm_us, flooded_us, slept_us = _cold_parse_us()
    section.add("a hop reading a STEP frame: warm / after 64 MiB through the caches / after 10 ms asleep",
                f"{warm_us:.0f} / {flooded_us:.0f} / {slept_us:.0f} µs")  # fmt: skip
    signed_ratio = (step_ms - signing_ms - draw_ms) / step_ms  # with ÷ without, at the measured route step
    label = "decode with signing and sampling verification ÷ without (their cost ÷ the step)"
    section.add(label, f"{signed_ratio:.4f}", "≥ 0.97", signed_ratio >= 0.97)
    section.add("route decode, --no-tls --core-lease", f"{rate['split']:.1f} tok/s")
    lease_gain = rate["split"] / rate["plain"]
    section.add("core lease ÷ cores split, decode (both --no-tls)", f"{lease_gain:.3f}")
    step = {k: median([s for s, _ in v]) for k, v in overhead.items()}
    per_hop = {k: median([h for _, h in v]) for k, v in overhead.items()}
    section.add("route step, HTTP per hop (--decode-channel off, --no-tls)", f"{step['http']:.2f} ms")
    section.add("route step, decode channel (--no-tls)", f"{step['channel']:.2f} ms")
    section.add("route step, decode channel over TLS", f"{step['tls']:.2f} ms")
    section.add("per-hop overhead, HTTP per hop", f"{per_hop['http']:.2f} ms")
    section.add("per-hop overhead, decode channel", f"{per_hop['channel']:.2f} ms", "≤ 0.5", per_hop["channel"] <= 0.5)
    section.add("per-hop overhead, decode channel over TLS", f"{per_hop['tls']:.2f} ms")
    section.add("route step, decode channel, --relay off (the gateway sends every step; --no-tls)",
                f"{step['sends']:.2f} ms")  # fmt: skip
    section.add("per-hop overhead, decode channel, --relay off", f"{per_hop['sends']:.2f} ms")
    # where a step's time goes (decode channel, --no-tls): each hop's compute and the rest of its time
    # (checks, bookkeeping, thread hand-offs, encoding, the send), then the legs between them
    computes = [1000 * c / n for n, c, _ in spent]
    glues = [1000 * (h - c) / n for n, c, h in spent]
    on_hops = sum(1000 * h / n for n, _, h in spent)
    legs = (step["channel"] - on_hops) / len(spent)  # the tail relays: head → middle → tail → head
    shown = ", ".join(f"{c:.2f}" for c in computes)
    section.add("per hop (head, middle, tail): compute per step", f"{shown} ms")
    shown = ", ".join(f"{g:.2f}" for g in glues)
    section.add("per hop (head, middle, tail): the rest of its time per step", f"{shown} ms")
    section.add("per leg (2 seams, and tail→head: the tail relays the next step), the relay's send included",
                f"{legs:.2f} ms")  # fmt: skip
    section.add(f"serve prefill ({long_tokens}-token prompt)", f"{fill['serve']:.1f} tok/s")
    section.add("route prefill (pipelined 128-token chunks)", f"{fill['route']:.1f} tok/s")
    section.add("route ÷ serve prefill", f"{p_ratio:.3f}", "≥ 0.9", p_ratio >= 0.9)
    section.add("route prefill, --no-tls / --no-tls --core-lease", f"{fill['plain']:.1f} / {fill['split']:.1f} tok/s")
    hidden_bytes = 576 * 4
    for label, values in (("100", seam_100), ("2,000", seam_2000)):
        shown = ", ".join(f"{v:.0f}" for v in values)
        section.add(f"seam body bytes per decode step at context {label} (head, middle)", shown, f"= {hidden_bytes}")
    equal = all(abs(a - b) < 1 for a, b in zip(seam_100, seam_2000, strict=True))
    section.add("seam bytes independent of context", "yes" if equal else "no", "equal", equal)
    section.notes.append(
        "Per-hop overhead = (ms per decoded token - the route's own compute per token, summed over its hops "
        "from the route.health telemetry) ÷ 3 hops; the gateways run on the same nodes, one after the other. A hop's "
        "compute is its shard call's own time: hand-offs to and from a worker thread count as overhead (results "
        "before 2026-12-04 counted them as compute)."
    )
    section.notes.append(
        "Where the time goes: each node counts, for every decode step, its shard compute and its whole time on the "
        "hop (from the request's arrival to the step leaving it; Prometheus meshnet_node_decode_*); a leg is what "
        "is left of the step, shared by the 3 legs of the token's loop (the tail relays each plain step's next step "
        "to the head; the gateway's own work for the token runs beside it): framing, the loopback socket, process "
        "wake-ups on 2 cores, and the tail's send of the relayed step and of the token. A hop's time ends when its "
        "send returns, and on 2 cores the next hop has often begun by then (the write wakes it on the other core): "
        "a leg's share within a few tenths of a millisecond of zero, either side, is a leg that costs about nothing "
        "beyond the hops' own time."
    )
    section.notes.append(
        "Why a hop's own work costs this much: Python on a hop runs with cold caches. Its shard call streams the "
        "layers' weights through every cache level, and between two steps the hop sleeps while the others compute "
        "(on this VM a vCPU that sleeps 10 ms loses its caches too): the row 'a hop reading a STEP frame' measures "
        "the same code warm and cold. So what a hop saves is code and data it does not touch per step: over the "
        "decode channel a hop before the tail records the step (its ledger and seam log, ~0.05 ms cold) and signs "
        "its entry (an Ed25519 signature and its JSON, ~0.2 ms cold) only once the step has gone on, and sends it "
        "to the gateway itself (ENTRY frames, docs/protocol.md); the tail records its step once the step after it "
        "is relayed."
    )
    section.notes.append(
        "Seam bytes: activation body bytes each node sent onward per decode step (its Prometheus counter); "
        "the tail sends none. Each hop request also carries ~300 bytes of HTTP headers."
    )
    return section
