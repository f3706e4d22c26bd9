"""Pipelined speculation, run in process (``LocalSwarm`` over the decode channel's in-process binding):
several verify rounds in flight, each sent before the verdict on the one before it.

The engine chains rounds only while ``WalkCosts.chain_pays`` says a round pays on the route's
measured costs, and cuts every round to the drafts that pay; these tests force both (``always_chain``:
every round chains and carries all its drafts) to drive the machinery — voiding rounds
after a rejection, rewinding every hop, repairing with rounds in flight — and test the policy on
its own at the end.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from meshnet.backends.base import EngineStep, RouteChange, TokenStep
from meshnet.backends.fake_shard import VOCAB
from meshnet.cli.main import _build_parser, main
from meshnet.gateway.speculative import WalkCosts
from meshnet.protocol.messages import HopRequest
from meshnet.sampling import SamplingParams
from tests.unit.test_route_engine import PROMPT, LocalSwarm, changes, generate, killer, reference


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    local = LocalSwarm(tmp_path, channels=True)
    try:
        yield local
    finally:
        local.close()


@pytest.fixture
def always_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WalkCosts, "chain_pays", lambda self, positions, kept, hops, draft_s=0.0: True)
    monkeypatch.setattr(WalkCosts, "best_drafts", lambda self, available, q, explore=False, draft_s=0.0: available)


class RareOracle:
    """A draft model that knows the text to come and gets one draft in three calls wrong, at a depth
    that moves (the guessed first token of a pipelined round included): rejections at every depth of a
    round, with runs of right rounds between them for the pipeline to fill."""

    def __init__(self, expected: Sequence[int], prompt_length: int) -> None:
        self.expected, self.prompt_length, self.calls = list(expected), prompt_length, 0

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        at = len(tokens) - self.prompt_length
        drafts = self.expected[at : at + k]
        self.calls += 1
        if self.calls % 3 == 0 and drafts:
            wrong = (self.calls // 3) % len(drafts)
            drafts[wrong] = (drafts[wrong] + 1) % VOCAB
        return drafts


class Guesses:
    """Every pipelined round the engine sends (the requests with a guessed first token)."""

    def __init__(self, swarm: LocalSwarm) -> None:
        self.rounds: list[HopRequest] = []
        start_step = swarm.transport.start_step

        async def recorded(route: Sequence[str], request: HopRequest, *, timeout_s: float, **kw: Any) -> Any:
            if request.guess is not None:
                self.rounds.append(request)
            return await start_step(route, request, timeout_s=timeout_s, **kw)

        swarm.transport.start_step = recorded  # type: ignore[method-assign]


def voided(swarm: LocalSwarm, node: str = "c") -> float:
    return float(swarm.nodes[node].metrics.voided.value)


@pytest.mark.usefixtures("always_chain")
@pytest.mark.parametrize("rounds", [2, 4])
def test_pipelined_rounds_with_rejections_at_every_depth_keep_the_greedy_text_identical(
    swarm: LocalSwarm, rounds: int
) -> None:
    """The oracle gets one draft wrong at a depth that moves every round: rejections inside a round,
    guesses that miss, and the rounds built on them voided at every depth of the pipeline."""
    expected = reference(swarm.tmp_path, 40)
    oracle = RareOracle(expected, len(PROMPT))
    guesses = Guesses(swarm)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        engine = swarm.engine(speculative="draft", draft_model=oracle, draft_tokens=3, pipeline_rounds=rounds)
        return await generate(engine, 40)

    tokens, steps = swarm.run(run)
    assert tokens == expected
    assert changes(steps) == []
    assert guesses.rounds, "no round was pipelined"
    assert voided(swarm) > 0, "no pipelined round was voided"
    assert len(guesses.rounds) > voided(swarm), "no pipelined round was kept"
    for node in "ab":  # the hops before the tail computed the voided rounds and dropped them again
        assert swarm.nodes[node].metrics.voided.value == 0


@pytest.mark.usefixtures("always_chain")
def test_a_perfect_drafter_keeps_several_rounds_in_flight_and_none_is_voided(swarm: LocalSwarm) -> None:
    expected = reference(swarm.tmp_path, 40)

    class Perfect:
        def draft(self, tokens: Sequence[int], k: int) -> list[int]:
            at = len(tokens) - len(PROMPT)
            return expected[at : at + k]

    guesses = Guesses(swarm)

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        engine = swarm.engine(speculative="draft", draft_model=Perfect(), draft_tokens=3, pipeline_rounds=4)
        return await generate(engine, 40)

    tokens, _ = swarm.run(run)
    assert tokens == expected
    assert len(guesses.rounds) >= 5 and voided(swarm) == 0
    starts = [r.start for r in guesses.rounds]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


@pytest.mark.usefixtures("always_chain")
@pytest.mark.parametrize("dead", ["a", "b", "c"])
@pytest.mark.parametrize("after", [3, 8])
def test_a_hop_killed_with_rounds_in_flight_is_repaired_with_identical_text(
    swarm: LocalSwarm, dead: str, after: int
) -> None:
    expected = reference(swarm.tmp_path, 30)
    oracle = RareOracle(expected, len(PROMPT))
    spare = {"a": "0:4", "b": "4:8", "c": "8:12"}[dead]
    guesses = Guesses(swarm)
    in_flight: list[int] = []

    async def run() -> tuple[list[int], list[EngineStep]]:
        await swarm.layout()
        await swarm.node("spare", spare)
        engine = swarm.engine(speculative="draft", draft_model=oracle, draft_tokens=3, pipeline_rounds=4)
        kill = killer(dead, swarm, after_tokens=after)

        def on_step(step: EngineStep, tokens: list[int]) -> None:
            if isinstance(step, TokenStep) and len(tokens) == after:
                in_flight.append(len(guesses.rounds))
            kill(step, tokens)

        return await generate(engine, 30, on_step=on_step)

    tokens, steps = swarm.run(run)
    assert tokens == expected
    assert changes(steps) == ["repair"]
    repair = next(s for s in steps if isinstance(s, RouteChange))
    assert repair.failed_node == dead and "spare" in [h.node for h in repair.plan.hops]
    assert in_flight and in_flight[0] > 0, "no round was pipelined before the kill"


def _mode(tokens: Sequence[int]) -> int:
    """The token the three-hop fake route (``LAYOUT``: salts 1, 5, 9) gives the most weight after
    ``tokens``: its one-hot logit (``MixShard``)."""
    states: list[list[float]] = [[], [], []]
    value = 0.0
    for token in tokens:
        value = float(token)
        for state, salt in zip(states, (1.0, 5.0, 9.0), strict=True):
            value = (value * 31 + sum(state) * 7 + salt) % 1009
            state.append(value)
    return int(value) % VOCAB


class Mode:
    """A draft model as good as a draft model gets: the route's own most likely tokens."""

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        text = list(tokens)
        for _ in range(k):
            text.append(_mode(text))
        return text[len(tokens) :]


