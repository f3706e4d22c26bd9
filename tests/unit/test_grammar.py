"""Grammar-constrained sampling on the bundled model's real vocabulary (llama.cpp's grammar engine)."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator

import numpy as np
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends.grammar import JSON_OBJECT_GRAMMAR, GrammarRefused, json_schema_grammar
from meshnet.backends.llama_vocab import LlamaVocab
from meshnet.errors import InvalidRequest
from meshnet.sampling import MAX_GRAMMAR_BYTES, Sampler, SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab() -> Iterator[LlamaVocab]:
    v = LlamaVocab(bundled_gguf())
    yield v
    v.close()


def _text(vocab: LlamaVocab, tokens: list[int]) -> str:
    return b"".join(vocab.token_bytes(t) for t in tokens).decode()


def _generate(vocab: LlamaVocab, sampler: Sampler, seed: int, steps: int = 200) -> list[int]:
    """Sample under random logits (a model that wants anything) until end of generation."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for position in range(steps):
        logits = (rng.standard_normal(vocab.info.n_vocab) * 3).astype(np.float32)
        token, _ = sampler.sample(logits, position=position)
        if vocab.is_end_of_generation(token):
            return out
        sampler.advance(token)
        out.append(token)
    raise AssertionError(f"no end of generation in {steps} steps: {_text(vocab, out)!r}")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_any_logits_give_a_document_of_the_schema(vocab: LlamaVocab, temperature: float) -> None:
    grammar = json_schema_grammar(PERSON, param="response_format")
    for seed in range(5):
        params = SamplingParams(temperature=temperature, seed=seed, grammar=grammar)
        doc = json.loads(_text(vocab, _generate(vocab, Sampler(params, vocab.grammar(grammar)), seed)))
        assert set(doc) == {"name", "age"} and isinstance(doc["age"], int) and len(doc["name"]) <= 8


def test_strings_hold_no_raw_control_characters(vocab: LlamaVocab) -> None:
    # The converter's own string rule admits raw newlines, which JSON forbids; ours does not.
    grammar = json_schema_grammar({"type": "string", "maxLength": 40}, param="response_format")
    compiled = vocab.grammar(grammar)
    compiled.accept(vocab.tokenize('"', add_special=False)[0])
    newline = vocab.tokenize("\n", add_special=False)
    assert len(newline) == 1 and not compiled.allows(newline[0])


def test_the_lazy_choice_is_the_argmax_over_allowed_tokens(vocab: LlamaVocab) -> None:
    """Greedy asks the grammar about one token and masks only on refusal: always the masked argmax."""
    params = SamplingParams(temperature=0.0, grammar=JSON_OBJECT_GRAMMAR)
    lazy = Sampler(params, vocab.grammar(JSON_OBJECT_GRAMMAR))
    full = vocab.grammar(JSON_OBJECT_GRAMMAR)
    rng = np.random.default_rng(7)
    refused = 0
    for position in range(40):
        logits = rng.standard_normal(vocab.info.n_vocab).astype(np.float32)
        token, _ = lazy.sample(logits, position=position)
        assert token == int(np.argmax(full.mask(logits)))
        refused += not full.allows(int(np.argmax(logits)))
        if vocab.is_end_of_generation(token):
            break
        lazy.advance(token)
        full.accept(token)
    assert refused > 0  # the masked path ran


