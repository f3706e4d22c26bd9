"""Prometheus metrics of one node, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["NodeMetrics"]


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.positions = Counter("meshnet_node_positions", "Positions computed by this shard", registry=r)
        self.seam_bytes = Counter("meshnet_node_seam_bytes", "Activation bytes sent to the next hop", registry=r)
        self.sessions = Gauge("meshnet_node_sessions", "Sessions holding KV on this node", registry=r)
        self.kv_bytes = Gauge("meshnet_node_kv_bytes", "KV/state bytes held for sessions", registry=r)
        self.audits = Counter("meshnet_node_audits", "Hops of audited sessions this auditor re-executed", registry=r)
        self.channels = Gauge("meshnet_node_channels_open", "Decode channels dialed to this node, open now", registry=r)
        self.channel_steps = Counter("meshnet_node_channel_steps", "Decode steps taken over a channel", registry=r)
        self.relayed = Counter(
            "meshnet_node_relayed_steps", "Decode steps this tail sent to its route's head itself (CREDIT)", registry=r
        )
        self.voided = Counter(
            "meshnet_node_voided_rounds", "Pipelined speculation rounds the tail dropped uncomputed", registry=r
        )
        self.decode_batches = Counter(
            "meshnet_node_decode_batches", "Shard calls that computed one-position steps (batched decode)", registry=r
        )
        self.decode_batch_steps = Counter(
            "meshnet_node_decode_batch_steps", "One-position steps those calls computed, all sessions", registry=r
        )

        # Where a decode step's time goes on this hop (benchmarks/bench_route): from the request's
        # arrival to the step leaving it, and the shard's compute within that.
        self.decode_steps = Counter("meshnet_node_decode_steps", "One-position decode steps handled", registry=r)
        self.decode_compute = Counter("meshnet_node_decode_compute_seconds", "Shard compute of those steps", registry=r)
        self.decode_handle = Counter(
            "meshnet_node_decode_handle_seconds", "Those steps from arrival to leaving this hop", registry=r
        )

        # Prefix caching (node.prefix_cache)
        self.prefix_hits = Counter("meshnet_node_prefix_cache_hits", "Sessions that adopted cached blocks", registry=r)
        self.prefix_misses = Counter(
            "meshnet_node_prefix_cache_misses", "Prefix lookups that found no cached block", registry=r
        )
        self.prefix_reused = Counter(
            "meshnet_node_prefix_cache_reused_positions", "Positions adopted from the cache, not computed", registry=r
        )
        self.prefix_bytes = Gauge("meshnet_node_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)

    def decode_step(self, compute_s: float, handle_s: float) -> None:
        self.decode_steps.inc()
        self.decode_compute.inc(compute_s)
        self.decode_handle.inc(handle_s)

    def batch(self, steps: int) -> None:
        self.decode_batches.inc()
        self.decode_batch_steps.inc(steps)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
