"""The gateway's draft model (backends.llama_draft): greedy drafts, KV reuse between drafts, vocabulary check."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator

import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.base import TokenStep
from meshnet.backends.llama_draft import DraftModel
from meshnet.backends.llama_full import LlamaFullEngine
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.sampling import Sampler, SamplingParams
from tests.procs import MESHNET

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def vocab() -> Iterator[LlamaVocab]:
    v = LlamaVocab(bundled_gguf())
    yield v
    v.close()


@pytest.fixture(scope="module")
def draft(vocab: LlamaVocab) -> Iterator[DraftModel]:
    model = DraftModel(bundled_gguf(), n_vocab=vocab.info.n_vocab, token_bytes=vocab.token_bytes, n_ctx=512, threads=1)
    yield model
    model.close()


def greedy(prompt: list[int], n: int) -> list[int]:
    """What ``meshnet serve`` would write: the target's own greedy tokens."""
    engine = LlamaFullEngine(bundled_gguf(), n_ctx=512, n_threads=1)
    out: list[int] = []
    try:
        steps = engine.generate(prompt, Sampler(SamplingParams(temperature=0.0)), threading.Event())
        for step in steps:
            if isinstance(step, TokenStep):
                out.append(step.token)
                if len(out) == n:
                    steps.close()
                    break
    finally:
        engine.close()
    return out


def test_a_draft_is_the_models_greedy_continuation_and_reuses_the_kv_it_holds(
    vocab: LlamaVocab, draft: DraftModel
) -> None:
    prompt = vocab.tokenize("The capital of France is Paris. The capital of Italy is", add_special=True)
    want = greedy(prompt, 8)
    first = draft.draft(prompt, 4)
    assert first == want[:4]
    evaluated = draft.evaluated
    # the route kept two drafts and added a token of its own: only what differs is evaluated again
    grown = [*prompt, *want[:3]]
    assert draft.draft(grown, 4) == want[3:7]
    assert draft.evaluated - evaluated <= 2 + 3  # the re-evaluated last token, the new one, 3 draft steps
    assert draft.draft(grown, 0) == [] and draft.draft([], 3) == []


def test_a_draft_model_of_another_vocabulary_is_refused(vocab: LlamaVocab) -> None:
    with pytest.raises(ValueError, match="share the target's vocabulary"):
        DraftModel(bundled_gguf(), n_vocab=vocab.info.n_vocab + 1, token_bytes=vocab.token_bytes, n_ctx=64, threads=1)
    with pytest.raises(ValueError, match="spells token"):
        DraftModel(bundled_gguf(), n_vocab=vocab.info.n_vocab, token_bytes=lambda t: b"?", n_ctx=64, threads=1)
    with pytest.raises(ValueError, match="no draft model GGUF"):
        DraftModel(
            bundled_gguf().with_name("missing.gguf"), n_vocab=1, token_bytes=vocab.token_bytes, n_ctx=64, threads=1
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative", "draft"], "needs --draft-gguf"),
        (["--draft-gguf", "x.gguf"], "only with --speculative draft"),
        (["--speculative", "draft", "--draft-gguf", "missing.gguf"], "no draft model GGUF"),
    ],
)
def test_the_gateway_says_what_is_wrong_with_its_draft_flags(args: list[str], message: str) -> None:
    out = subprocess.run(
        [*MESHNET, "gateway", "--tracker", "http://127.0.0.1:9", "--port", "0", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr
