"""Routes over emulated WAN links: a sweep of 5, 20 and 50 ms round trip per seam x 3 and 5 seams.

Each node is a llama.cpp process reachable only through a user-space delay proxy (``tests/wan.py``:
half the round trip each way, every byte) and advertised at it (``--public-url``): the gateway
reaches the head, each node the next one over one emulated link each, and the tail's token comes
back to the gateway over the tail's link. 3 seams: three nodes of the bundled 30-layer model
(``0:10``, ``10:20``, ``20:30``); 5 seams: five nodes of 6 layers each. The nodes and their proxies
are started once per cell (round trip x seams), and stopped before the next.

The gateways of a cell, measured in alternating rounds, each on an open-ended prompt (its text
copies nothing) and a copy-heavy one (rewrite a given text), greedy:

- ``off``: the decode channel without drafts (autoregressive), the tail relaying each plain step's
  next step to the head itself (the default, ``--relay on``);
- ``no-relay``: the same with ``--relay off`` (the gateway sends every step), only in the 20 ms x
  3 seams cell;
- ``ngram``: the decode channel with prompt-lookup drafts, verify rounds pipelined (the default);
- ``ngram-sync``: the same with ``--pipeline-rounds 1`` (one verify round in flight at a time);
- ``http``: HTTP per hop, no drafts (``--decode-channel off``, every answer walks back through
  every hop), the old baseline, only in the 20 ms x 3 seams cell (it is slow).

The floor a route could reach per token: the nodes' own compute (``compute_ms_per_token`` from the
route's telemetry) + the round trip the token's loop through the route pays: with the tail relaying,
one one-way leg per seam (head → … → tail → head); without, one more (tail → gateway → head).
``MESHNET_WAN_QUICK=1`` runs only the 5 ms x 3 seams cell,
briefly (a smoke test of the harness, not a measurement).

A real model's cell, where both are in the model cache (``tests/fetch_real_models.py``): Qwen2.5-Coder
1.5B over 3 seams x 20 ms (``0:10``, ``10:19``, ``19:28``, one thread each), gateways ``off``,
``ngram`` and ``draft`` (``--speculative draft`` with Qwen2.5-Coder 0.5B, the same vocabulary, as the
draft model at the gateway), on a code prompt and an open-ended story: whether speculation pays on
a real pair, and that it never makes decode slower where it does not.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tests.realmodels import MODELS, cache_dir
from tests.wan import delay_proxy

from benchmarks.bench_real import PROMPT as CODE_PROMPT
from benchmarks.bench_serve import DECODE_PROMPT, stream_text
from benchmarks.bench_speculative import COPY_PROMPT, gateway_swarm
from benchmarks.common import Section, median, route_compute_ms
from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.shard_file import write_shard
from meshnet.backends.llama_shard import MAX_VERIFY, LlamaShard, LlamaShardConfig
from meshnet.backends.shard import verify_chunk
from meshnet.ids import SessionId

CORES = os.cpu_count() or 2
RTTS_MS = (5, 20, 50)  # round trip per seam
LAYOUTS = {  # seams: the nodes' layer ranges of the bundled 30-layer model
    3: ("0:10", "10:20", "20:30"),
    5: tuple(f"{start}:{start + 6}" for start in range(0, 30, 6)),
}
BASELINE = (20, 3)  # (ms round trip, seams): the cell the goals are for, and the only one with HTTP per hop
TOKENS = 48
ROUNDS = 2  # measured rounds per cell (after one warm-up round)
# the goal cell: longer generations (pipelined rounds fill up once a generation's drafts are being kept)
BASELINE_TOKENS, BASELINE_ROUNDS = 96, 3
QUICK_CELL, QUICK_TOKENS, QUICK_ROUNDS = (5, 3), 16, 1  # MESHNET_WAN_QUICK=1: (ms round trip, seams)
PROMPTS = {"open-ended": DECODE_PROMPT, "copy-heavy": COPY_PROMPT}
PIPELINE_FLAG = "--pipeline-rounds"
GATEWAYS = {  # name: gateway flags
    "off": ("--speculative", "off"),
    "no-relay": ("--speculative", "off", "--relay", "off"),
    "ngram": ("--speculative", "ngram"),
    "ngram-sync": ("--speculative", "ngram", PIPELINE_FLAG, "1"),
    "http": ("--speculative", "off", "--decode-channel", "off"),
}
GOALS = {"autoregressive": 1.05, "open-ended": 2.0, "copy-heavy": 6.0}  # for the BASELINE cell
# The real model's cell: target, draft model, the target's layer ranges (one node each), its prompts
REAL_TARGET, REAL_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
REAL_LAYOUT = ("0:10", "10:19", "19:28")
REAL_RTT_MS, REAL_TOKENS, REAL_ROUNDS = 20, 48, 3
REAL_PROMPTS = {"code": CODE_PROMPT, "open-ended": DECODE_PROMPT}
NEVER_SLOWER = 0.95  # speculation ÷ off where drafting does not pay: 1.0 within this machine's noise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measured_leg_ms(one_way_s: float, samples: int = 40) -> float:
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
            delay_proxy(server.getsockname()[1], one_way_s) as proxy,
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


@dataclass(frozen=True)
class Cell:
    rtt_ms: int
    seams: int
    tokens: int
    rounds: int
    gateways: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.seams} seams x {self.rtt_ms} ms"

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000


@dataclass
class Measured:
    leg_ms: float  # one one-way leg through a delay proxy, measured before the cell's nodes started
    ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (gateway, prompt): ms/token per round
    compute: list[float] = field(default_factory=list)  # route compute per token of the `off` runs
    kept: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (gateway, prompt): [accepted, drafted]
    texts: dict[str, set[str]] = field(default_factory=dict)  # prompt: the greedy texts of every gateway


def measure(
    cell: Cell,
    threads: int,
    *,
    layout: Sequence[str] | None = None,
    model_args: Sequence[str] = (),
    node_args: Sequence[str] = (),
    gateways: Mapping[str, Sequence[str]] | None = None,
    prompts: Mapping[str, str] = PROMPTS,
) -> Measured:
    """Start the cell's nodes behind their proxies and its gateways, and measure them in alternating rounds
    (the first round warms every gateway's route up and is not counted); every process is stopped after.
    By default the bundled model in ``LAYOUTS``; else ``layout`` of the model ``model_args`` name (to
    nodes and gateways), ``gateways`` by name with their own flags, on ``prompts``; ``node_args`` go to
    every node (``--gpu-layers all``: benchmarks/device_check.py)."""
    measured = Measured(_measured_leg_ms(cell.one_way_s))  # before any node runs: the proxy on an idle machine
    flags = gateways or {name: GATEWAYS[name] for name in cell.gateways}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        nodes = []
        for layers in layout or LAYOUTS[cell.seams]:
            port = _free_port()
            proxy = stack.enter_context(delay_proxy(port, cell.one_way_s))
            nodes.append([*model_args, *node_args, "--layers", layers, "--threads", str(threads), "--port", str(port),
                          "--public-url", f"http://127.0.0.1:{proxy.port}"])  # fmt: skip
        urls, model = gateway_swarm(stack, tmp, nodes, {name: (*model_args, *f) for name, f in flags.items()})
        for i in range(cell.rounds + 1):
            for kind, prompt in prompts.items():
                for mode, url in urls.items():
                    gid = f"wan-{cell.rtt_ms}-{cell.seams}-{mode}-{kind}-{i}-{time.time_ns()}"
                    text, times, final = stream_text(url, model, prompt, cell.tokens, gid, timeout_s=600)
                    if i == 0:
                        continue
                    tokens = final["completion_tokens"]
                    measured.ms.setdefault((mode, kind), []).append(1000 * (times[-1] - times[0]) / (tokens - 1))
                    measured.texts.setdefault(kind, set()).add(text)
                    if mode == "off":
                        measured.compute.append(route_compute_ms(url, gid))
                    spec = final["speculation"]
                    kept = measured.kept.setdefault((mode, kind), [0, 0])
                    kept[0] += spec["accepted_tokens"]
                    kept[1] += spec["drafted_tokens"]
    return measured


def report(section: Section, cell: Cell, m: Measured) -> None:
    """The cell's rows: autoregressive against the floor, then speculation against autoregressive per prompt."""
    goals = (cell.rtt_ms, cell.seams) == BASELINE
    off = median([v for kind in PROMPTS for v in m.ms[("off", kind)]])
    work = median(m.compute)
    legs = cell.seams  # the token's loop with the tail relaying: head → … → tail → head, one leg per seam
    floor = work + legs * cell.rtt_ms / 2
    real_floor = work + legs * m.leg_ms
    at = f"{cell.label}:"
    section.add(f"{at} autoregressive (decode channel, no drafts)", f"{off:.1f} ms/token ({1000 / off:.1f} tok/s)")
    section.add(
        f"{at} floor: compute + {legs} one-way legs",
        f"{floor:.1f} ms/token ({work:.1f} compute + {legs} x {cell.rtt_ms / 2:g} ms)",
    )
    goal = GOALS["autoregressive"]
    section.add(
        f"{at} autoregressive ÷ floor",
        f"{off / floor:.2f} (÷ floor with the measured leg, {m.leg_ms:.2f} ms: {off / real_floor:.2f})",
        f"≤ {goal:g}" if goals else "",
        off / floor <= goal if goals else None,
    )
    if "no-relay" in cell.gateways:
        plain = median([v for kind in PROMPTS for v in m.ms[("no-relay", kind)]])
        loop = work + (legs + 1) * cell.rtt_ms / 2  # one leg more: tail → gateway → head
        section.add(f"{at} autoregressive, --relay off (the gateway sends every step)", f"{plain:.1f} ms/token")
        section.add(f"{at} --relay off ÷ its floor (compute + {legs + 1} one-way legs)", f"{plain / loop:.2f}")
        section.add(f"{at} relay on ÷ off, tokens/s", f"{plain / off:.2f}")
        section.add(
            f"{at} autoregressive ÷ (Σ compute + Σ RTT), the floor as the issue words it",
            f"{off / (work + cell.seams * cell.rtt_ms):.2f}",
        )
    if "http" in cell.gateways:
        http = median([v for kind in PROMPTS for v in m.ms[("http", kind)]])
        section.add(f"{at} HTTP per hop, no drafts (--decode-channel off)", f"{http:.1f} ms/token")
        section.add(f"{at} HTTP per hop ÷ floor", f"{http / floor:.2f}")
        section.add(f"{at} decode channel ÷ HTTP per hop, tokens/s", f"{http / off:.2f}")
    for kind in PROMPTS:
        base = median(m.ms[("off", kind)])
        for mode in ("ngram", "ngram-sync"):
            if mode not in cell.gateways:
                continue
            ratio = base / median(m.ms[(mode, kind)])
            accepted, drafted = m.kept[(mode, kind)]
            goal = GOALS[kind]
            met = goals and mode == "ngram"
            section.add(
                f"{at} {kind}, {mode} ÷ off, tokens/s",
                f"{ratio:.2f} ({accepted}/{drafted} drafts kept)",
                f"≥ {goal:g}" if met else "",
                ratio >= goal if met else None,
            )
    same = all(len(texts) == 1 for texts in m.texts.values())
    section.add(f"{at} greedy text identical (every gateway, each prompt)", "yes" if same else "no", "yes", same)


def run() -> Section:
    quick = os.environ.get("MESHNET_WAN_QUICK") == "1"
    tokens = QUICK_TOKENS if quick else TOKENS
    rounds = QUICK_ROUNDS if quick else ROUNDS
    cells = []
    for seams in LAYOUTS:
        for rtt in RTTS_MS:
            if quick and (rtt, seams) != QUICK_CELL:
                continue
            baseline = (rtt, seams) == BASELINE
            names = ("off", "ngram", "ngram-sync", *(("no-relay", "http") if baseline else ()))
            long = baseline and not quick
            cells.append(Cell(rtt, seams, BASELINE_TOKENS if long else tokens, BASELINE_ROUNDS if long else rounds,
                              names))  # fmt: skip
    section = Section(
        "WAN links: 3 and 5 seams at 5, 20 and 50 ms round trip; autoregressive vs the floor, speculative decoding "
        "on open-ended and copy-heavy text" + (" (quick smoke run, not a measurement)" if quick else ""),
        f"{'MESHNET_WAN_QUICK=1 ' if quick else ''}python benchmarks/run.py --only wan  (per cell: one llama.cpp "
        f"node per seam, threads cores ÷ nodes (at least 1), each behind a user-space delay proxy adding half "
        f"the round trip each way; gateways off, ngram and ngram-sync (--pipeline-rounds 1), and off with --relay "
        f"off and HTTP per hop in the {BASELINE[1]} seams x {BASELINE[0]} ms cell; {tokens} greedy tokens of an "
        f"open-ended and of a copy-heavy request, median of {rounds} alternating rounds"
        f"{'' if quick else f' ({BASELINE_TOKENS} tokens, {BASELINE_ROUNDS} rounds in that cell)'} after a warm-up "
        "round)",
    )
    chunk_ratio = _chunk_cost()  # before the cells start their nodes: alone on the machine
    for cell in cells:
        threads = max(1, CORES // cell.seams)
        report(section, cell, measure(cell, threads))
    section.add(
        f"a {MAX_VERIFY + 1}-position verify chunk ÷ a one-position step, compute (layers 10:20, 1 thread)",
        f"{chunk_ratio:.1f}",
    )
    section.notes.append(
        "Floor: the route's compute per token plus the round trip the token's loop pays. With the tail relaying "
        "each plain step's next step to the head (the default), the loop is head → … → tail → head: one one-way "
        "leg per seam. With --relay off the token goes tail → gateway → head: one leg more (that gateway's floor). "
        "A full round trip per seam (Σ RTT taken literally, as the issue words the floor) is what HTTP per hop "
        "pays; the decode channel walks each seam one way only, so that would be no floor for it, and its row is "
        "there only for the issue's wording. What is left above the floor: the delay proxy's own cost per leg "
        "(the measured leg, on the idle machine) and each hop's and the gateway's own work per token (`route` "
        "measures it per hop on loopback)."
    )
    section.notes.append(
        "Speculation ÷ off is the tokens/s ratio of the same prompt in the same cell; drafts kept are summed over "
        "the measured rounds. An open-ended text copies little of itself, so prompt-lookup drafts are rarely "
        "kept there; copy-heavy text is where they are. What bounds copy-heavy: its first tokens (the answer's own "
        "opening) copy nothing and go one walk each, and on this CPU a verify chunk costs the bundled model nearly "
        "as much compute per position as a step (the chunk row: llama.cpp's CPU kernels for its Q4_1 weights gain "
        "little from more rows), so once four full rounds are in flight the route is compute-bound, the walks all "
        "hidden: a generation of 96 tokens spends a large part of its time before that."
    )
    if not quick:
        real_cell(section)  # its rows and note last
    return section


def _chunk_cost(repeats: int = 10) -> float:
    """Compute of a full verify chunk (``MAX_VERIFY`` drafts and the step's own token) ÷ a one-position
    step's, on the middle third of the bundled model at one thread, after 128 positions of context."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "middle.gguf"
        write_shard(bundled_gguf(), "10:20", path)
        shard = LlamaShard(path, config=LlamaShardConfig(n_ctx=1024, max_sessions=1, n_threads=1))
        try:
            sid = SessionId("chunk-cost")
            shard.open_session(sid)
            width = shard.info.seam.shape[-1]
            rows = np.random.default_rng(0).standard_normal((128 + MAX_VERIFY + 1, width)).astype(np.float32)
            shard.prefill(sid, 0, hidden=rows[:128])
            took = {}
            for n in (1, MAX_VERIFY + 1):
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    verify_chunk(shard, sid, 128, hidden=rows[128 : 128 + n])
                    times.append(time.perf_counter() - began)
                    shard.rewind(sid, 128)
                took[n] = median(times)
        finally:
            shard.close()
    return took[MAX_VERIFY + 1] / took[1]


def real_cell(section: Section) -> None:
    """The real model's cell (module docstring), where both models are in the cache; a row saying how
    to fetch them where they are not."""
    target, draft = (cache_dir() / MODELS[name].filename for name in (REAL_TARGET, REAL_DRAFT))
    at = f"real {REAL_TARGET}, 3 seams x {REAL_RTT_MS} ms:"
    if not (target.is_file() and draft.is_file()):
        section.add(f"{at} not measured", f"needs {REAL_TARGET} and {REAL_DRAFT}: python tests/fetch_real_models.py")
        return
    cell = Cell(REAL_RTT_MS, len(REAL_LAYOUT), REAL_TOKENS, REAL_ROUNDS, ("off", "ngram", "draft"))
    gateways = {
        "off": ("--speculative", "off"),
        "ngram": ("--speculative", "ngram"),
        "draft": ("--speculative", "draft", "--draft-gguf", str(draft)),
    }
    m = measure(cell, 1, layout=REAL_LAYOUT, model_args=("--gguf", str(target)), gateways=gateways,
                prompts=REAL_PROMPTS)  # fmt: skip
    report_real(section, at, m)


def report_real(section: Section, at: str, m: Measured) -> None:
    off = median([v for kind in REAL_PROMPTS for v in m.ms[("off", kind)]])
    section.add(f"{at} autoregressive", f"{off:.1f} ms/token ({median(m.compute):.1f} compute)")
    for kind in REAL_PROMPTS:
        base = median(m.ms[("off", kind)])
        for mode in ("ngram", "draft"):
            ratio = base / median(m.ms[(mode, kind)])
            accepted, drafted = m.kept[(mode, kind)]
            section.add(
                f"{at} {kind}, {mode} ÷ off, tokens/s",
                f"{ratio:.2f} ({accepted}/{drafted} drafts kept)",
                f"≥ {NEVER_SLOWER:g} (never slower)",
                ratio >= NEVER_SLOWER,
            )
    same = all(len(texts) == 1 for texts in m.texts.values())
    section.add(f"{at} greedy text identical (every gateway, each prompt)", "yes" if same else "no", "yes", same)
    section.notes.append(
        f"The real cell: on a CPU a {REAL_DRAFT} draft token costs the gateway a large part of a {REAL_TARGET} "
        "step (a third of its weights, on one core against one per node), and a verify chunk costs nearly its "
        "positions' steps: drafting pays only where a walk is mostly links. The gateway measures what its draft "
        "model's drafts cost and what the route's chunks cost, and drafts only where the expected tokens per "
        "second beat a plain step (a re-probe now and then); where they do not, the route decodes as without "
        "speculation."
    )
