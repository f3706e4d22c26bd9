"""A real pretrained model (Qwen2.5-Coder 1.5B, else 0.5B; ``tests/fetch_real_models.py`` fetches them):
memory of ``meshnet publish`` and of each node, and route decode against ``meshnet serve``.

- publish: peak resident memory (``VmHWM`` of the process) ÷ the model's size;
- each node of ``meshnet up``: resident memory ÷ (the shard files it maps + its KV budget, i.e.
  KV bytes per token of its layers x ``--ctx`` x ``--max-sessions``);
- decode of a route whose nodes together run as many compute threads as ``serve`` (one per core).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from tests.procs import meshnet_process
from tests.realmodels import MODELS, cache_dir

from benchmarks.common import Section, decode_rate, median, stream_completion
from meshnet.artifacts.gguf_header import read_header
from meshnet.artifacts.plan import shape_from_fields

CANDIDATES = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
CTX, MAX_SESSIONS = 2048, 2
DECODE_TOKENS, REPEATS = 48, 3
PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."
MIB = 2**20
_PEAK = (
    "import sys; from meshnet.cli.main import main; rc = main(sys.argv[1:]); "
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
    "print('peak_rss_kib', hwm); sys.exit(rc)"
)


def _model() -> Path | None:
    for name in CANDIDATES:
        path = cache_dir() / MODELS[name].filename
        if path.is_file() and path.stat().st_size == MODELS[name].size:
            return path
    return None


def _publish_peak(model: Path, out: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, "publish", str(model), "--out", str(out)],
        capture_output=True, text=True, timeout=1200, check=True,
    )  # fmt: skip
    return int(done.stdout.rsplit("peak_rss_kib", 1)[1].split()[0]) * 1024


def _shard_bytes(model: Path, start: int, stop: int) -> int:
    """Bytes of the files a node of ``start:stop`` holds: the shard it cut (``LlamaShard.from_model``
    caches it by the source's identity) and a head's embedding table."""
    from meshnet.artifacts.gguf_source import model_stem
    from meshnet.cli.swarm import default_cache_dir

    key = f"{model_stem(model)}.*.{start}-{stop}"
    shard = max(default_cache_dir().glob(f"{key}.gguf"), key=lambda p: p.stat().st_mtime)
    embd = shard.with_name(shard.name.removesuffix(".gguf") + ".embd.gguf")
    return shard.stat().st_size + (embd.stat().st_size if embd.is_file() else 0)


def _decode(url: str) -> float:
    import httpx

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = []
    for _ in range(REPEATS):
        body = {"prompt": PROMPT, "max_tokens": DECODE_TOKENS, "temperature": 0, "model": model}
        rates.append(decode_rate(DECODE_TOKENS, stream_completion(url, body, uuid.uuid4().hex)))
    return median(rates)


def run() -> Section:
    cores = psutil.cpu_count() or 1
    section = Section(
        "A real model: publish and node memory, route decode vs serve",
        f"python benchmarks/run.py --only real  (ctx {CTX} x {MAX_SESSIONS} sessions, {cores} nodes of 1 thread "
        f"vs serve with {cores} threads, {DECODE_TOKENS} greedy tokens, median of {REPEATS})",
    )
    model = _model()
    if model is None:
        section.notes.append("no real model in the cache: run `python tests/fetch_real_models.py qwen2.5-coder-1.5b`")
        return section
    size = model.stat().st_size
    fields = read_header(model).fields
    shape = shape_from_fields(model, fields)
    section.add("model", f"{model.name}: {size / MIB:.0f} MiB, {shape.layers} layers")
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-real-") as tmp:
        root = Path(tmp)
        peak = _publish_peak(model, root / "pub")
        section.add("publish peak RSS ÷ model size", f"{peak / size:.3f} ({peak / MIB:.0f} MiB)", "≤ 0.1",
                    peak / size <= 0.1)  # fmt: skip
        serve_args = ["serve", "--gguf", str(model), "--port", "0", "--threads", str(cores), "--ctx", str(CTX)]
        with meshnet_process(serve_args, ready_timeout_s=600) as served:
            serve_decode = _decode(served.url)
        up_args = ["up", "--gguf", str(model), "--port", "0", "--nodes", str(cores), "--workdir", str(root / "up")]
        up_args += ["--ctx", str(CTX), "--max-sessions", str(MAX_SESSIONS)]
        with meshnet_process(up_args, ready_timeout_s=900) as up:
            route_decode = _decode(up.url)
            time.sleep(1)
            nodes = [
                p for p in psutil.Process(up.popen.pid).children(recursive=True) if " node " in " ".join(p.cmdline())
            ]
            ratios = []
            for node in nodes:
                args = node.cmdline()
                start, stop = (int(v) for v in args[args.index("--layers") + 1].split(":"))
                kv = shape.kv_bytes_per_token_per_layer * (stop - start) * CTX * MAX_SESSIONS
                files, rss = _shard_bytes(model, start, stop), node.memory_info().rss
                ratios.append(rss / (files + kv))
                section.add(
                    f"node {start}:{stop}: RSS ÷ (files + KV budget)",
                    f"{rss / (files + kv):.2f} ({rss / MIB:.0f} MiB ÷ ({files / MIB:.0f} + {kv / MIB:.0f}) MiB)",
                    "≤ 1.2",
                    rss / (files + kv) <= 1.2,
                )
    ratio = route_decode / serve_decode
    section.add("serve decode", f"{serve_decode:.1f} tok/s")
    section.add(f"route decode ({cores} nodes)", f"{route_decode:.1f} tok/s")
    section.add("route decode ÷ serve decode", f"{ratio:.3f}", "≥ 0.85", ratio >= 0.85)
    section.notes.append(
        "A node's files are the shard GGUF of its range and a head's embedding table (read, not mapped). "
        "The rest of a node's RSS is the interpreter and libraries (~70 MiB) and llama.cpp's compute buffers."
    )
    return section
