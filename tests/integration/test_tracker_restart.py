"""kill -9 of the tracker during a load of concurrent generations, then a restart on the same port.

In-flight generations keep going (nodes hold their sessions; the gateway needs the tracker only
to open a route and to deliver billing), a request that needed a route while it was down fails
with a clear 503, nodes re-register by themselves, and not one completed generation's billing
record is lost — on SQLite and on a real PostgreSQL server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.postgres import postgres_server
from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
N_REQUESTS = 8


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/tracker.db"
    else:
        with postgres_server() as url:
            yield url


def generate(gateway: Proc, i: int) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": f"Tell me fact number {i} about rivers.", "max_tokens": 24, "temperature": 0}
    gid = f"gen-load-{i}"
    try:
        r = httpx.post(
            f"{gateway.url}/v1/completions", json=body, headers={"X-Meshnet-Generation-Id": gid}, timeout=180
        )
    except httpx.HTTPError:
        return gid, 0
    return gid, r.status_code


def wait_nodes(tracker_url: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if len(httpx.get(f"{tracker_url}/v1/nodes", timeout=5).json()["nodes"]) >= want:
                return
        time.sleep(0.2)
    raise AssertionError(f"{want} nodes did not register with {tracker_url} within {timeout_s}s")


def test_kill_9_of_the_tracker_under_load_loses_no_completed_billing_record(db_url: str) -> None:
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", db_url]))
        port = tracker.url.rsplit(":", 1)[1]
        args = ["--threads", "1", "--tracker", tracker.url, "--ctx", "1024"]
        for layers in ("0:10", "10:20", "20:30"):
            stack.enter_context(meshnet_process(["node", "--layers", layers, *args]))
        wait_nodes(tracker.url, 3, 60)
        gateway = stack.enter_context(
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--ctx", "1024"])
        )
        with concurrent.futures.ThreadPoolExecutor(N_REQUESTS) as pool:
            futures = [pool.submit(generate, gateway, i) for i in range(N_REQUESTS)]
            time.sleep(1.5)  # some generations are decoding, some still queued for a slot
            tracker.popen.kill()
            tracker.popen.wait(10)
            time.sleep(1.0)
            restarted = stack.enter_context(meshnet_process(["tracker", "--port", port, "--db", db_url]))
            results = [f.result(timeout=300) for f in futures]
        statuses = [status for _, status in results]
        assert set(statuses) <= {200, 503}, statuses  # done, or refused clearly while it was down
        completed = [gid for gid, status in results if status == 200]
        assert completed, statuses
        sessions = {
            httpx.get(f"{gateway.url}/v1/generations/{gid}", timeout=10).json()["session_id"] for gid in completed
        }
        deadline = time.monotonic() + 90  # the gateway's outbox retries until the tracker is back
        while True:
            data = httpx.get(f"{restarted.url}/v1/billing", params={"limit": 1000}, timeout=10).json()
            billed = {r["session_id"] for r in data["records"]}
            if sessions <= billed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sessions <= billed, f"completed generations without billing records: {sessions - billed}"
        for sid in sessions:
            layers = sorted(r["layers"] for r in data["records"] if r["session_id"] == sid)
            assert layers == ["0:10", "10:20", "20:30"]
        wait_nodes(restarted.url, 3, 30)  # the nodes re-registered by themselves
        after = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                           timeout=120)  # fmt: skip
        assert after.status_code == 200, after.text
