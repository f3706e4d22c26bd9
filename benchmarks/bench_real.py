"""A real pretrained model (Qwen2.5-Coder 1.5B, else 0.5B; ``tests/fetch_real_models.py`` fetches them):
memory of ``meshnet publish`` and of each node, route decode against ``meshnet serve``, and a cold swarm.

- publish: peak resident memory (``VmHWM`` of the process) ÷ the model's size;
- each node of ``meshnet up``: resident memory ÷ (the shard files it maps + its KV budget, i.e.
  KV bytes per token of its layers x ``--ctx`` x ``--max-sessions``);
- decode of a route whose nodes together run as many compute threads as ``serve`` (one per core);
- a cold swarm: the publication served by a web seed, a tracker, then ``--nodes`` nodes
  (``node --manifest URL --layers auto``, empty folders) and a gateway (``gateway --manifest URL``,
  which fetches only the vocabulary) started at once; the time from that start to the first streamed
  token of a chat, the slowest node's fetch apart (from its log), and each fetched node's peak
  resident memory ÷ (the files it fetched + its KV budget).
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from tests.procs import meshnet_peak_rss, meshnet_process, peak_rss, start_together, up_nodes
from tests.realmodels import MODELS, cache_dir

from benchmarks.common import Section, decode_rate, median, route_compute_ms, stream_completion, wait_registered
from meshnet.artifacts.fetch import PART_DIR
from meshnet.artifacts.gguf_header import read_header
from meshnet.artifacts.manifest import read_manifest
from meshnet.artifacts.plan import ModelShape, shape_from_fields
from meshnet.artifacts.shard_file import range_starts
from meshnet.artifacts.webseed import serve_directory
from meshnet.layers import LayerRange, split_layers

CANDIDATES = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
CTX, MAX_SESSIONS = 2048, 2
DECODE_TOKENS, REPEATS = 48, 3
INTERLEAVED_ROUNDS = 5  # serve at one thread, the route and the route without drafts, in turn
PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."
COLD_CHATS = ("Write a Python function that reverses a string.", "What does HTTP status 404 mean?")
COLD_TIMEOUT_S = 600.0  # a cold swarm's start, fetch included; every wait of it is bounded by this
MIB = 2**20
NODE_GOAL = 1.2
_FETCHED = re.compile(r"meshnet: fetched layers \S+: .* in ([\d.]+)s \(")


@dataclass(frozen=True, slots=True)
class FetchedNode:
    layers: str
    peak_rss: int  # VmHWM of the node process
    rss: int  # its resident memory after the chats
    rss_file: int  # of which pages of files it maps (libtorrent's storage), not memory of its own
    files: int  # bytes of the GGUF files it fetched (or merged)
    kv: int  # its KV budget: KV bytes per token of its layers x CTX x MAX_SESSIONS
    fetch_s: float | None  # its fetch, as its log says (None: the log does not say)


@dataclass(frozen=True, slots=True)
class ColdSwarm:
    first_token_s: float  # from starting the nodes and the gateway to the first streamed token
    ready_s: float  # until every node serves and is registered, and the gateway listens
    next_first_token_s: float  # the next chat's first token, on the now warm swarm
    fetched_bytes: int
    nodes: tuple[FetchedNode, ...]


def _model() -> Path | None:
    for name in CANDIDATES:
        path = cache_dir() / MODELS[name].filename
        if path.is_file() and path.stat().st_size == MODELS[name].size:
            return path
    return None


def _publish_peak(model: Path, out: Path, ranges: list[LayerRange]) -> int:
    """Publish ``model`` into ``out``, one file per range of ``ranges``; the publisher's peak RSS."""
    cut = ",".join(str(r) for r in ranges)
    return meshnet_peak_rss(["publish", str(model), "--out", str(out), "--ranges", cut], timeout_s=1200)


def _shard_bytes(model: Path, start: int, stop: int) -> int:
    """Bytes of the files a node of ``start:stop`` holds: the shard it cut (``LlamaShard.from_model``
    caches it by the source's identity) and a head's embedding table."""
    from meshnet.artifacts.gguf_source import model_stem
    from meshnet.cli.paths import default_cache_dir

    key = f"{model_stem(model)}.*.{start}-{stop}"
    shard = max(default_cache_dir().glob(f"{key}.gguf"), key=lambda p: p.stat().st_mtime)
    embd = shard.with_name(shard.name.removesuffix(".gguf") + ".embd.gguf")
    return shard.stat().st_size + (embd.stat().st_size if embd.is_file() else 0)


def _decode(url: str) -> float:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = []
    for _ in range(REPEATS):
        body = {"prompt": PROMPT, "max_tokens": DECODE_TOKENS, "temperature": 0, "model": model}
        rates.append(decode_rate(DECODE_TOKENS, stream_completion(url, body, uuid.uuid4().hex)))
    return median(rates)


@dataclass
class Interleaved:
    """Decode tokens/s of several servers measured in alternating rounds (the order turned each round),
    so that the machine's drift over minutes moves them all alike; and, for routes, the hops'
    compute per token (their telemetry)."""

    rates: dict[str, list[float]]
    compute_ms: dict[str, list[float]]

    def rate(self, name: str) -> float:
        return median(self.rates[name])


def _interleaved(urls: dict[str, str], routes: set[str]) -> Interleaved:
    models = {name: httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] for name, url in urls.items()}
    out = Interleaved({name: [] for name in urls}, {name: [] for name in routes})
    names = list(urls)
    for round_ in range(INTERLEAVED_ROUNDS + 1):  # the first warms each up, uncounted
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            gid = uuid.uuid4().hex
            body = {"prompt": PROMPT, "max_tokens": DECODE_TOKENS, "temperature": 0, "model": models[name]}
            rate = decode_rate(DECODE_TOKENS, stream_completion(urls[name], body, gid))
            if round_:
                out.rates[name].append(rate)
                if name in routes:
                    out.compute_ms[name].append(route_compute_ms(urls[name], gid))
    return out


