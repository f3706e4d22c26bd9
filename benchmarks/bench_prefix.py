"""Prefix caching: time to first token of a conversation's second turn (~1,500 tokens of history)
÷ its first turn, on a three-node route.

Swarm: tracker, head 0:10, middle 10:20, tail 20:30, gateway — open swarm on loopback, one
llama.cpp thread per node. Each round is a fresh conversation (its system prompt starts with the
round number, so no round finds another's blocks): turn 1 sends a ~1,500-token system prompt and a
question, turn 2 resends all of it with the answer and a follow-up. Both are streamed; TTFT is
from the request to the first text chunk. The baseline, measured in the same rounds: turn 1 itself
(a cold prefill of ~1,500 tokens) and a turn 2 whose first token differs from the history's (the
same length, nothing to reuse).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time

import httpx
from tests.procs import meshnet_process

from benchmarks.common import Section, median, wait_registered

MODEL = "SmolLM2-135M-Instruct.Q4_1"
FACTS = " ".join(f"Fact {i}: the shelf in room {i % 9} holds {i * 7 % 23} jars of honey." for i in range(85))
ROUNDS = 3


def _turn(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int, int]:
    """(time to first text chunk, the text, prompt tokens, cached tokens) of one streamed chat turn."""
    body = {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    began = time.perf_counter()
    first, text, usage = 0.0, "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter() - began
                text += delta
    return first, text, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def run() -> Section:
    section = Section(
        "Prefix caching: a conversation's second turn (~1.5K tokens of history) ÷ its first",
        "python benchmarks/run.py --only prefix  (tracker, 3 nodes 0:10/10:20/20:30, gateway; 1 llama.cpp "
        f"thread per node; median of {ROUNDS} conversations)",
    )
    turn1_s, warm_s, cold_s, cached, prompt = [], [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tracker = stack.enter_context(meshnet_process(["tracker", "--port", "0", "--db", f"sqlite:///{tmp}/t.db"]))
        args = ["--threads", "1", "--tracker", tracker.url, "--ctx", "8192"]
        for layers in ("0:10", "10:20", "20:30"):
            stack.enter_context(meshnet_process(["node", "--layers", layers, *args]))
        wait_registered(tracker.url, 3)
        gateway = stack.enter_context(meshnet_process(["gateway", "--tracker", tracker.url, "--port", "0"]))
        _turn(gateway.url, [{"role": "user", "content": "Hello."}], 4)  # warm every process up
        for i in range(ROUNDS):
            history = [{"role": "system", "content": f"Conversation {i}. {FACTS}"},
                       {"role": "user", "content": "How many jars are in room 4?"}]  # fmt: skip
            seconds, answer, prompt, _ = _turn(gateway.url, history, 16)
            turn1_s.append(seconds)
            follow = [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": "And room 5?"}]
            seconds, _, _, reused = _turn(gateway.url, follow, 8)
            warm_s.append(seconds)
            cached.append(reused)
            other = [{"role": "system", "content": f"Dialogue {i}. {FACTS}"}, *follow[1:]]  # nothing to reuse
            seconds, _, _, reused = _turn(gateway.url, other, 8)
            if reused:
                raise RuntimeError(f"the baseline turn found {reused} cached tokens")
            cold_s.append(seconds)
    ratio = median(warm_s) / median(turn1_s)
    section.add("turn 1: prompt tokens", f"{prompt}")
    section.add("turn 1 TTFT (cold prefill)", f"{median(turn1_s):.3f} s")
    section.add(
        "turn 2 TTFT, history from the prefix caches", f"{median(warm_s):.3f} s ({median(cached):.0f} tokens cached)"
    )
    section.add("turn 2 TTFT, nothing cached (baseline)", f"{median(cold_s):.3f} s")
    section.add("turn 2 ÷ turn 1", f"{ratio:.3f}", "≤ 0.2", ratio <= 0.2)
    section.add("turn 2 cached ÷ turn 2 cold", f"{median(warm_s) / median(cold_s):.3f}")
    section.notes += [
        "Turn 2 reuses every whole 128-token block of turn 1's prompt on every hop (exact: each block was "
        "computed as one aligned chunk, as a cold prefill computes it) and prefills the rest: turn 1's last "
        "partial block, its answer and the follow-up question.",
        "The cost left: one prefix request down the route, each node copying its layers' KV of the cached "
        "blocks into the new session, and the prefill of the uncached tail.",
    ]
    return section