def _sampled(swarm: LocalSwarm, *, speculative: bool, seeds: range, n: int) -> list[list[int]]:
    out: list[list[int]] = []

    async def run() -> None:
        await swarm.layout()
        options: dict[str, Any] = {"speculative": "draft", "draft_model": Mode(), "draft_tokens": 3}
        engine = swarm.engine(**(options if speculative else {}), pipeline_rounds=4)
        for seed in seeds:
            if seed % 20 == 0:
                await swarm.heartbeat()  # the runs take longer than the tracker's node TTL on a slow machine
            tokens, _ = await generate(engine, n, params=SamplingParams(temperature=2.0, seed=seed))
            out.append(tokens[:n])

    swarm.run(run)
    return out


@pytest.mark.usefixtures("always_chain")
def test_sampled_text_with_pipelined_speculation_is_distributed_as_without(tmp_path: Path) -> None:
    """Speculative sampling — the tail draws each row as plain sampling would and keeps a draft that is
    the token drawn, so a draft is kept with the probability the model gives it and a rejection is
    drawn from the rest; a pipelined round's guess is kept only if it is the token the tail drew —
    leaves every token distributed as plain sampling does, and a seeded text exactly as it was. The
    fake model puts logit 10 on one token and 0 on the 49 others, so at temperature 2 that token
    comes with probability e^5 / (e^5 + 49) exactly."""
    p_mode = math.exp(5) / (math.exp(5) + VOCAB - 1)
    seeds = range(150)
    runs = {}
    for speculative in (False, True):
        local = LocalSwarm(tmp_path / str(speculative), channels=True)
        guesses = Guesses(local)
        try:
            runs[speculative] = _sampled(local, speculative=speculative, seeds=seeds, n=10)
            if speculative:
                assert len(guesses.rounds) > 100 and voided(local) > 10, "the runs did not pipeline"
        finally:
            local.close()
    for speculative, texts in runs.items():
        hits, others = 0, collections.Counter[int]()
        total = 0
        for text in texts:
            for i in range(1, len(text)):  # the first token comes from the prefill, never drafted
                mode = _mode([*PROMPT, *text[:i]])
                total += 1
                if text[i] == mode:
                    hits += 1
                else:
                    others[(text[i] - mode) % VOCAB] += 1  # which of the 49 others, relative to the mode
        se = math.sqrt(p_mode * (1 - p_mode) / total)
        assert abs(hits / total - p_mode) < 4 * se, (speculative, hits / total, p_mode)
        # the others: uniform over 49 (chi-square, 48 degrees of freedom, p > 0.001)
        expected = (total - hits) / (VOCAB - 1)
        stat = sum((others[d] - expected) ** 2 / expected for d in range(1, VOCAB))
        assert stat < 85.0, (speculative, stat)
    assert runs[False] == runs[True]  # seeded: each position draws the same, drafted or not