def _first_token(url: str, model: str, prompt: str, deadline: float) -> float:
    """When the first text of a streamed chat arrived (``time.perf_counter``). A 503 (no route
    yet: the gateway has not seen every node) is asked again until ``deadline``."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0, "stream": True}  # fmt: skip
    while True:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            if r.status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        return time.perf_counter()
        raise RuntimeError(f"the chat on {url} streamed no text")


def _gguf_bytes(*folders: Path) -> int:
    """Bytes of the finished GGUF files under ``folders`` (not the fetch's partial pieces)."""
    found = (p for f in folders for p in f.rglob("*.gguf") if PART_DIR not in p.parts)
    return sum(p.stat().st_size for p in found)


def _cold_swarm(published: Path, root: Path, shape: ModelShape, nodes: int, threads: int) -> ColdSwarm:
    """A tracker and a web seed of ``published`` (its ranges one file each); then ``nodes`` nodes with
    ``--layers auto`` and empty folders, and a gateway holding nothing, started together. Everything
    listens on 127.0.0.1 and is stopped on the way out."""
    manifest = read_manifest(published / "manifest.json")
    cap = max(len(layers) for layers, _ in manifest.layer_map)
    with contextlib.ExitStack() as stack:
        web = stack.enter_context(serve_directory(published))
        tracker_args = ["tracker", "--port", "0", "--db", f"sqlite:///{root / 'cold-tracker.db'}"]
        tracker = stack.enter_context(meshnet_process(tracker_args)).url
        source = ["--manifest", f"{web.url}manifest.json", "--tracker", tracker, "--stall-timeout", "60"]
        folders = {f"cold-{i}": root / f"cold-node-{i}" for i in range(nodes)}
        starting = {}
        for node_id, folder in folders.items():
            args = ["node", *source, "--web-seed", web.url, "--layers", "auto", "--max-layers", str(cap)]
            args += ["--node-id", node_id, "--dest", str(folder / "files"), "--cache-dir", str(folder / "cache")]
            args += ["--threads", str(threads), "--ctx", str(CTX), "--max-sessions", str(MAX_SESSIONS)]
            starting[node_id] = meshnet_process(args, ready_timeout_s=COLD_TIMEOUT_S)
        gateway_args = ["gateway", *source, "--port", "0", "--dest", str(root / "cold-gateway")]
        starting["gateway"] = meshnet_process(
            [*gateway_args, "--billing-spool", str(root / "cold-spool")], ready_timeout_s=COLD_TIMEOUT_S
        )
        began, deadline = time.perf_counter(), time.monotonic() + COLD_TIMEOUT_S
        procs = start_together(stack, starting)
        gateway = procs.pop("gateway")
        wait_registered(tracker, nodes, timeout_s=max(1.0, deadline - time.monotonic()))
        ready = time.perf_counter() - began
        first = _first_token(gateway.url, manifest.model_id, COLD_CHATS[0], deadline) - began
        asked = time.perf_counter()
        following = _first_token(gateway.url, manifest.model_id, COLD_CHATS[1], deadline) - asked
        listed = {n["node_id"]: str(n["layers"]) for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}
        fetched = []
        for node_id, proc in procs.items():
            layers = LayerRange.parse(listed[node_id], shape.layers)
            fetch = _FETCHED.search(proc.output())
            memory = psutil.Process(proc.popen.pid).memory_info()
            fetched.append(
                FetchedNode(
                    layers=str(layers),
                    peak_rss=peak_rss(proc.popen.pid),
                    rss=memory.rss,
                    rss_file=memory.shared,
                    files=_gguf_bytes(folders[node_id]),
                    kv=shape.kv_bytes_per_token_per_layer * len(layers) * CTX * MAX_SESSIONS,
                    fetch_s=float(fetch.group(1)) if fetch else None,
                )
            )
    fetched.sort(key=lambda n: int(n.layers.split(":")[0]))
    total = sum(n.files for n in fetched) + _gguf_bytes(root / "cold-gateway")
    return ColdSwarm(first, ready, following, total, tuple(fetched))


def _cold_rows(section: Section, cold: ColdSwarm) -> None:
    fetches = [n.fetch_s for n in cold.nodes if n.fetch_s is not None]
    section.add(
        "cold swarm: time to first token, fetch included",
        f"{cold.first_token_s:.1f} s ({len(cold.nodes)} nodes and a gateway fetching {cold.fetched_bytes / MIB:.0f} "
        "MiB from a web seed)",
    )
    slowest = f"{max(fetches):.1f} s" if len(fetches) == len(cold.nodes) else "not in every node's log"
    section.add("cold swarm: the slowest node's fetch", slowest)
    section.add("cold swarm: every node registered, the gateway listening", f"{cold.ready_s:.1f} s")
    section.add("cold swarm: the next chat's first token (warm)", f"{cold.next_first_token_s:.2f} s")
    for node in cold.nodes:
        ratio = node.rss / (node.files + node.kv)
        section.add(
            f"fetched node {node.layers}: RSS ÷ (files + KV budget)",
            f"{ratio:.2f} ({node.rss / MIB:.0f} MiB ÷ ({node.files / MIB:.0f} + {node.kv / MIB:.0f}) MiB after the "
            f"chats, {node.rss_file / MIB:.0f} MiB of it mapped file pages; peak {node.peak_rss / MIB:.0f} MiB "
            "while it fetched and loaded)",
            f"≤ {NODE_GOAL}",
            ratio <= NODE_GOAL,
        )


def run() -> Section:
    cores = psutil.cpu_count() or 1
    section = Section(
        "A real model: publish and node memory, route decode vs serve, a cold swarm",
        f"python benchmarks/run.py --only real  (ctx {CTX} x {MAX_SESSIONS} sessions, {cores} nodes of 1 thread "
        f"vs serve with {cores} threads and with 1, {DECODE_TOKENS} greedy tokens, median of {REPEATS}; serve at 1 "
        f"thread, the route and the route with --speculative off up at once, median of {INTERLEAVED_ROUNDS} rounds "
        f"in turn; a cold swarm of {cores} --layers auto nodes)",
    )
    model = _model()
    if model is None:
        section.notes.append("no real model in the cache: run `python tests/fetch_real_models.py qwen2.5-coder-1.5b`")
        return section
    size = model.stat().st_size
    fields = read_header(model).fields
    shape = shape_from_fields(model, fields)
    ranges = split_layers(shape.layers, cores, range_starts(model))
    section.add("model", f"{model.name}: {size / MIB:.0f} MiB, {shape.layers} layers")
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-real-") as tmp:
        root = Path(tmp)
        peak = _publish_peak(model, root / "pub", ranges)
        section.add("publish peak RSS ÷ model size", f"{peak / size:.3f} ({peak / MIB:.0f} MiB)", "≤ 0.1",
                    peak / size <= 0.1)  # fmt: skip
        tail = ranges[-1]
        cut = ["shard", "make", "--gguf", str(model), "--layers", str(tail), "--out", str(root / "cut.gguf")]
        peak = meshnet_peak_rss(cut, timeout_s=1200)
        section.add(f"shard make {tail} peak RSS ÷ model size", f"{peak / size:.3f} ({peak / MIB:.0f} MiB)", "≤ 0.1",
                    peak / size <= 0.1)  # fmt: skip
        serve_args = ["serve", "--gguf", str(model), "--port", "0", "--ctx", str(CTX), "--threads"]
        with meshnet_process([*serve_args, str(cores)], ready_timeout_s=600) as served:
            serve_decode = _decode(served.url)
        up_args = ["up", "--gguf", str(model), "--port", "0", "--nodes", str(cores), "--ctx", str(CTX)]
        up_args += ["--max-sessions", str(MAX_SESSIONS)]
        with contextlib.ExitStack() as stack:
            # serve at one thread (the compute threads a route of 1-thread nodes runs at a time), the route and
            # the same route without drafts, all up at once and measured in turn (each idle while another runs)
            one = stack.enter_context(meshnet_process([*serve_args, "1"], ready_timeout_s=600))
            up = stack.enter_context(meshnet_process([*up_args, "--workdir", str(root / "up")], ready_timeout_s=900))
            off = stack.enter_context(meshnet_process([*up_args, "--workdir", str(root / "off"), "--speculative",
                                                       "off"], ready_timeout_s=900))  # fmt: skip
            turns = _interleaved({"serve": one.url, "route": up.url, "off": off.url}, {"route", "off"})
            time.sleep(1)
            for layers, node in sorted(up_nodes(up).items(), key=lambda kv: int(kv[0].split(":")[0])):
                start, stop = (int(v) for v in layers.split(":"))
                kv = shape.kv_bytes_per_token_per_layer * (stop - start) * CTX * MAX_SESSIONS
                files, rss = _shard_bytes(model, start, stop), node.memory_info().rss
                section.add(
                    f"node {start}:{stop}: RSS ÷ (files + KV budget)",
                    f"{rss / (files + kv):.2f} ({rss / MIB:.0f} MiB ÷ ({files / MIB:.0f} + {kv / MIB:.0f}) MiB)",
                    f"≤ {NODE_GOAL}",
                    rss / (files + kv) <= NODE_GOAL,
                )
        cold = _cold_swarm(root / "pub", root, shape, len(ranges), max(1, cores // len(ranges)))
    serve_one_decode, route_decode, route_off_decode = (turns.rate(name) for name in ("serve", "route", "off"))
    ratio, ratio_one = route_decode / serve_decode, route_decode / serve_one_decode
    section.add(f"serve decode ({cores} threads)", f"{serve_decode:.1f} tok/s")
    section.add("serve decode (1 thread)", f"{serve_one_decode:.1f} tok/s")
    section.add(f"route decode ({cores} nodes of 1 thread)", f"{route_decode:.1f} tok/s")
    off_ms, compute_ms = 1000 / route_off_decode, median(turns.compute_ms["off"])
    section.add(
        f"route without drafts: ms a token beyond its hops' compute, per hop ({cores} hops)",
        f"{(off_ms - compute_ms) / cores:.2f} ms ({off_ms:.1f} ms a token, {compute_ms:.1f} of it the hops' compute; "
        f"serve at 1 thread {1000 / serve_one_decode:.1f})",
    )
    section.add(f"route decode ÷ serve decode, the same total threads ({cores})", f"{ratio:.3f}", "≥ 0.85",
                ratio >= 0.85)  # fmt: skip
    section.add("route decode ÷ serve decode, the same threads at a time (1)", f"{ratio_one:.3f}", "≥ 0.95",
                ratio_one >= 0.95)  # fmt: skip
    section.add(f"route decode, --speculative off ({cores} nodes of 1 thread)", f"{route_off_decode:.1f} tok/s")
    spec = route_decode / route_off_decode
    section.add("default speculation (ngram, pipelined) ÷ --speculative off", f"{spec:.3f}",
                "≥ 1.0", spec >= 1.0)  # fmt: skip
    _cold_rows(section, cold)
    section.notes.append(
        "A node's files are the shard GGUF of its range and a head's embedding table (read, not mapped). "
        "The rest of a node's RSS is the interpreter and libraries (~75 MiB) and llama.cpp's compute buffer "
        "(66.5 MiB allocated at the tail for a 512-row chunk; resident only what its chunks touch, ~17 MiB for the "
        "gateway's 128-row chunks); a fetched node also keeps seeding its files "
        "(libtorrent: ~12 MiB of library pages, its session's heap). docs/backends.md, Memory."
    )
    section.notes.append(
        f"The cold swarm: the model published as {len(ranges)} ranges ({', '.join(map(str, ranges))}), one file "
        "each, served over HTTP by a web seed on the same machine; the clock starts when the nodes and the gateway "
        "are started (the tracker already runs) and stops at the first streamed token of a chat of 8 tokens. "
        "A fetched node's peak RSS covers its fetch and its load: llama.cpp reads each tensor and repacks it "
        "into buffers of its own, and the load-time bit checks run before the node hands its freed heap back "
        "(malloc_trim)."
    )
    return section
