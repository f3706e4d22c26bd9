"""What a node advertises to the tracker besides its layer range: hardware, speed, load, latency.

- ``host_hardware``: CPU, cores, RAM (``/proc``), and the GPUs its backend computes on: those
  llama.cpp lists (``backends.gpu``) once llama.cpp is loaded, else torch's CUDA device if torch is
  *already* loaded (this module never imports either: a node must not pay for the one it does not run).
- ``Traffic``: requests in flight (the queue depth) and the node's measured speed, prefill and
  decode apart, as an exponential moving average of positions/second over real compute calls.
  Owned by the node's event loop; not thread-safe.
- ``SelfBenchmark``: a short run on a scratch session of the real shard backend at start, so the
  tracker knows the speed before the first request. Runs on a worker thread; ``stop`` ends it
  between steps.
- ``LatencyProber``: round trips to the candidate next hops the tracker names (median of a few
  ``GET /v1/health``), reported as ``latency_ms`` with the next heartbeat.

Every field is described with its unit in docs/tracker.md ("Advertisement").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from meshnet.backends.shard import ShardBackend
from meshnet.ids import SessionId

__all__ = [
    "BenchResult",
    "LatencyProber",
    "SelfBenchmark",
    "Traffic",
    "advert_fields",
    "benchmark_in_background",
    "host_hardware",
]

EMA_ALPHA = 0.2  # weight of the newest compute call in the rolling speed
BENCH_WARMUP_TOKENS = 8  # first graph build and weight page-in, not timed
BENCH_PREFILL_TOKENS = 32
BENCH_DECODE_STEPS = 8
BENCH_BUDGET_S = 30.0  # a slow node stops early and reports what it measured
PROBE_SAMPLES = 3
PROBE_TIMEOUT_S = 2.0
PROBE_EVERY_S = 30.0  # re-measure a next hop this often
PROBE_KEEP = 64  # measured next hops kept (the tracker accepts 4 x its 16 targets per heartbeat)
GPU_NAME_CHARS = 256  # the longest hardware.gpu the tracker accepts


# -- hardware -------------------------------------------------------------------------------------
def host_hardware(threads: int | None = None) -> dict[str, Any]:
    """This host, as the registration's ``hardware`` object. Cheap: a few ``/proc`` reads, and a
    device query of the GPU library a backend already loaded."""
    total, available = _memory()
    gpu, gpu_memory = _gpu()
    return {
        "cpu": _cpu_name(),
        "logical_cores": os.cpu_count(),
        "threads": threads,
        "ram_total_bytes": total,
        "ram_available_bytes": available,
        "gpu": gpu,
        "gpu_memory_bytes": gpu_memory,
    }


def _cpu_name() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory() -> tuple[int | None, int | None]:
    found: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(rest.split()[0]) * 1024  # reported in kB
    total = found.get("MemTotal")
    if total is None:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, found.get("MemAvailable")


def _gpu() -> tuple[str | None, int | None]:
    """The GPUs' name (``"2x NVIDIA H100"`` for several alike: llama.cpp splits offloaded layers over
    all of them) and their total memory in bytes; ``(None, None)`` without one. llama.cpp's devices are
    asked only once llama.cpp is loaded: on a GPU build the first query initializes the driver, which
    a process that never computes (``meshnet up``'s parent) must not pay for. The query never raises
    (``backends.gpu``)."""
    if "llama_cpp" in sys.modules:
        from meshnet.backends.gpu import gpu_devices, gpu_label

        devices = gpu_devices()
        if devices:
            return gpu_label(devices)[:GPU_NAME_CHARS], sum(d.memory_total_bytes for d in devices)
    return _gpu_name(), None


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")  # only a backend that already loaded torch has a GPU to report
    if torch is None:
        return None
    try:
        return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA setup must not stop the heartbeat
        return None


# -- speed and load ---------------------------------------------------------------------------------
class _Rate:
    """EMA of positions and of seconds: their ratio weighs a call by its size (a 1-token tail chunk
    of a prompt does not drag the prefill speed down as much as a 128-token chunk lifts it)."""

    def __init__(self) -> None:
        self.positions = 0.0
        self.seconds = 0.0

    def add(self, positions: float, seconds: float) -> None:
        if self.seconds <= 0:
            self.positions, self.seconds = positions, seconds
        else:
            self.positions += EMA_ALPHA * (positions - self.positions)
            self.seconds += EMA_ALPHA * (seconds - self.seconds)

    @property
    def per_second(self) -> float:
        return self.positions / self.seconds if self.seconds > 0 else 0.0


class Traffic:
    """Requests computing or waiting to compute on this node, and its measured speed."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.prefill = _Rate()
        self.decode = _Rate()
        self.last_compute: float | None = None  # time.monotonic() of the last compute, bench included
        self.news = asyncio.Event()  # set when the advertisement changed enough to re-register now
        self._overlaps = 0

    @contextlib.contextmanager
    def measure(self, positions: int, *, decode: bool) -> Iterator[None]:
        """Time one compute call. Only a call that ran alone is a speed sample: with others in
        flight, its time includes waiting for the shard's compute lock (that is ``queue_depth``)."""
        self.in_flight += 1
        if self.in_flight > 1:
            self._overlaps += 1  # every call in flight now is contended
        alone, overlaps = self.in_flight == 1, self._overlaps
        began = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.in_flight -= 1
            self.last_compute = time.monotonic()
            if ok and alone and overlaps == self._overlaps:
                (self.decode if decode else self.prefill).add(positions, time.perf_counter() - began)

    def seed(self, result: BenchResult) -> None:
        """Start the rolling averages from the self-benchmark."""
        if result.prefill_s > 0:
            self.prefill.add(result.prefill_positions, result.prefill_s)
        if result.decode_s > 0:
            self.decode.add(result.decode_steps, result.decode_s)
        self.last_compute = time.monotonic()
        self.news.set()

    def fields(self) -> dict[str, Any]:
        idle = None if self.last_compute is None else round(time.monotonic() - self.last_compute, 3)
        return {
            "prefill_tps": round(self.prefill.per_second, 3),
            "decode_tps": round(self.decode.per_second, 3),
            "queue_depth": self.in_flight,
            "idle_s": idle,
        }


# -- the self-benchmark ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BenchResult:
    prefill_positions: int
    prefill_s: float
    decode_steps: int
    decode_s: float

    @property
    def prefill_tps(self) -> float:
        return self.prefill_positions / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


class SelfBenchmark:
    """Prefill and decode on a scratch session with synthetic inputs of this shard's seam shape."""

    def __init__(self, shard: ShardBackend, *, budget_s: float = BENCH_BUDGET_S) -> None:
        self.shard = shard
        self.budget_s = budget_s
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> BenchResult:
        """Blocking (call it on a worker thread). Frees its scratch session whatever happens."""
        info = self.shard.info
        room = info.max_positions - BENCH_WARMUP_TOKENS
        prefill_n = max(1, min(BENCH_PREFILL_TOKENS, room // 2))
        steps = max(0, min(BENCH_DECODE_STEPS, room - prefill_n))
        deadline = time.monotonic() + self.budget_s
        sid = SessionId(f"bench-{secrets.token_hex(6)}")
        rng = np.random.default_rng(0)
        self.shard.open_session(sid)
        try:
            self._chunk(sid, 0, BENCH_WARMUP_TOKENS, rng)
            began = time.perf_counter()
            self._chunk(sid, BENCH_WARMUP_TOKENS, prefill_n, rng)
            prefill_s = time.perf_counter() - began
            position, done = BENCH_WARMUP_TOKENS + prefill_n, 0
            began = time.perf_counter()
            while done < steps and not self._stop.is_set() and time.monotonic() < deadline:
                tokens, hidden = self._inputs(position, 1, rng)
                token = None if tokens is None else int(tokens[0])
                self.shard.decode_step(sid, position, token=token, hidden=hidden)
                position, done = position + 1, done + 1
            return BenchResult(prefill_n, prefill_s, done, time.perf_counter() - began if done else 0.0)
        finally:
            with contextlib.suppress(Exception):
                self.shard.close_session(sid)

    def _chunk(self, sid: SessionId, start: int, n: int, rng: np.random.Generator) -> None:
        tokens, hidden = self._inputs(start, n, rng)
        self.shard.prefill(sid, start, tokens=tokens, hidden=hidden)

    def _inputs(self, start: int, n: int, rng: np.random.Generator) -> tuple[Any, Any]:
        info = self.shard.info
        tokens = hidden = None
        if info.layers.is_head or info.seam.carries_token_ids:
            # Arbitrary but valid, varied ids: a constant id could hit a degenerate fast path.
            tokens = ((np.arange(start, start + n) * 7919 + 13) % info.n_vocab).astype(np.int32)
        if not info.layers.is_head:
            # x: [n, *seam]; small values, like a residual stream after its first norms
            hidden = (rng.standard_normal((n, *info.seam.shape)) * 0.1).astype(np.float32)
        return tokens, hidden


# -- latency to the next hops -----------------------------------------------------------------------
class LatencyProber:
    """Measured round trips to candidate next hops, in milliseconds. Owned by the heartbeat task."""

    def __init__(self, *, samples: int = PROBE_SAMPLES, every_s: float = PROBE_EVERY_S) -> None:
        self.samples = samples
        self.every_s = every_s
        self.latency_ms: dict[str, float] = {}
        self._measured_at: dict[str, float] = {}

    def due(self, urls: Sequence[str]) -> list[str]:
        now = time.monotonic()
        return [u for u in dict.fromkeys(urls) if now - self._measured_at.get(u, -1e18) >= self.every_s]

    async def probe(self, client: httpx.AsyncClient, urls: Sequence[str]) -> None:
        """Measure the ``urls`` that are due, concurrently; each wait is bounded by ``PROBE_TIMEOUT_S``."""
        due = self.due([u.rstrip("/") for u in urls if u.startswith(("http://", "https://"))])
        results = await asyncio.gather(*(self._rtt(client, u) for u in due))
        now = time.monotonic()
        for url, ms in zip(due, results, strict=True):
            self._measured_at[url] = now
            if ms is None:
                self.latency_ms.pop(url, None)  # unreachable: let the tracker fall back to its default
            else:
                self.latency_ms[url] = ms
        for url in sorted(self.latency_ms, key=lambda u: self._measured_at[u])[
            : max(0, len(self.latency_ms) - PROBE_KEEP)
        ]:
            del self.latency_ms[url]

    async def _rtt(self, client: httpx.AsyncClient, url: str) -> float | None:
        times = []
        for _ in range(self.samples):
            began = time.perf_counter()
            try:
                response = await client.get(f"{url}/v1/health", timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                times.append(1000 * (time.perf_counter() - began))
        return round(statistics.median(times), 3) if times else None


def advert_fields(shard: ShardBackend, traffic: Traffic, prober: LatencyProber) -> dict[str, Any]:
    """The measured part of a registration body (the heartbeat adds identity and hardware)."""
    return {
        **traffic.fields(),
        "kv_bytes_per_token": shard.info.kv.bytes_per_token,
        "max_positions": shard.info.max_positions,  # per session: the tracker routes only what fits
        "weight_bytes": shard.info.weight_bytes,
        "numerics": shard.info.numerics or None,
        "architecture": shard.info.architecture,
        "seam": list(shard.info.seam.shape),
        "max_verify": shard.info.max_verify,
        "latency_ms": dict(prober.latency_ms),
    }


async def benchmark_in_background(bench: SelfBenchmark, traffic: Traffic) -> None:
    """Run ``bench`` on a worker thread and seed ``traffic`` with it; a failure leaves the speed unknown."""
    log = logging.getLogger("meshnet.node")
    try:
        result = await asyncio.to_thread(bench.run)
    except Exception as exc:  # e.g. StoreFull when requests took every slot first: the node serves anyway
        log.warning("self-benchmark skipped: %s", getattr(exc, "message", exc))
        return
    traffic.seed(result)
    log.info(
        "self-benchmark: prefill %.1f positions/s (%d in %.3f s), decode %.1f positions/s (%d steps in %.3f s)",
        result.prefill_tps,
        result.prefill_positions,
        result.prefill_s,
        result.decode_tps,
        result.decode_steps,
        result.decode_s,
    )
