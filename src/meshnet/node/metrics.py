"""Prometheus metrics of one node, in a registry of its own.

The counters a decode step moves (several per step, on every hop) are plain numbers read when the
metrics are scraped (``StepCount``): a ``prometheus_client.Counter`` takes a lock and checks itself
at every ``inc``, ~4 µs each on a hop whose caches are cold after its compute, ~30 µs per step."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily

__all__ = ["NodeMetrics", "StepCount"]


class StepCount:
    """A counter moved only on the node's event loop (so no lock), exposed as ``NAME_total``."""

    __slots__ = ("doc", "name", "value")

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class _StepCounts:
    """The registry's collector of every ``StepCount``, read at each scrape."""

    def __init__(self, counts: list[StepCount]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        for count in self.counts:
            yield CounterMetricFamily(count.name, count.doc, value=count.value)


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._counts: list[StepCount] = []
        self.positions = self._count("meshnet_node_positions", "Positions computed by this shard")
        self.seam_bytes = self._count("meshnet_node_seam_bytes", "Activation bytes sent to the next hop")
        self.sessions = Gauge("meshnet_node_sessions", "Sessions holding KV on this node", registry=r)
        self.kv_bytes = Gauge("meshnet_node_kv_bytes", "KV/state bytes held for sessions", registry=r)
        self.audits = Counter("meshnet_node_audits", "Hops of audited sessions this auditor re-executed", registry=r)
        self.channels = Gauge("meshnet_node_channels_open", "Decode channels dialed to this node, open now", registry=r)
        self.channel_steps = self._count("meshnet_node_channel_steps", "Decode steps taken over a channel")
        self.relayed = self._count(
            "meshnet_node_relayed_steps", "Decode steps this tail sent to its route's head itself (CREDIT)"
        )
        self.voided = self._count(
            "meshnet_node_voided_rounds", "Pipelined speculation rounds the tail dropped uncomputed"
        )
        self.decode_batches = self._count(
            "meshnet_node_decode_batches", "Shard calls that computed one-position steps (batched decode)"
        )
        self.decode_batch_steps = self._count(
            "meshnet_node_decode_batch_steps", "One-position steps those calls computed, all sessions"
        )

        # Where a decode step's time goes on this hop (benchmarks/bench_route): from the request's
        # arrival to the step leaving it, and the shard's compute within that.
        self.decode_steps = self._count("meshnet_node_decode_steps", "One-position decode steps handled")
        self.decode_compute = self._count("meshnet_node_decode_compute_seconds", "Shard compute of those steps")
        self.decode_handle = self._count(
            "meshnet_node_decode_handle_seconds", "Those steps from arrival to leaving this hop"
        )
        r.register(_StepCounts(self._counts))

        # Prefix caching (node.prefix_cache)
        self.prefix_hits = Counter("meshnet_node_prefix_cache_hits", "Sessions that adopted cached blocks", registry=r)
        self.prefix_misses = Counter(
            "meshnet_node_prefix_cache_misses", "Prefix lookups that found no cached block", registry=r
        )
        self.prefix_reused = Counter(
            "meshnet_node_prefix_cache_reused_positions", "Positions adopted from the cache, not computed", registry=r
        )
        self.prefix_bytes = Gauge("meshnet_node_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)

    def _count(self, name: str, doc: str) -> StepCount:
        count = StepCount(name, doc)
        self._counts.append(count)
        return count

    def decode_step(self, compute_s: float, handle_s: float) -> None:
        self.decode_steps.inc()
        self.decode_compute.inc(compute_s)
        self.decode_handle.inc(handle_s)

    def batch(self, steps: int) -> None:
        self.decode_batches.inc()
        self.decode_batch_steps.inc(steps)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
