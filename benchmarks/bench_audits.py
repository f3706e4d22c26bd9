"""Audit sampling: what re-executing sessions costs, and false positives over many honest sessions.

Swarm: tracker, head 0:15 (1 llama.cpp thread), tail 15:30 (2 threads), an auditor of each range
with the other thread count (``meshnet node --auditor``), and a gateway auditing every session
(``--audit-rate 1``). ``SESSIONS`` short completions of varied prompts and sampling (greedy,
seeded and unseeded temperatures, penalties) run from two clients at once (their sessions interleave
on the nodes); every hop of every session is re-executed and judged bit for bit, by auditors running
another thread count, each position in the chunk the hop computed it in (a greedy session's verify
chunks, which a node computes in one call where it measured that exact, as one-position chunks).

Compute is CPU seconds (user + system) of the processes, read from /proc: the two auditors' against
the two serving nodes' over the same run. At ``--audit-rate R`` audits cost R times the measured
ratio (each session is audited or not, independently). Detection per lie is measured by
tests/integration/test_audits.py (every lie caught on its first audited session); at rate R a
liar that lies on every session escapes N sessions with probability (1 - R)^N.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import tempfile
import time

import httpx
import psutil
from tests.procs import Proc, meshnet_process, start_together

from benchmarks.common import Section, wait_registered
from meshnet.protocol.audits import PROBABILITY_TOLERANCE, RESIDUAL_TOLERANCE

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SESSIONS = 500
ACROSS_SESSIONS = 60
DETECT_RATE = 0.1
TRIALS = 8
CLIENTS = 2  # concurrent sessions
RATE = 0.05
SUBJECTS = ["rivers", "mountains", "planets", "colors", "metals", "birds", "trees", "languages", "oceans", "stars"]
SAMPLING = [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 1},
    {"temperature": 0.7},
    {"temperature": 0.8, "seed": 2, "presence_penalty": 0.4, "frequency_penalty": 0.2},
]


def _serve(url: str, lane: int) -> None:
    """Every ``CLIENTS``-th session, from one client."""
    with httpx.Client(timeout=120) as client:
        for i in range(lane, SESSIONS, CLIENTS):
            prompt = f"List {2 + i % 5} {SUBJECTS[i % len(SUBJECTS)]}, number {i}:"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6 + i % 7, **SAMPLING[i % len(SAMPLING)]}
            response = client.post(f"{url}/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"session {i}: {response.status_code} {response.text}")


def _cpu(proc: Proc) -> float:
    times = psutil.Process(proc.popen.pid).cpu_times()
    return float(times.user + times.system)


def _audits(gateway: str, want: int) -> dict[str, object]:
    deadline = time.monotonic() + 600
    while True:
        answer = httpx.get(f"{gateway}/v1/audits", params={"limit": "1"}, timeout=10).json()
        counts = answer["counts"]
        if sum(counts.values()) >= want:
            return dict(answer)
        if time.monotonic() > deadline:
            raise RuntimeError(f"audits stalled at {counts} of {want}")
        time.sleep(0.5)


def _across(section: Section) -> None:
    """Auditors of another numerics class (the PyTorch reference backend): the deviations honest hops
    show, against the tolerances (protocol.audits), over ``ACROSS_SESSIONS`` sessions."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp}/t.db"]))
        common = ["--tracker", tracker.url, "--ctx", "512", "--max-sessions", "2"]
        for name, layers, auditor in [("head", "0:15", []), ("tail", "15:30", []),
                                      ("audit-head", "0:15", ["--auditor", "--backend", "torch"]),
                                      ("audit-tail", "15:30", ["--auditor", "--backend", "torch"])]:  # fmt: skip
            stack.enter_context(meshnet_process(["node", "--layers", layers, "--node-id", name, *common, *auditor]))
        wait_registered(tracker.url, 4)
        gateway = stack.enter_context(
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--audit-rate", "1"])
        )
        with httpx.Client(timeout=120) as client:
            for i in range(ACROSS_SESSIONS):
                prompt = f"List {2 + i % 5} {SUBJECTS[i % len(SUBJECTS)]}, number {i}:"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, **SAMPLING[i % len(SAMPLING)]}
                client.post(f"{gateway.url}/v1/completions", json=body).raise_for_status()
        _audits(gateway.url, 2 * ACROSS_SESSIONS)
        found = httpx.get(f"{gateway.url}/v1/audits", params={"limit": "1000"}, timeout=10).json()["audits"]
    worst = {node: max((a["deviation"] or 0.0) for a in found if a["node_id"] == node) for node in ("head", "tail")}
    fails = sum(a["verdict"] == "fail" for a in found)
    section.add(f"across classes (PyTorch auditors), {ACROSS_SESSIONS} honest sessions: failed", str(fails), "0",
                fails == 0)  # fmt: skip
    section.add("across classes: largest honest deviation, head residual updates (tolerance "
                f"{RESIDUAL_TOLERANCE})", f"{worst['head']:.3f}")  # fmt: skip
    section.add(f"across classes: largest honest deviation, tail probabilities (tolerance {PROBABILITY_TOLERANCE})",
                f"{worst['tail']:.3f}")  # fmt: skip


