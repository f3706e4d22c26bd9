"""A node's metrics (node.metrics): the counters a decode step moves are plain numbers, scraped as
Prometheus counters named as before (``*_total``)."""

from __future__ import annotations

import pytest

from meshnet.node.metrics import NodeMetrics


def test_step_counters_are_scraped_as_prometheus_counters() -> None:
    metrics = NodeMetrics()
    metrics.positions.inc(3)
    metrics.decode_step(0.25, 0.5)
    metrics.batch(2)
    lines = metrics.render().decode().splitlines()
    for line in (
        "# TYPE meshnet_node_positions_total counter",
        "meshnet_node_positions_total 3.0",
        "meshnet_node_decode_steps_total 1.0",
        "meshnet_node_decode_compute_seconds_total 0.25",
        "meshnet_node_decode_handle_seconds_total 0.5",
        "meshnet_node_decode_batch_steps_total 2.0",
        "meshnet_node_seam_bytes_total 0.0",
    ):
        assert line in lines
    with pytest.raises(ValueError, match="only goes up"):
        metrics.positions.inc(-1)
    assert metrics.positions.value == 3
