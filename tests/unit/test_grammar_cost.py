"""A grammar's cost is bounded, not its bytes: the gateway's measured check on the bundled model's real
vocabulary (``check_grammar_cost``), and a tail's sampling off the event loop under a per-token deadline
(``node.sampling_lane``)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.grammar import (
    JSON_OBJECT_GRAMMAR,
    GrammarCancelled,
    check_grammar_cost,
    json_schema_grammar,
)
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.errors import InvalidRequest, Overloaded
from meshnet.gateway.tools import ToolPlan, parse_functions
from meshnet.node.sampling_lane import SamplingLane, SamplingTooSlow
from meshnet.sampling import MAX_GRAMMAR_BYTES, Sampler, SamplingParams

# The attack of issue #28: 9,000 identical alternatives, under the byte cap; one check of the
# vocabulary under it takes minutes.
BOMB = "root ::= " + " | ".join(['"ab"'] * 9000)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4,8}$"},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                  "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}, "maxItems": 10},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "note": {"type": ["string", "null"]},
        "total": {"type": "number"},
    },
    "required": ["id", "items", "status"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def vocab() -> Iterator[LlamaVocab]:
    v = LlamaVocab(bundled_gguf())
    yield v
    v.close()


def test_the_9000_alternative_bomb_is_refused_fast_naming_grammar(vocab: LlamaVocab) -> None:
    assert len(BOMB.encode()) <= MAX_GRAMMAR_BYTES  # the byte cap lets it through
    began = time.monotonic()
    with pytest.raises(InvalidRequest) as info:
        check_grammar_cost(lambda: vocab.grammar(BOMB), param="grammar")
    # compile (~0.1 s) plus a check that stops at its limit, not the minutes a full step takes
    assert time.monotonic() - began < 10
    assert info.value.param == "grammar" and info.value.code == "grammar_too_costly"
    assert "too costly" in info.value.message


def test_a_grammar_cheap_at_its_start_and_costly_after_it_is_refused(vocab: LlamaVocab) -> None:
    """The check walks a few allowed tokens in: the bomb behind a one-token prefix is found too."""
    behind = 'root ::= "{" bomb\nbomb ::= ' + " | ".join(['"ab"'] * 5000)
    with pytest.raises(InvalidRequest) as info:
        check_grammar_cost(lambda: vocab.grammar(behind), param="response_format")
    assert info.value.param == "response_format"


def test_realistic_schemas_and_tool_grammars_pass(vocab: LlamaVocab) -> None:
    functions = parse_functions([WEATHER, ADD])
    grammars = {
        "json_object": JSON_OBJECT_GRAMMAR,
        "order schema": json_schema_grammar(ORDER, param="response_format"),
        "enum of 100": json_schema_grammar({"enum": [f"choice {i}" for i in range(100)]}, param="response_format"),
        "yes/no": 'root ::= ("yes" | "no") ", because " [a-z ]{1,60} "."',
        "100 alternatives": "root ::= " + " | ".join(['"ab"'] * 100),
    }
    for style in ("generic", "native"):
        for choice in ("auto", "required", "function:add"):
            text = ToolPlan(functions, choice, style).grammar()  # type: ignore[arg-type]
            if text:
                grammars[f"tools {style} {choice}"] = text
    refused = []
    for name, text in grammars.items():
        try:
            check_grammar_cost(functools.partial(vocab.grammar, text), param="grammar")
        except InvalidRequest as exc:
            refused.append((name, exc.message))
    assert not refused


def test_a_parse_error_stays_the_parsers_400(vocab: LlamaVocab) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_grammar_cost(lambda: vocab.grammar("root ::= missing"), param="grammar")
    assert info.value.param == "grammar" and "rejected the grammar" in info.value.message


def test_a_cancelled_check_of_the_vocabulary_stops_within_a_chunk(vocab: LlamaVocab) -> None:
    grammar = vocab.grammar(BOMB)
    logits = np.zeros(vocab.info.n_vocab, dtype=np.float32)
    failed: list[BaseException] = []

    def mask() -> None:
        try:
            grammar.mask(logits)
        except GrammarCancelled as exc:
            failed.append(exc)

    worker = threading.Thread(target=mask)
    worker.start()
    time.sleep(0.3)
    grammar.cancel()
    stopped = time.monotonic()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - stopped < 10  # a full mask takes minutes
    assert failed and failed[0].code == "grammar_too_costly"  # type: ignore[attr-defined]


async def _ticks(stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        began = time.monotonic()
        await asyncio.sleep(0.01)
        out.append(time.monotonic() - began)


def test_the_deadline_fails_one_generation_and_the_loop_goes_on(vocab: LlamaVocab) -> None:
    """A bomb's sampling step on a tail: its generation fails past the deadline, the loop never waits
    on it, another session samples meanwhile, and the bomb's thread stops soon after (cancelled)."""
    lane = SamplingLane(0.5)
    bomb = Sampler(SamplingParams(temperature=1.0, seed=1, grammar=BOMB), vocab.grammar(BOMB))
    plain = Sampler(SamplingParams(temperature=0.0))
    logits = np.random.default_rng(0).standard_normal(vocab.info.n_vocab).astype(np.float32)

    async def scenario() -> tuple[float, list[float], int]:
        stop, gaps = asyncio.Event(), []
        ticker = asyncio.ensure_future(_ticks(stop, gaps))
        began = time.monotonic()
        assert bomb.grammar is not None
        attack = asyncio.ensure_future(
            lane.run(lambda: bomb.sample(logits, position=0), grammar=True, cancel=bomb.grammar.cancel)
        )
        token, _ = await lane.run(lambda: plain.sample(logits, position=0), grammar=False)
        with pytest.raises(SamplingTooSlow) as info:
            await attack
        failed_after = time.monotonic() - began
        assert info.value.param == "grammar" and info.value.code == "grammar_too_costly"
        for _ in range(200):  # the runaway step was told to stop: its thread is free again soon
            if not lane.running_late:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await ticker
        return failed_after, gaps, token

    failed_after, gaps, token = asyncio.run(scenario())
    assert token == int(np.argmax(logits))
    assert 0.5 <= failed_after < 5
    assert max(gaps) < 0.4, max(gaps)  # the loop kept ticking while the bomb sampled
    assert lane.running_late == 0
    lane.close()


