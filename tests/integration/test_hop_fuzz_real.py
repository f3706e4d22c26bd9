"""The hop-protocol fuzzer of tests/unit/test_hop_fuzz.py against a real ``meshnet node`` process
(llama.cpp, every layer of the bundled model, on loopback): mutated prefill, decode, verify,
reroute, prefix, snapshot and restore requests are 2xx or 4xx in OpenAI's error shape, never a 5xx;
the process stays up, and a session it held goes on with the tokens an untouched node gives."""

from __future__ import annotations

import httpx
import pytest

from tests.procs import meshnet_process
from tests.unit.test_hop_fuzz import fuzz

pytestmark = pytest.mark.real

CASES = 150


def test_a_real_node_answers_mutated_hop_requests_with_4xx_and_goes_on() -> None:
    args = ["node", "--layers", "0:30", "--port", "0", "--threads", "2", "--ctx", "2048", "--max-body-mb", "1"]
    with meshnet_process(args) as node, httpx.Client(base_url=node.url, timeout=60) as client:
        model = client.get("/v1/health").json()["model"]
        seen = fuzz(client, model, cases=CASES, budget_s=120)
        assert seen[4] > CASES // 4, seen
        assert node.popen.poll() is None
        assert "Traceback" not in node.output(), node.output()[-3000:]
