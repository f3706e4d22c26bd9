"""`meshnet serve` over HTTP vs raw llama-cpp-python on the same GGUF, threads and prompts.

Decode tok/s is measured the same way on both sides: (chunks - 1) / (last chunk - first chunk)
of a greedy stream. Prefill tok/s: raw = one ``Llama.eval`` of the prompt; serve = the
``prefill.completed`` telemetry event (server-side) and, client-side, time to first token.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
from tests.procs import meshnet_process

from benchmarks.common import Section, median
from meshnet.artifacts.bundled import bundled_gguf

THREADS = os.cpu_count() or 2
CTX = 2048
BATCH = 512
DECODE_PROMPT = "Once upon a time, in a land far away, there lived a brave dragon who"
PREFILL_PROMPT = " ".join(f"Fact {i}: the sky is blue and the grass is green." for i in range(40))
DECODE_TOKENS = 128
REPEATS = 5


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


class RawLlama:
    """The baseline: llama-cpp-python's own API on the same GGUF, in this process."""

    def __init__(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(bundled_gguf()),
            n_ctx=CTX,
            n_batch=BATCH,
            n_ubatch=BATCH,
            n_threads=THREADS,
            n_threads_batch=THREADS,
            flash_attn=True,  # as meshnet serve runs it
            verbose=False,
        )
        self.prefill_tokens = self.llm.tokenize(PREFILL_PROMPT.encode(), add_bos=True, special=True)

    def prefill(self) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(self.prefill_tokens)
        return len(self.prefill_tokens) / (time.perf_counter() - started)

    def decode(self) -> float:
        self.llm.reset()
        stream = self.llm.create_completion(DECODE_PROMPT, max_tokens=DECODE_TOKENS, temperature=0.0, stream=True)
        return _rate([time.perf_counter() for _ in stream])

    def close(self) -> None:
        self.llm.close()


def _stream(url: str, model: str, prompt: str, max_tokens: int, gid: str | None = None) -> tuple[list[float], dict]:
    """Stream a completion; return the arrival times of text chunks and the final telemetry."""
    _, times, final = stream_text(url, model, prompt, max_tokens, gid)
    return times, final


