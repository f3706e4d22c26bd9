"""Chaos over route repair: random ``kill -9`` / ``SIGSTOP`` of random hops at random moments.

A real swarm (tracker, two heads, a middle, a tail, a spare holding every layer but the head's,
and a gateway; one llama.cpp thread per node) serves greedy generations through the official
``openai`` client while faults hit it: a hop of the generation's route (or any node) is killed or
stopped after a random delay — during prefill chunks, between decode steps, during the replay of a
repair when a second fault follows the first — and every killed node is restarted afterwards
(a stopped one is resumed, with whatever stale requests it still had in flight).

Every generation must end **identical to the undisturbed text of its prompt, or failed with a
stated reason**. A different text without an error (``diverged``) or a stream that outlives its
deadline (``hung``) is a defect. The seed is printed first, so any run can be replayed:
``python -m tests.chaos --seed N --generations M``.

Used by ``tests/integration/test_chaos.py`` (a slice in ``make test``) and by ``make chaos``
(hundreds of generations, a section of ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.procs import Proc, meshnet_process

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = (
    "Tell me a long story about a lighthouse keeper.",
    "Explain, step by step, how a river carves a canyon. "
    + " ".join(f"Note {i}: rivers erode rock." for i in range(12)),
    "Write a letter to a friend about learning to bake bread, with many details.",
)
# name -> layers. Two heads (a head can be replaced), the spare stands in for the middle and the tail.
LAYOUT = {"head-a": "0:10", "head-b": "0:10", "mid": "10:20", "tail": "20:30", "spare": "10:30"}
HOP_TIMEOUT_S = 4.0  # a stopped hop is named by the one above it after this long
PREFILL_CHUNK = 16  # several prefill chunks per prompt: faults land between them too
GENERATION_DEADLINE_S = 120.0  # longer than the worst nested hop timeout plus retries: past it, "hung"


@dataclass
class Outcome:
    index: int
    prompt: int
    faults: list[str]
    result: str  # identical | failed | diverged | hung
    detail: str = ""
    retries: list[str] = field(default_factory=list)  # route.retry kinds from telemetry
    seconds: float = 0.0


@dataclass
class Report:
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    @property
    def faults(self) -> int:
        return sum(len(o.faults) for o in self.outcomes)

    @property
    def recoveries(self) -> collections.Counter[str]:
        return collections.Counter(r.split(":")[0] for o in self.outcomes if o.result == "identical" for r in o.retries)

    def summary(self) -> str:
        lines = [
            f"chaos seed {self.seed}: {len(self.outcomes)} generations, {self.faults} faults; "
            f"identical {self.count('identical')}, failed with a reason {self.count('failed')}, "
            f"diverged {self.count('diverged')}, hung {self.count('hung')}; "
            f"recovered by {dict(self.recoveries)}"
        ]
        lines += [
            f"  #{o.index} prompt {o.prompt} faults {o.faults} retries {o.retries}: {o.result.upper()} {o.detail}"
            for o in self.outcomes
            if o.result in ("diverged", "hung")
        ]
        reasons = collections.Counter(o.detail[:120] for o in self.outcomes if o.result == "failed")
        lines += [f"  failed x{n}: {why}" for why, n in reasons.most_common()]
        return "\n".join(lines)


class Swarm:
    """The chaos swarm's processes; nodes can be killed, stopped, resumed and restarted by name."""

    def __init__(self, workdir: Path, *, max_tokens: int, wire_dtype: str = "float32") -> None:
        self.workdir = workdir
        self.max_tokens = max_tokens
        self.wire_dtype = wire_dtype
        self._stack = contextlib.ExitStack()
        self.nodes: dict[str, Proc] = {}
        self._node_stacks: dict[str, contextlib.ExitStack] = {}
        self._lock = threading.Lock()
        self._restarts: list[threading.Thread] = []
        self.tracker: Proc | None = None
        self.gateway: Proc | None = None

    def __enter__(self) -> Swarm:
        try:
            self.tracker = self._stack.enter_context(
                meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{self.workdir}/tracker.db"])
            )
            for name in LAYOUT:
                self._start(name)
            self.wait_registered(set(LAYOUT), 120.0)
            gateway = ["gateway", "--tracker", self.tracker.url, "--port", "0"]
            gateway += ["--prefill-chunk", str(PREFILL_CHUNK), "--hop-timeout", str(HOP_TIMEOUT_S)]
            self.gateway = self._stack.enter_context(meshnet_process(gateway))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for thread in self._restarts:
            thread.join(60)
        for name in list(self._node_stacks):
            self._stop_node(name)
        self._stack.close()
        for name, proc in (("tracker", self.tracker), ("gateway", self.gateway)):
            if proc is not None:
                self._keep_log(name, proc)

    def _keep_log(self, name: str, proc: Proc) -> None:
        """Append a process's output to ``workdir/NAME.log`` (a restarted node's lives go one after another)."""
        with (self.workdir / f"{name}.log").open("a") as log:
            log.write(proc.output())

    # -- nodes -------------------------------------------------------------------------------
    def _start(self, name: str) -> None:
        assert self.tracker is not None
        args = ["node", "--layers", LAYOUT[name], "--node-id", name, "--tracker", self.tracker.url]
        args += ["--threads", "1", "--ctx", "1024", "--session-ttl", "60", "--hop-timeout", str(HOP_TIMEOUT_S)]
        args += ["--wire-dtype", self.wire_dtype]
        stack = contextlib.ExitStack()
        proc = stack.enter_context(meshnet_process(args, ready_timeout_s=120))
        with self._lock:
            self.nodes[name] = proc
            self._node_stacks[name] = stack

    def _stop_node(self, name: str) -> None:
        with self._lock:
            stack = self._node_stacks.pop(name, None)
            proc = self.nodes.pop(name, None)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGINT
        if stack is not None:
            stack.close()
        if proc is not None:
            self._keep_log(name, proc)

    def signal(self, name: str, sig: signal.Signals) -> bool:
        with self._lock:
            proc = self.nodes.get(name)
        if proc is None or proc.popen.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, sig)
        return True

    def heal(self, killed: set[str], stopped: set[str]) -> None:
        """Resume stopped nodes now; restart killed ones in the background (they rejoin when loaded)."""
        for name in stopped - killed:
            self.signal(name, signal.SIGCONT)
        for name in killed:
            self._stop_node(name)
            thread = threading.Thread(target=self._start, args=(name,), daemon=True)
            thread.start()
            self._restarts.append(thread)

    def wait_registered(self, names: set[str], timeout_s: float) -> None:
        """Until every node of ``names`` is registered at its current URL (a killed node's old
        registration stays live until its TTL runs out; its restart re-registers at a new port)."""
        assert self.tracker is not None
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                nodes = httpx.get(f"{self.tracker.url}/v1/nodes", timeout=5).json()["nodes"]
                registered = {(n["node_id"], n["url"]) for n in nodes}
                with self._lock:
                    current = {(name, self.nodes[name].url) for name in names if name in self.nodes}
                if len(current) == len(names) and current <= registered:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(names)} did not all register within {timeout_s:.0f}s")
            time.sleep(0.2)

    def settle(self) -> None:
        """Wait for restarts to finish and every node to be registered, so each generation starts whole."""
        for thread in self._restarts:
            thread.join(120)
        self._restarts.clear()
        self.wait_registered(set(LAYOUT), 60.0)

    # -- generations -------------------------------------------------------------------------
    def route(self, gid: str) -> list[str]:
        assert self.gateway is not None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            data = httpx.get(f"{self.gateway.url}/v1/generations/{gid}", timeout=5).json()
            return [hop["node"] for hop in data["route"]]
        return []

    def retries(self, gid: str) -> list[str]:
        assert self.gateway is not None
        body = httpx.get(f"{self.gateway.url}/v1/generations/{gid}/events", timeout=30).text
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
        return [f"{e['kind']}: {str(e['reason'])[:100]}" for e in events if e["type"] == "route.retry"]

    def generate(self, prompt: str, gid: str) -> str:
        """The streamed text; raises ``openai.APIError`` when the gateway ends the stream with an error."""
        assert self.gateway is not None
        client = openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=GENERATION_DEADLINE_S
        )
        text = ""
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=self.max_tokens, stream=True, extra_headers={"X-Meshnet-Generation-Id": gid},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text