def test_grammar_steps_past_their_deadline_never_hold_up_other_sampling() -> None:
    """When every grammar thread still runs a late step, another grammar step is a 503 at once, and
    sampling without a grammar goes on."""
    lane = SamplingLane(0.1, grammar_threads=1)
    release = threading.Event()

    async def scenario() -> None:
        with pytest.raises(SamplingTooSlow):
            await lane.run(lambda: release.wait(10), grammar=True)
        assert lane.running_late == 1
        with pytest.raises(Overloaded):
            await lane.run(lambda: 1, grammar=True)
        assert await lane.run(lambda: 2, grammar=False) == 2
        release.set()
        for _ in range(100):
            if not lane.running_late:
                break
            await asyncio.sleep(0.02)
        assert await lane.run(lambda: 3, grammar=True) == 3

    asyncio.run(scenario())
    lane.close()


def test_a_stopping_lane_tells_its_steps_to_stop_and_says_whether_any_still_runs() -> None:
    """Before a node frees its model (and with it the vocabulary a grammar step reads), its lane tells
    every running grammar step to stop and waits for them: ``stop`` says whether none runs any more.
    A step that does not stop in time keeps the model loaded (the node's shutdown, ``node.app``)."""
    lane = SamplingLane(5.0)
    told = threading.Event()

    async def stops_when_told() -> bool:
        step = asyncio.ensure_future(lane.run(lambda: told.wait(10), grammar=True, cancel=told.set))
        await asyncio.sleep(0.05)  # running on its thread
        stopped = await lane.stop(timeout_s=5)
        assert await step is True
        return stopped

    assert asyncio.run(stops_when_told()) is True
    lane = SamplingLane(5.0)
    release = threading.Event()

    async def ignores_it() -> bool:
        step = asyncio.ensure_future(lane.run(lambda: release.wait(10), grammar=True, cancel=lambda: None))
        await asyncio.sleep(0.05)
        stopped = await lane.stop(timeout_s=0.2)
        release.set()
        await step
        return stopped

    assert asyncio.run(ignores_it()) is False


def test_the_deadline_counts_from_the_last_token_a_step_decided() -> None:
    """A step deciding 17 tokens (a verify chunk of 16 drafts) gets ``deadline_s`` for each: one token
    that stalls fails it a deadline after the token before it, not at 17 deadlines; a step whose
    tokens each come within the deadline finishes even when the whole takes several deadlines."""
    lane = SamplingLane(0.2)
    clock = {"at": 0.0}

    def step(gaps: list[float]) -> int:
        for gap in gaps:
            time.sleep(gap)
            clock["at"] = time.monotonic()
        return len(gaps)

    async def scenario() -> float:
        decided = await lane.run(lambda: step([0.1] * 6), tokens=17, grammar=True, progress=lambda: clock["at"])
        assert decided == 6  # 0.6 s in all, no gap over 0.2 s
        began = time.monotonic()
        with pytest.raises(SamplingTooSlow) as info:
            await lane.run(lambda: step([0.05, 0.05, 3.0]), tokens=17, grammar=True, progress=lambda: clock["at"])
        assert "0.2 s a token" in str(info.value)
        return time.monotonic() - began

    failed_after = asyncio.run(scenario())
    assert 0.25 <= failed_after < 1.5, failed_after  # 17 x 0.2 = 3.4 s before the per-token clock
    lane.close()


def test_a_verify_chunk_reaching_a_hidden_bomb_fails_a_deadline_after_its_last_draft(vocab: LlamaVocab) -> None:
    """Issue #28's bomb behind a literal, met inside a verify chunk whose drafts are the literal (what
    prompt lookup sends): the real grammar's ``accepted_at`` restarts the clock at each draft kept, so
    the step fails a deadline after the last one, not at a deadline for each of the chunk's tokens."""
    hidden = 'root ::= "' + " hello" * 10 + '" bomb\nbomb ::= ' + " | ".join(['"ab"'] * 9000)
    drafts = vocab.tokenize(" hello" * 10, add_special=False)
    grammar = vocab.grammar(hidden)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3, grammar=hidden), grammar)
    rows = np.full((len(drafts) + 1, vocab.info.n_vocab), -10.0, dtype=np.float32)
    rows[np.arange(len(drafts)), drafts] = 10.0  # the model agrees with every draft...
    rows[-1, 0] = 10.0  # ...and then wants a token the bomb refuses: its whole-vocabulary check runs
    lane = SamplingLane(0.5)

    async def scenario() -> float:
        began = time.monotonic()
        with pytest.raises(SamplingTooSlow):
            await lane.run(lambda: sampler.verify(rows, drafts, position=0), tokens=1 + len(drafts), grammar=True,
                           cancel=grammar.cancel, progress=lambda: grammar.accepted_at)  # fmt: skip
        failed_after = time.monotonic() - began
        # the runaway step was told to stop: wait for its thread, which still uses the vocabulary the
        # module's fixture frees after the last test (freed under it, llama.cpp aborts the process)
        for _ in range(1200):
            if not lane.running_late:
                break
            await asyncio.sleep(0.05)
        return failed_after

    failed_after = asyncio.run(scenario())
    assert lane.running_late == 0, "the cancelled step never stopped"
    assert grammar.accepted == drafts  # every draft was kept before the bomb
    assert failed_after < 0.5 * len(drafts), failed_after  # the old per-chunk limit: 0.5 s x (drafts + 1)
    lane.close()