def stream_text(
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    gid: str | None = None,
    timeout_s: float = 300,
    extra: dict | None = None,
) -> tuple[str, list[float], dict]:
    """Stream a greedy completion (``extra``: more request fields); return its text, the arrival times
    of text chunks and the final telemetry."""
    headers = {"X-Meshnet-Generation-Id": gid} if gid else {}
    text, times, final = "", [], {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body.update(extra or {})
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "meshnet" not in chunk:  # an error event: say what it was
                raise RuntimeError(f"the stream of {url} failed after {len(times)} chunks: {chunk}")
            final = chunk["meshnet"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                text += chunk["choices"][0]["text"]
                times.append(time.perf_counter())
    return text, times, final


def _first_event_latency(url: str, model: str, n: int) -> tuple[list[float], list[float]]:
    """Milliseconds from sending a request to its first SSE telemetry event, and to its first chunk."""
    to_event, to_chunk = [], []
    client = httpx.Client(timeout=60)  # reused: a new client costs tens of ms of TLS-context setup
    client.get(f"{url}/v1/models")
    for i in range(n):
        gid = f"bench-{time.time_ns()}-{i}"
        arrived: list[float] = []

        def listen(gid: str = gid, arrived: list[float] = arrived) -> None:
            # The server answers (headers included) only once the announced generation exists.
            with httpx.stream("GET", f"{url}/v1/generations/{gid}/events?wait=10", timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        arrived.append(time.perf_counter())
                        return

        listener = threading.Thread(target=listen)
        listener.start()
        time.sleep(0.2)  # let the subscription park server-side before the request goes out
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "stream": True}
        sent = time.perf_counter()
        with client.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Meshnet-Generation-Id": gid}) as r:
            first_chunk = None
            for line in r.iter_lines():
                if first_chunk is None and line.startswith("data: "):
                    first_chunk = time.perf_counter()
        listener.join(30)
        to_event.append(1000 * (arrived[0] - sent))
        to_chunk.append(1000 * ((first_chunk or sent) - sent))
    client.close()
    return to_event, to_chunk


def measure() -> dict[str, float | list[float]]:
    """Alternate raw and served runs, so drift on a shared VM hits both sides alike."""
    raw = RawLlama()
    args = ["serve", "--port", "0", "--threads", str(THREADS), "--ctx", str(CTX), "--batch", str(BATCH)]
    try:
        with meshnet_process(args) as proc:
            model = httpx.get(f"{proc.url}/v1/models", timeout=10).json()["data"][0]["id"]
            _stream(proc.url, model, "warm up", 8)
            raw.decode()
            result: dict[str, list[float]] = {k: [] for k in ("raw_prefill", "raw_decode", "prefill", "ttft", "decode")}
            for _ in range(REPEATS):
                result["raw_decode"].append(raw.decode())
                times, _ = _stream(proc.url, model, DECODE_PROMPT, DECODE_TOKENS)
                result["decode"].append(_rate(times))
                result["raw_prefill"].append(raw.prefill())
                started = time.perf_counter()
                times, final = _stream(proc.url, model, PREFILL_PROMPT, 1)
                result["ttft"].append(times[0] - started)
                result["prefill"].append(final["prompt_tokens"] / final["prefill_seconds"])
            to_event, to_chunk = _first_event_latency(proc.url, model, 10)
    finally:
        raw.close()
    summary: dict[str, float | list[float]] = {k: median(v) for k, v in result.items()}
    summary["decode_ratios"] = [s / r for s, r in zip(result["decode"], result["raw_decode"], strict=True)]
    summary.update(to_event=to_event, to_chunk=to_chunk, prefill_tokens=float(len(raw.prefill_tokens)))
    return summary


def run() -> Section:
    section = Section(
        "Single node: `meshnet serve` over HTTP vs raw llama-cpp-python",
        f"python benchmarks/run.py --only serve  (threads {THREADS}, ctx {CTX}, batch {BATCH}, "
        f"{DECODE_TOKENS} greedy tokens, median of {REPEATS})",
    )
    m = measure()
    decode_ratio = float(m["decode"]) / float(m["raw_decode"])
    prefill_ratio = float(m["prefill"]) / float(m["raw_prefill"])
    to_event = sorted(m["to_event"])  # type: ignore[arg-type]
    to_chunk = sorted(m["to_chunk"])  # type: ignore[arg-type]
    pairs = ", ".join(f"{r:.2f}" for r in m["decode_ratios"])  # type: ignore[union-attr]
    section.add("raw llama-cpp-python decode", f"{m['raw_decode']:.1f} tok/s")
    section.add("meshnet serve decode (HTTP stream)", f"{m['decode']:.1f} tok/s")
    section.add("decode ratio serve ÷ raw (medians)", f"{decode_ratio:.3f}", "≥ 0.95", decode_ratio >= 0.95)
    section.add("decode ratio of each alternated pair", pairs)
    section.add(f"raw llama-cpp-python prefill ({int(m['prefill_tokens'])} tokens)", f"{m['raw_prefill']:.1f} tok/s")
    section.add("meshnet serve prefill (server-side, telemetry)", f"{m['prefill']:.1f} tok/s")
    section.add("prefill ratio serve ÷ raw", f"{prefill_ratio:.3f}")
    section.add("meshnet serve time to first token (client-side)", f"{1000 * float(m['ttft']):.0f} ms")
    section.add(
        "request → first telemetry event (median / max of 10)",
        f"{median(to_event):.1f} / {to_event[-1]:.1f} ms",
        "≤ 100 ms",
        to_event[-1] <= 100,
    )
    section.add("request → first stream chunk (median / max of 10)", f"{median(to_chunk):.1f} / {to_chunk[-1]:.1f} ms")
    section.notes.append(
        "Raw baseline: `Llama.create_completion(stream=True)` (llama.cpp's own greedy sampler); serve: "
        "Meshnet's sampler over the same logits, per-token worker→event-loop hand-off, SSE over loopback."
    )
    return section
