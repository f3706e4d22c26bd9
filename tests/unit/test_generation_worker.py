"""StopMatcher and run_worker, driven by the deterministic FakeEngine."""

from __future__ import annotations

import threading

from meshnet.backends.base import PrefillProgress
from meshnet.backends.fake import EOS, FakeEngine
from meshnet.errors import InvalidRequest
from meshnet.gateway.generation import Delta, Failed, Finished, GenerationRequest, StopMatcher, run_worker
from meshnet.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


# -- StopMatcher --------------------------------------------------------------------------------
def test_no_stops_passes_everything_through():
    m = StopMatcher([])
    assert m.feed("Hello") == ("Hello", False)
    assert m.feed(", world") == (", world", False)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored():
    m = StopMatcher(["", ""])
    assert m.feed("abc") == ("abc", False)


def test_partial_prefix_is_held_back_then_released():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    # "ENx" can no longer become "END": all held text comes out.
    assert m.feed("x") == ("ENx", False)
    assert m.flush() == ""


def test_full_match_across_feeds_cuts_at_the_match():
    m = StopMatcher(["STOP"])
    assert m.feed("one S") == ("one ", False)
    assert m.feed("TO") == ("", False)
    assert m.feed("P and more") == ("", True)


def test_match_inside_one_feed_cuts_before_it():
    m = StopMatcher(["\n\n"])
    assert m.feed("line one\n\nline two") == ("line one", True)


def test_first_match_wins_among_several_stops():
    m = StopMatcher(["zz", "b"])
    assert m.feed("a") == ("a", False)
    assert m.feed("zbzz") == ("z", True)  # "b" at 1 precedes "zz" at 2 in "zbzz"
    m = StopMatcher(["world", "o"])
    assert m.feed("hello world") == ("hell", True)


def test_longest_possible_prefix_is_held_for_several_stops():
    m = StopMatcher(["abc", "bcd"])
    assert m.feed("xab") == ("x", False)  # "ab" may begin "abc"
    assert m.feed("c") == ("", True)


def test_repeated_prefix_characters():
    m = StopMatcher(["ab"])
    assert m.feed("a") == ("", False)
    assert m.feed("a") == ("a", False)
    assert m.feed("b") == ("", True)


def test_flush_returns_held_text_once():
    m = StopMatcher(["<|end|>"])
    assert m.feed("done <|e") == ("done ", False)
    assert m.flush() == "<|e"
    assert m.flush() == ""


# -- run_worker ----------------------------------------------------------------------------------
def _run(
    engine: FakeEngine,
    *,
    prompt: str = "hi",
    max_tokens: int = 100,
    stop: tuple[str, ...] = (),
    sampling: SamplingParams = GREEDY,
    cancel: threading.Event | None = None,
    on_report=None,
) -> list[object]:
    reports: list[object] = []

    def report(item: object) -> None:
        reports.append(item)
        if on_report is not None:
            on_report(item, reports)

    request = GenerationRequest(
        prompt_tokens=tuple(engine.tokenize(prompt, add_special=True)),
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
    )
    run_worker(engine, request, cancel or threading.Event(), report)
    return reports


def _text(reports: list[object]) -> str:
    parts = [r.text for r in reports if isinstance(r, Delta)]
    parts += [r.text for r in reports if isinstance(r, Finished)]
    return "".join(parts)


def _finished(reports: list[object]) -> Finished:
    assert isinstance(reports[-1], Finished)
    assert sum(isinstance(r, Finished | Failed) for r in reports) == 1
    return reports[-1]


def test_prefill_progress_comes_first_and_covers_the_prompt():
    engine = FakeEngine(reply="ok", prefill_chunk=4)
    reports = _run(engine, prompt="0123456789")  # 11 tokens with BOS
    progress = [r for r in reports if isinstance(r, PrefillProgress)]
    assert [p.done for p in progress] == [4, 8, 11]
    assert all(p.total == 11 for p in progress)
    first_delta = next(i for i, r in enumerate(reports) if isinstance(r, Delta))
    assert all(isinstance(r, PrefillProgress) for r in reports[:first_delta])
    assert engine.prefill_calls == 1