def test_a_sampled_draw_follows_the_distribution_restricted_to_the_grammar(vocab: LlamaVocab) -> None:
    """Draw-then-check (redraw from the masked distribution on refusal) is distributed as the masked softmax."""
    a, b, c = (vocab.tokenize(x, add_special=False) for x in ("a", "b", "c"))
    assert len(a) == len(b) == len(c) == 1
    grammar = 'root ::= "a" | "b"'
    logits = np.full(vocab.info.n_vocab, -30.0, dtype=np.float32)
    logits[a[0]], logits[b[0]], logits[c[0]] = 1.0, 0.0, 2.0  # "c" is the likeliest and refused
    counts: collections.Counter[int] = collections.Counter()
    params = SamplingParams(temperature=1.0, seed=11, grammar=grammar)
    sampler = Sampler(params, vocab.grammar(grammar))
    draws = 1500  # a refused draw masks the whole vocabulary (~7 ms)
    for position in range(draws):
        counts[sampler.sample(logits, position=position)[0]] += 1
    assert set(counts) == {a[0], b[0]}
    expected = np.exp(1.0) / (np.exp(1.0) + np.exp(0.0))
    assert abs(counts[a[0]] / draws - expected) < 0.04  # 3.5 standard deviations


def test_verify_under_a_grammar_keeps_what_plain_steps_pick(vocab: LlamaVocab) -> None:
    grammar = json_schema_grammar(PERSON, param="response_format")
    params = SamplingParams(temperature=0.0, grammar=grammar)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, vocab.info.n_vocab)).astype(np.float32)
    step = Sampler(params, vocab.grammar(grammar))
    plain = []
    for i, row in enumerate(rows):
        token, _ = step.sample(row, position=i)
        step.advance(token)
        plain.append(token)
    drafts = [*plain[:3], plain[3] + 1]  # three right, the fourth wrong
    kept, _ = Sampler(params, vocab.grammar(grammar)).verify(rows[:5], drafts, position=0)
    assert kept == plain[:4]


def test_history_rebuilds_the_state_after_a_rewind(vocab: LlamaVocab) -> None:
    grammar = vocab.grammar(JSON_OBJECT_GRAMMAR)
    ids = vocab.tokenize('{"a": 1', add_special=False)
    grammar.sync(ids)
    assert grammar.accepted == ids
    grammar.sync(ids[:1])  # a rewind: start over from the shorter history
    assert grammar.accepted == ids[:1]
    fresh = vocab.grammar(JSON_OBJECT_GRAMMAR)
    fresh.accept(ids[0])
    logits = np.zeros(vocab.info.n_vocab, dtype=np.float32)
    assert np.array_equal(np.isfinite(grammar.mask(logits)), np.isfinite(fresh.mask(logits)))


def test_a_refused_token_is_an_error_not_an_abort(vocab: LlamaVocab) -> None:
    # llama.cpp aborts the process when its grammar accepts a token it refuses: every token is checked first.
    grammar = vocab.grammar(JSON_OBJECT_GRAMMAR)
    letter = vocab.tokenize("x", add_special=False)[0]
    with pytest.raises(GrammarRefused, match="not allowed"):
        grammar.accept(letter)
    with pytest.raises(GrammarRefused):
        grammar.sync([letter])
    with pytest.raises(GrammarRefused):
        grammar.accept(vocab.info.n_vocab + 5)
    eos = vocab.tokenize("<|im_end|>", add_special=False)
    assert not grammar.allows(eos[0])  # an unfinished document cannot end


def test_bad_grammars_and_schemas_are_400s_naming_the_parameter(vocab: LlamaVocab) -> None:
    with pytest.raises(InvalidRequest) as info:
        vocab.grammar("root ::= undefined-rule", param="grammar")
    assert info.value.param == "grammar"
    with pytest.raises(InvalidRequest) as info:
        json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, param="response_format")
    assert info.value.param == "response_format"
    with pytest.raises(InvalidRequest, match="bytes"):
        vocab.grammar('root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="x" * (MAX_GRAMMAR_BYTES + 1))


def test_a_sampler_with_a_grammar_needs_it_compiled(vocab: LlamaVocab) -> None:
    with pytest.raises(ValueError, match="compiled"):
        Sampler(SamplingParams(grammar=JSON_OBJECT_GRAMMAR))
    with pytest.raises(ValueError, match="compiled"):
        Sampler(SamplingParams(), vocab.grammar(JSON_OBJECT_GRAMMAR))
    assert SamplingParams(grammar="x").needs_history and not SamplingParams().needs_history
