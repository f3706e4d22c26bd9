"""Prometheus metrics of one gateway, in a registry of its own (no import-time globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics"]

_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "meshnet_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.generations = Counter("meshnet_generations", "Generations by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("meshnet_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("meshnet_completion_tokens", "Tokens generated", registry=r)
        self.route_retries = Counter(
            "meshnet_route_retries",
            "Routes recovered after a hop failed, by kind (repair: rebuilt in place; reroute: fresh route)",
            ["kind"],
            registry=r,
        )
        self.route_recovery_seconds = Histogram(
            "meshnet_route_recovery_seconds",
            "Time from a hop failure to the recovered route's next answer, by kind",
            ["kind"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.route_replayed_positions = Counter(
            "meshnet_route_replayed_positions",
            "Positions recomputed on replacement hops by route repairs and reroutes",
            ["kind"],
            registry=r,
        )
        self.route_inconsistencies = Counter(
            "meshnet_route_inconsistencies",
            "Generations stopped because the hops of their route disagreed on what they computed",
            registry=r,
        )
        self.audits = Gauge(
            "meshnet_gateway_audits",
            "Audited hops by verdict (pass, fail; skipped: no auditor of its layers, or a full audit queue)",
            ["verdict"],
            registry=r,
        )
        self.active = Gauge("meshnet_generations_active", "Generations running now", registry=r)
        self.queue_depth = Gauge("meshnet_queue_depth", "Generations waiting for the engine", registry=r)
        self.decode_tokens_per_second = Gauge(
            "meshnet_decode_tokens_per_second",
            "Mean decode speed of the last finished generation",
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "meshnet_prefill_seconds", "Prefill time per generation", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.decode_seconds = Histogram(
            "meshnet_decode_seconds", "Decode time per generation", buckets=_SECONDS_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