def test_eos_finishes_with_stop():
    engine = FakeEngine(reply="Hello")
    reports = _run(engine)
    fin = _finished(reports)
    assert fin.finish_reason == "stop"
    assert fin.text == ""
    deltas = [r for r in reports if isinstance(r, Delta)]
    assert [d.token for d in deltas] == list(b"Hello")
    assert "".join(d.text for d in deltas) == "Hello"
    assert all(d.token != EOS for d in deltas)
    assert all(d.logprob <= 0.0 for d in deltas)


def test_max_tokens_finishes_with_length():
    engine = FakeEngine(reply="Hello world")
    reports = _run(engine, max_tokens=5)
    fin = _finished(reports)
    assert fin.finish_reason == "length"
    assert sum(isinstance(r, Delta) for r in reports) == 5
    assert _text(reports) == "Hello"


def test_running_out_of_context_finishes_with_length():
    engine = FakeEngine(reply="a long reply that will not fit", n_ctx=8)
    reports = _run(engine, prompt="abc")  # 4 prompt tokens: room for 4 more
    fin = _finished(reports)
    assert fin.finish_reason == "length"
    assert _text(reports) == "a lo"


def test_stop_string_cuts_the_text():
    engine = FakeEngine(reply="Hello world, bye")
    reports = _run(engine, stop=("world",))
    fin = _finished(reports)
    assert fin.finish_reason == "stop"
    assert fin.text == ""
    assert _text(reports) == "Hello "
    # The engine was not asked for tokens past the stop string.
    assert sum(isinstance(r, Delta) for r in reports) == len("Hello world")


def test_unfinished_stop_prefix_is_released_at_eos():
    engine = FakeEngine(reply="Hello wor")
    reports = _run(engine, stop=("world",))
    fin = _finished(reports)
    assert fin.finish_reason == "stop"
    assert fin.text == "wor"
    assert _text(reports) == "Hello wor"


def test_unfinished_stop_prefix_is_released_at_max_tokens():
    engine = FakeEngine(reply="Hello world")
    reports = _run(engine, stop=("world",), max_tokens=8)
    fin = _finished(reports)
    assert fin.finish_reason == "length"
    assert fin.text == "wo"
    assert _text(reports) == "Hello wo"


def test_cancel_before_decode_finishes_cancelled():
    cancel = threading.Event()
    cancel.set()
    reports = _run(FakeEngine(reply="Hello"), cancel=cancel)
    fin = _finished(reports)
    assert fin.finish_reason == "cancelled"
    assert not any(isinstance(r, Delta) for r in reports)


def test_cancel_mid_decode_finishes_cancelled():
    cancel = threading.Event()

    def on_report(item: object, reports: list[object]) -> None:
        if sum(isinstance(r, Delta) for r in reports) == 3:
            cancel.set()

    reports = _run(FakeEngine(reply="Hello world"), cancel=cancel, on_report=on_report)
    fin = _finished(reports)
    assert fin.finish_reason == "cancelled"
    assert _text(reports) == "Hel"


def test_multibyte_utf8_is_decoded_across_single_byte_tokens():
    reply = "héllo ✓ 日本 🚀"
    engine = FakeEngine(reply=reply)
    reports = _run(engine)
    fin = _finished(reports)
    assert fin.finish_reason == "stop"
    deltas = [r for r in reports if isinstance(r, Delta)]
    assert len(deltas) == len(reply.encode("utf-8"))  # one token per byte
    assert "".join(d.text for d in deltas) == reply
    assert "\ufffd" not in "".join(d.text for d in deltas)
    # Continuation bytes release no text on their own.
    assert any(d.text == "" for d in deltas)


