"""A node dying mid-generation: the client gets a stated reason promptly, never a hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import meshnet_process

pytestmark = pytest.mark.real


def test_a_dead_node_fails_the_stream_with_a_reason(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/tracker.db"
    with meshnet_process(["tracker", "--port", "0", "--db", db]) as tracker:
        node_args = ["--threads", "1", "--tracker", tracker.url, "--ctx", "512"]
        with (
            meshnet_process(["node", "--layers", "0:15", *node_args]) as head,
            meshnet_process(["node", "--layers", "15:30", *node_args]) as tail,
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--ctx", "512"]) as gateway,
        ):
            deadline = time.monotonic() + 60
            while len(httpx.get(f"{tracker.url}/v1/nodes", timeout=10).json()["nodes"]) < 2:
                assert time.monotonic() < deadline, "nodes never registered"
                time.sleep(0.2)
            body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Once upon a time", "max_tokens": 400,
                    "temperature": 0, "stream": True}  # fmt: skip
            error = None
            started = time.monotonic()
            with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
                gid = response.headers["x-meshnet-generation-id"]
                for n, line in enumerate(response.iter_lines()):
                    if n == 10:
                        tail.popen.kill()  # the tail dies mid-decode
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        error = json.loads(line[6:])["error"]
            assert time.monotonic() - started < 30
            assert error is not None and tail.url in error["message"], error  # the failed hop, named
            snapshot = httpx.get(f"{gateway.url}/v1/generations/{gid}", timeout=10).json()
            assert snapshot["phase"] == "failed" and tail.url in snapshot["error"]
            assert head.popen.poll() is None  # the surviving node keeps serving, and freed the session
            health = httpx.get(f"{head.url}/v1/health", timeout=10).json()
            assert health["status"] == "ok" and health["sessions"] == 0