def _detection(section: Section) -> None:
    """A head that adds noise (1e-3 of a row's RMS) to everything it sends, at ``--audit-rate
    DETECT_RATE``: sessions served until its first failed audit, over ``TRIALS`` trials (its
    suspension lifted after each). Sessions are audited independently, so the count is geometric
    with mean 1 / rate."""
    found: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp}/t.db"]))
        common = ["--tracker", tracker.url, "--ctx", "512", "--max-sessions", "2"]
        liar = [sys.executable, "-m", "tests.liar_node"]
        head = ["node", "--layers", "0:15", "--node-id", "head", *common]
        tail = ["node", "--layers", "15:30", "--node-id", "tail", *common]
        auditors = [["node", "--layers", r, "--node-id", f"audit-{n}", "--auditor", *common]
                    for n, r in (("head", "0:15"), ("tail", "15:30"))]  # fmt: skip
        gateway_args = ["gateway", "--tracker", tracker.url, "--port", "0", "--audit-rate", str(DETECT_RATE)]
        starting = {
            "head": meshnet_process(["noise:1e-3", "--", *head], command=liar),
            "tail": meshnet_process(tail),
            **{f"audit-{i}": meshnet_process(args) for i, args in enumerate(auditors)},
            "gateway": meshnet_process(gateway_args),
        }  # fmt: skip
        gateway = start_together(stack, starting)["gateway"]
        wait_registered(tracker.url, 4)
        with httpx.Client(timeout=120) as client:
            for _ in range(TRIALS):
                found.append(_sessions_until_caught(client, gateway.url, tracker.url))
    mean = sum(found) / len(found)
    section.add(f"a liar (noise 1e-3) at --audit-rate {DETECT_RATE}: sessions until its first failed audit, "
                f"mean of {TRIALS} trials", f"{mean:.1f} (each: {', '.join(map(str, found))})",
                f"about 1 / rate = {1 / DETECT_RATE:.0f}")  # fmt: skip


def _sessions_until_caught(client: httpx.Client, gateway: str, tracker: str) -> int:
    """Sessions until the head is suspended (a session then finds no route), counted up to the failed
    audit's own session; the suspension is lifted afterwards."""
    sessions: list[str] = []
    for i in range(2000):
        body = {"model": MODEL, "prompt": f"Say {i}:", "max_tokens": 4, "temperature": 0}
        response = client.post(f"{gateway}/v1/completions", json=body)
        if response.status_code == 503:
            query = {"node_id": "head", "verdict": "fail", "limit": "1"}
            failed = client.get(f"{tracker}/v1/audits", params=query).json()["audits"]
            if failed and failed[0]["session_id"] in sessions:
                client.delete(f"{tracker}/v1/suspensions/head").raise_for_status()
                return sessions.index(failed[0]["session_id"]) + 1
            time.sleep(0.5)  # the last trial's suspension, lifted a moment ago: not yet off the routes
            continue
        response.raise_for_status()
        gid = response.headers["x-meshnet-generation-id"]
        sessions.append(client.get(f"{gateway}/v1/generations/{gid}").json()["session_id"])
    raise RuntimeError(f"the lying head was not caught in {len(sessions)} sessions")


