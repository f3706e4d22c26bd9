"""Route selection time (``tracker.routing.select_routes``) over synthetic swarms of 10 to 1,000 nodes.

Each swarm serves a 32-layer model cut at 7 random boundaries; every node holds one or two
segments, has a random measured decode speed and measured latencies to 16 random nodes (what a
node reports after probing its candidate next hops). Pure CPU, no servers.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from benchmarks.common import Section, median
from meshnet.layers import LayerRange
from meshnet.tracker.routing import NodeRecord, select_routes

SIZES = (10, 100, 1000)
REPEATS = 15
TOTAL_LAYERS = 32
GOAL_S = 0.1  # at 1,000 nodes


def _swarm(count: int, seed: int = 0) -> list[NodeRecord]:
    rng = random.Random(seed)
    bounds = [0, *sorted(rng.sample(range(1, TOTAL_LAYERS), 7)), TOTAL_LAYERS]
    nodes = []
    for i in range(count):
        j = i if i < len(bounds) - 1 else rng.randrange(len(bounds) - 1)  # the first ones cover every layer
        stop = bounds[min(len(bounds) - 1, j + rng.choice([1, 1, 2]))]
        nodes.append(
            NodeRecord(
                node_id=f"n{i:04d}",
                url=f"http://10.0.{i // 250}.{i % 250}:7000",
                model="m",
                layers=LayerRange(bounds[j], stop, TOTAL_LAYERS),
                backend="llama.cpp",
                kv_bytes_free=rng.choice([1 << 20, 1 << 30]),
                last_seen=0.0,
                prefill_tps=rng.uniform(100, 2000),
                decode_tps=rng.uniform(5, 100),
                queue_depth=rng.choice([0, 0, 1, 2]),
                kv_bytes_per_token=2048,
                warm=rng.random() < 0.9,
                reliability=rng.choice([1.0, 0.99, 0.9]),
            )
        )
    urls = [n.url for n in nodes]
    return [replace(n, latency_ms={u: rng.uniform(0.2, 40) for u in rng.sample(urls, min(16, count))}) for n in nodes]


def _time(nodes: list[NodeRecord]) -> float:
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        select_routes(nodes, "m", TOTAL_LAYERS, k=3)
        times.append(time.perf_counter() - began)
    return median(times)


def run() -> Section:
    section = Section(
        "Route selection (tracker): estimated-time DP, top 3 routes",
        f"python benchmarks/run.py --only routing  (32-layer model, 8 segments, 16 measured next hops per node; "
        f"median of {REPEATS})",
    )
    for count in SIZES:
        seconds = _time(_swarm(count))
        goal, met = ("< 100 ms", seconds < GOAL_S) if count == 1000 else ("", None)
        section.add(f"select_routes, {count:,} nodes", f"{seconds * 1000:.2f} ms", goal, met)
    section.notes.append(
        "One call picks the best route and 2 alternatives over every node of the model; the tracker makes it "
        "once per session open and once per route repair."
    )
    return section