@pytest.mark.parametrize("command", ["gateway", "up"])
@pytest.mark.parametrize("flag", ["--pipeline-rounds", "--draft-tokens"])
def test_the_speculation_flags_take_a_whole_number_of_at_least_one(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [command, "--tracker", "http://127.0.0.1:1"] if command == "gateway" else [command]
    assert getattr(_build_parser().parse_args([*base, flag, "2"]), flag[2:].replace("-", "_")) == 2
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exited:
            _build_parser().parse_args([*base, flag, bad])
        assert exited.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_draft_min_is_a_whole_number_no_more_than_draft_tokens(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [command, "--tracker", "http://127.0.0.1:1"] if command == "gateway" else [command]
    assert _build_parser().parse_args(base).draft_min == 0
    assert _build_parser().parse_args([*base, "--draft-min", "3"]).draft_min == 3
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as exited:
            _build_parser().parse_args([*base, "--draft-min", bad])
        assert exited.value.code == 2 and "--draft-min" in capsys.readouterr().err
    try:
        code = main([*base, "--draft-min", "5", "--draft-tokens", "4"])
    except SystemExit as exited:
        code = exited.code
    assert code == 2 and "--draft-min 5 is more than --draft-tokens 4" in capsys.readouterr().err


def test_a_round_is_chained_only_when_its_expected_saving_beats_its_expected_waste() -> None:
    """A round sent early saves a walk less one hop's share of the compute when it is of use, and
    costs that share when it is void."""
    costs = WalkCosts()
    assert not costs.chain_pays(4, 0.99, 3)  # nothing measured: a synchronous round measures first
    costs.observe(4, 0.030, 0.100)  # a WAN walk: 100 ms, of it 30 ms compute on 3 hops (10 ms each)
    assert costs.chain_pays(4, 0.5, 3)
    assert costs.chain_pays(4, 0.15, 3)  # 0.15 x 90 > 0.85 x 10
    assert not costs.chain_pays(4, 0.05, 3)
    loopback = WalkCosts()  # loopback: the walk is nearly all compute, 20 of 22 ms on 2 hops
    loopback.observe(4, 0.020, 0.022)
    assert not loopback.chain_pays(4, 0.4, 2)  # 0.4 x 12 < 0.6 x 10
    assert loopback.chain_pays(4, 0.6, 2)
    assert not loopback.chain_pays(4, 0.6, 0)
    # a draft model's tokens, 36 ms each (a 0.5B on one core): the WAN round above no longer pays at an even
    # chance (0.5 x (90 - 144) < 0.5 x (10 + 144)); at 2 ms each it still does
    assert not costs.chain_pays(4, 0.5, 3, draft_s=0.036)
    assert costs.chain_pays(4, 0.5, 3, draft_s=0.002)