def test_stop_string_after_multibyte_text():
    engine = FakeEngine(reply="héllo ✓ done")
    reports = _run(engine, stop=("✓",))
    assert _finished(reports).finish_reason == "stop"
    assert _text(reports) == "héllo "


def test_seeded_sampling_matches_greedy_on_the_fake_engine():
    greedy = _text(_run(FakeEngine(reply="Same text")))
    seeded = _text(_run(FakeEngine(reply="Same text"), sampling=SamplingParams(temperature=1.0, seed=3)))
    assert greedy == seeded == "Same text"


def test_engine_error_is_reported_as_failed():
    engine = FakeEngine()
    reports: list[object] = []
    request = GenerationRequest(prompt_tokens=(), sampling=GREEDY, max_tokens=4)
    run_worker(engine, request, threading.Event(), reports.append)
    assert len(reports) == 1
    assert isinstance(reports[0], Failed)
    assert isinstance(reports[0].error, InvalidRequest)


def test_engine_is_released_after_each_generation():
    engine = FakeEngine(reply="abc")
    for _ in range(3):
        assert _finished(_run(engine, max_tokens=2)).finish_reason == "length"
    assert engine.prefill_calls == 3


# -- run_async_worker: an async engine (the route engine's shape) -------------------------------
class AsyncFake:
    """FakeEngine's steps handed to ``emit`` from a coroutine, as the route engine hands its own;
    records how each generation ended."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.info, self.ended = engine, engine.info, []

    def grammar(self, text: str, *, param: str = "grammar"):
        return self.engine.grammar(text, param=param)

    def is_end_of_generation(self, token: int) -> bool:
        return self.engine.is_end_of_generation(token)

    def token_bytes(self, token: int) -> bytes:
        return self.engine.token_bytes(token)

    async def generate(self, prompt, sampler, cancel, plan, emit) -> None:
        from meshnet.backends.base import Stop

        steps = self.engine.generate(prompt, sampler, threading.Event(), plan)
        try:
            for step in steps:
                if cancel.is_set():
                    break
                await emit(step)
            self.ended.append("ran out")
        except Stop:
            self.ended.append("stopped")  # the consumer stopped it: the route engine closes the route here
        finally:
            steps.close()


def _run_async(engine: AsyncFake, *, prompt: str = "hi", max_tokens: int = 100, stop: tuple[str, ...] = ()):
    import asyncio

    from meshnet.gateway.generation import run_async_worker

    reports: list[object] = []
    request = GenerationRequest(prompt_tokens=tuple(engine.engine.tokenize(prompt, add_special=True)),
                                sampling=GREEDY, max_tokens=max_tokens, stop=stop)  # fmt: skip
    asyncio.run(run_async_worker(engine, request, asyncio.Event(), reports.append))  # type: ignore[arg-type]
    return reports


def test_an_async_engine_is_driven_on_the_loop_and_stopped_by_the_consumer_as_a_sync_one_is() -> None:
    for kwargs in ({"max_tokens": 4}, {"stop": ("l",)}, {}):
        sync, fake = _run(FakeEngine(reply="hello world"), **kwargs), AsyncFake(FakeEngine(reply="hello world"))
        reports = _run_async(fake, **kwargs)
        assert _text(reports) == _text(sync)
        assert [type(r) for r in reports] == [type(r) for r in sync]
        (finished,) = [r for r in reports if isinstance(r, Finished)]
        assert finished == next(r for r in sync if isinstance(r, Finished))
        # the consumer's stop (max_tokens, a stop string, the end-of-generation token) reaches the
        # engine as Stop, which ends it as completed
        assert fake.ended == ["stopped"]


def test_an_async_engines_error_is_one_failed_report() -> None:
    class Broken(AsyncFake):
        async def generate(self, prompt, sampler, cancel, plan, emit) -> None:
            raise RuntimeError("boom")

    (failed,) = _run_async(Broken(FakeEngine()))
    assert isinstance(failed, Failed) and "RuntimeError: boom" in failed.error.message