def _run_in_thread(fn: Any, timeout_s: float) -> tuple[bool, Any, BaseException | None]:
    """``(finished, result, error)`` of ``fn()`` run on a thread, waited for at most ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), box.get("result"), box.get("error")


def _faults(
    rng: random.Random, swarm: Swarm, gid: str, span_s: float, over: threading.Event, hit: tuple[set[str], set[str]]
) -> list[str]:
    """One fault at a random moment of the generation's undisturbed span, sometimes a second one soon
    after it (often while the first one's repair or replay is running); none once the generation is
    ``over``. ``hit``: the (killed, stopped) node names, filled in."""
    killed, stopped = hit
    done: list[str] = []
    delay = rng.uniform(0.0, span_s)
    for n in range(2 if rng.random() < 0.3 else 1):
        if over.wait(delay):
            break  # the generation ended first: a fault now would hit nothing
        route = swarm.route(gid)
        candidates = route if route and rng.random() < 0.85 else list(LAYOUT)
        victim = rng.choice(candidates)
        if victim in killed or victim in stopped:
            continue
        sig = signal.SIGSTOP if rng.random() < 0.15 else signal.SIGKILL
        if swarm.signal(victim, sig):
            what = "stop" if sig == signal.SIGSTOP else "kill"
            (stopped if sig == signal.SIGSTOP else killed).add(victim)
            done.append(f"{what} {victim} at +{delay:.2f}s" if n == 0 else f"then {what} {victim} +{delay:.2f}s")
        delay = rng.uniform(0.05, 1.0)
    return done


def run_chaos(swarm: Swarm, *, seed: int, generations: int, budget_s: float | None = None, log: Any = print) -> Report:
    """``generations`` faulted generations on ``swarm``, fewer when ``budget_s`` seconds have passed
    before the next one would start; every outcome classified (see the module doc)."""
    rng = random.Random(seed)
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    log(f"chaos: seed {seed} (replay with --seed {seed})")
    expected: dict[int, str] = {}
    span: dict[int, float] = {}
    for i, prompt in enumerate(PROMPTS):
        began = time.monotonic()
        expected[i] = swarm.generate(prompt, f"chaos-{seed}-baseline-{i}")
        span[i] = time.monotonic() - began
        log(f"chaos: prompt {i} takes {span[i]:.2f}s undisturbed")
    report = Report(seed)
    for index in range(generations):
        if deadline is not None and time.monotonic() > deadline:
            log(f"chaos: time budget of {budget_s:.0f}s spent after {index} generations")
            break
        began = time.monotonic()
        swarm.settle()
        settled = time.monotonic() - began
        which = rng.randrange(len(PROMPTS))
        outcome = _one(swarm, index, which, f"chaos-{seed}-{index}", expected[which], span[which], rng.random())
        report.outcomes.append(outcome)
        log(
            f"chaos #{index}: prompt {which}, {', '.join(outcome.faults) or 'no fault landed'}; "
            f"retries {outcome.retries}; {outcome.result} {outcome.detail[:160]} "
            f"({outcome.seconds:.1f}s, {settled:.1f}s to settle before)"
        )
    return report


def _one(swarm: Swarm, index: int, which: int, gid: str, expected: str, span_s: float, seed: float) -> Outcome:
    """One generation of prompt ``which`` with faults injected while it runs; killed nodes restart after."""
    killed: set[str] = set()
    stopped: set[str] = set()
    faults: list[str] = []
    rng = random.Random(seed)
    over = threading.Event()
    began = time.monotonic()
    injector = threading.Thread(target=lambda: faults.extend(_faults(rng, swarm, gid, span_s, over, (killed, stopped))))
    injector.start()
    finished, text, error = _run_in_thread(lambda: swarm.generate(PROMPTS[which], gid), GENERATION_DEADLINE_S)
    over.set()
    injector.join(10)
    outcome = Outcome(index, which, faults, "identical", seconds=time.monotonic() - began)
    if not finished:
        outcome.result, outcome.detail = "hung", f"no end after {GENERATION_DEADLINE_S:.0f}s"
    elif error is not None:
        outcome.result, outcome.detail = "failed", f"{type(error).__name__}: {error}"
        if not str(error).strip():
            outcome.result = "diverged"  # an error without a reason is not a stated failure
    elif text != expected:
        cut = next((k for k, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), None)
        outcome.result = "diverged"
        outcome.detail = f"differs at character {cut}: {text[max(0, (cut or 0) - 20) :][:80]!r}"
    with contextlib.suppress(httpx.HTTPError, ValueError):
        outcome.retries = swarm.retries(gid)
    swarm.heal(killed, stopped)
    return outcome


@contextlib.contextmanager
def chaos_swarm(workdir: Path | None = None, *, max_tokens: int = 48, wire_dtype: str = "float32") -> Iterator[Swarm]:
    with contextlib.ExitStack() as stack:
        path = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshnet-chaos-")))
        yield stack.enter_context(Swarm(path, max_tokens=max_tokens, wire_dtype=wire_dtype))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    parser.add_argument("--generations", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--wire-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--workdir", type=Path, help="keep the swarm's logs here (default: a temp dir)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    with chaos_swarm(args.workdir, max_tokens=args.max_tokens, wire_dtype=args.wire_dtype) as swarm:
        report = run_chaos(swarm, seed=seed, generations=args.generations)
    print(report.summary())
    return 1 if report.count("diverged") or report.count("hung") else 0


if __name__ == "__main__":
    sys.exit(main())
