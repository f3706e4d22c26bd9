"""GPU offload, end to end in one process (benchmarks/device_check.sh runs it on a GPU machine).

The bundled model whole, as ``meshnet serve`` runs it (``LlamaFullEngine``), against the same model
as a 2-shard route (``LlamaShard.from_model`` + ``ChainSession``), both with ``--gpu-layers``:

- greedy tokens: the route must give the whole model's (route == serve, on one kind of device);
- decode tokens/s of each (medians of alternating rounds), and the route's over the whole's;
- the same tokens in every round (a GPU run that is not deterministic fails too).

``--gpu-layers 0`` runs the same check on the CPU (what a machine without a GPU can check of it).
Exit status 1 when tokens differ.

``--wan``: instead, the goal cell of ``bench wan`` (3 seams x 20 ms round trip, the bundled model)
with every node's layers offloaded: autoregressive ÷ its floor, and pipelined speculation on
open-ended and copy-heavy text, where a verify chunk costs a GPU about what a step does. Its section
is printed in the format of benchmarks/RESULTS.md; exit status 1 when a gateway's text differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Section, decode_rate
from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.base import TokenStep
from meshnet.backends.chain import ChainSession
from meshnet.backends.gpu import gpu_devices, gpu_layers_flag
from meshnet.backends.llama_full import LlamaFullEngine
from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig
from meshnet.cli.serve import gpu_layers_arg
from meshnet.sampling import Sampler, SamplingParams

PROMPT_TEXT = "<|im_start|>user\nWrite a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
CTX = 2048
CHUNK = 512  # the engine's prefill chunk (its n_batch): the route prefills in the same chunks
Run = tuple[list[int], float]  # greedy tokens, decode tokens/s


def whole(engine: LlamaFullEngine, prompt: list[int], tokens: int) -> Run:
    """Greedy tokens and decode tokens/s of the whole model, as ``meshnet serve`` runs it."""
    out: list[int] = []
    times: list[float] = []
    steps = engine.generate(prompt, Sampler(SamplingParams(temperature=0)), threading.Event())
    for step in steps:
        if isinstance(step, TokenStep):
            out.append(step.token)
            times.append(time.perf_counter())
            if len(out) == tokens:
                break
    steps.close()
    return out, decode_rate(len(times), times)


def route(shards: list[LlamaShard], prompt: list[int], tokens: int) -> Run:
    """Greedy tokens and decode tokens/s of a route of in-process shards."""
    session = ChainSession(shards)
    try:
        logits = session.prefill(prompt, CHUNK)
        out: list[int] = []
        times: list[float] = []
        while True:
            out.append(int(np.argmax(logits)))
            times.append(time.perf_counter())
            if len(out) == tokens:
                return out, decode_rate(len(times), times)
            logits = session.step(out[-1])
    finally:
        session.close()


def _rounds(args: argparse.Namespace, cache: Path) -> tuple[list[tuple[Run, Run]], str]:
    """The whole model and the route cut mid-model, loaded side by side and run in alternating rounds
    (drift of a shared machine hits both alike): each round's (whole, route), and the shards' numerics."""
    started = time.monotonic()
    engine = LlamaFullEngine(bundled_gguf(), n_ctx=CTX, n_threads=args.threads, gpu_layers=args.gpu_layers)
    prompt, total = engine.tokenize(PROMPT_TEXT, add_special=True), engine.info.n_layers
    config = LlamaShardConfig(n_ctx=CTX, max_sessions=1, n_threads=args.threads, gpu_layers=args.gpu_layers)
    shards: list[LlamaShard] = []
    try:
        for a, b in ((0, total // 2), (total // 2, total)):
            shards.append(LlamaShard.from_model(bundled_gguf(), f"{a}:{b}", cache_dir=cache, config=config))
        print(f"loaded the whole model and the route {[str(s.info.layers) for s in shards]}", end=" ")
        print(f"in {time.monotonic() - started:.1f}s")
        print(f"shard numerics: {shards[0].info.numerics}")
        runs = [(whole(engine, prompt, args.tokens), route(shards, prompt, args.tokens)) for _ in range(args.rounds)]
        return runs, shards[0].info.numerics
    finally:
        engine.close()
        for shard in shards:
            shard.close()


def wan(gpu_layers: int) -> int:
    """``--wan`` (module docstring)."""
    from benchmarks import bench_wan

    flag = gpu_layers_flag(gpu_layers)
    rtt, seams = bench_wan.BASELINE
    gateways = ("off", "no-relay", "ngram", "ngram-sync")
    cell = bench_wan.Cell(rtt, seams, bench_wan.BASELINE_TOKENS, bench_wan.BASELINE_ROUNDS, gateways)
    threads = max(1, (os.cpu_count() or 1) // seams)
    section = Section(
        f"WAN links on the GPU: {cell.label} round trip, every node --gpu-layers {flag}",
        f"python -m benchmarks.device_check --wan --gpu-layers {flag}  (bench wan's goal cell: one node per seam, "
        f"{threads} threads each, behind user-space delay proxies; gateways {', '.join(gateways)}; "
        f"{cell.tokens} greedy tokens of an open-ended and a copy-heavy request, median of {cell.rounds} "
        "alternating rounds after a warm-up round)",
    )
    measured = bench_wan.measure(cell, threads, node_args=("--gpu-layers", flag))
    bench_wan.report(section, cell, measured)
    print(section.markdown())
    return 0 if all(len(texts) == 1 for texts in measured.texts.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-layers", type=gpu_layers_arg, default=-1, metavar="N|all", help="default all")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens generated (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--wan", action="store_true", help="bench wan's goal cell on offloaded nodes instead")
    args = parser.parse_args(argv)
    if args.wan:
        return wan(args.gpu_layers)
    import llama_cpp

    print(f"llama-cpp-python {llama_cpp.__version__}, GPU offload supported: {llama_cpp.llama_supports_gpu_offload()}")
    print(f"GPUs llama.cpp lists: {gpu_devices() or 'none'}")
    flag = gpu_layers_flag(args.gpu_layers)
    with tempfile.TemporaryDirectory(prefix="device-check-") as cache:
        runs, numerics = _rounds(args, Path(cache))
    want, got = runs[0][0][0], runs[0][1][0]
    same = got == want
    steady = all(w == want and r == got for (w, _), (r, _) in runs)  # every round gives the same tokens
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    whole_tps = statistics.median(tps for (_, tps), _ in runs)
    route_tps = statistics.median(tps for _, (_, tps) in runs)
    print(f"whole (meshnet serve --gpu-layers {flag}): {whole_tps:.1f} decode tok/s (median of {args.rounds})")
    print(f"route (2 shards, gpu_layers {flag}): {route_tps:.1f} decode tok/s (median of {args.rounds})")
    print(f"route == serve: {same}" + ("" if same else f" (first difference at token {first})"))
    print(f"the same tokens every round: {steady}")
    summary = {
        "gpu_layers": flag,
        "tokens": args.tokens,
        "route_equals_serve": same,
        "deterministic": steady,
        "whole_decode_tps": round(whole_tps, 2),
        "route_decode_tps": round(route_tps, 2),
        "route_over_whole": round(route_tps / whole_tps, 3) if whole_tps else None,
        "numerics": numerics,
    }
    print(json.dumps(summary))
    return 0 if same and steady else 1


if __name__ == "__main__":
    sys.exit(main())