def run() -> Section:
    section = Section(
        "Audit sampling: audit compute and false positives (honest swarm)",
        f"python benchmarks/run.py --only audits  ({SESSIONS} sessions at --audit-rate 1 from {CLIENTS} clients; "
        "head 1 thread, tail 2, each auditor the other count)",
    )
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp}/t.db"]))
        common = ["--tracker", tracker.url, "--ctx", "512", "--max-sessions", "2"]
        serving, auditing = [], []
        nodes = [("head", "0:15", "1", False), ("tail", "15:30", "2", False),
                 ("audit-head", "0:15", "2", True), ("audit-tail", "15:30", "1", True)]  # fmt: skip
        for name, layers, threads, auditor in nodes:
            args = ["node", "--layers", layers, "--node-id", name, "--threads", threads, *common]
            proc = stack.enter_context(meshnet_process([*args, *(["--auditor"] if auditor else [])]))
            (auditing if auditor else serving).append(proc)
        wait_registered(tracker.url, 4)
        gateway = stack.enter_context(
            meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0", "--audit-rate", "1"])
        )
        serve_before, audit_before = sum(map(_cpu, serving)), sum(map(_cpu, auditing))
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(lambda lane: _serve(gateway.url, lane), range(CLIENTS)))
        served_s = time.perf_counter() - began
        answer = _audits(gateway.url, 2 * SESSIONS)
        serve_cpu = sum(map(_cpu, serving)) - serve_before
        audit_cpu = sum(map(_cpu, auditing)) - audit_before
        kept = httpx.get(f"{tracker.url}/v1/audits", params={"limit": "1000", "verdict": "fail"}, timeout=10).json()
    counts = answer["counts"]
    assert isinstance(counts, dict)
    ratio = audit_cpu / serve_cpu
    section.add("sessions served (and audited)", f"{SESSIONS} in {served_s:.0f} s")
    section.add("hops audited: pass / fail / skipped",
                f"{counts.get('pass', 0)} / {counts.get('fail', 0)} / {counts.get('skipped', 0)}")  # fmt: skip
    section.add("false positives (honest hops failed)", str(counts.get("fail", 0)), "0", counts.get("fail", 0) == 0)
    section.add("tracker's failed audits", str(len(kept["audits"])), "0", not kept["audits"])
    section.add("auditors' CPU ÷ serving nodes' CPU, every session audited", f"{ratio:.2f}")
    section.add(f"audit compute ÷ serving compute at --audit-rate {RATE}", f"{RATE * ratio:.3f}", "report")
    _across(section)
    _detection(section)
    section.notes += [
        "Every session was audited here (rate 1) to count false positives over many honest audits; the cost at "
        f"rate {RATE} is that ratio times {RATE}: sessions are picked independently.",
        "An audit re-executes each hop's layers once, in the session's own chunks, so its compute is about "
        "the session's own (prefill dominates these short sessions; decode steps re-execute as one-position "
        "chunks); the auditors also serve the seam-log checks and sign their statements.",
        "Detection: a hop that lies on every position fails every audit it is in (tests/integration/"
        "test_audits.py: noise down to 1e-6 of a row's RMS, bfloat16 rounding, a skipped layer, a tail "
        f"committing a distribution its layers do not give); at rate {RATE} it escapes N sessions with "
        f"probability {1 - RATE:.2f}^N (0.006 over 100 sessions).",
        "Across numerics classes (an auditor of another backend or build) the comparison is within a tolerance, "
        "not by equality: lies smaller than the two classes' own difference (noise of 1e-3 of a row's RMS) pass "
        "there; a skipped layer and noise of 1e-1 fail (tests/integration/test_audits.py). Same-class auditors "
        "are preferred.",
    ]
    return section
