"""Grammar-constrained sampling: llama.cpp's GBNF engine applied where the logits are.

The gateway turns ``response_format`` (a JSON schema, or any JSON object) and tool calls into GBNF
with llama-cpp-python's maintained converter (``llama_cpp.llama_grammar.SchemaConverter``, a port
of llama.cpp's ``json_schema_to_grammar``); the text travels with the sampling parameters to
whoever samples — the tail node of a route, or the single-node engine — and is compiled there
against the model's vocabulary by llama.cpp's grammar sampler (``TokenGrammar``).

Checking a grammar over the whole vocabulary costs ~7 ms per token (49K tokens), checking one token
~20 µs, so the sampler first picks as if unconstrained and asks the grammar only about that token;
only when the grammar refuses it does it mask more (``TokenGrammar.best``: the most likely allowed
token, found among the top candidates first; ``TokenGrammar.mask`` for a sampled draw). Greedy
output is exactly the argmax over the allowed tokens either way. For a sampled draw, a pick from
``p`` kept when allowed and otherwise redrawn from ``p`` restricted to the allowed tokens is
distributed exactly as that restriction; with top-k or top-p, the first pick comes from their cut
of ``p`` and a redraw applies them to the restricted logits (as llama.cpp's own sampler does).

The grammar's state is a function of the tokens generated so far (``TokenGrammar.sync``), so a new
tail after a route repair rebuilds it from the token ids the route carries — the text goes on as if
nothing happened. llama.cpp aborts the process when asked to accept a token its grammar refuses, so
every token is checked first, wherever it came from: one the grammar refuses is a clear error.

A grammar's *cost* is bounded, not only its bytes (``check_grammar_cost``): a grammar of many
identical alternatives fits the byte cap and still makes one check of the vocabulary take seconds
(docs/api.md has the numbers). The gateway times the costliest step the sampler can take — a check
of the whole vocabulary — at the grammar's start and after a few allowed tokens, in CPU time of its
own thread (a loaded machine does not inflate it), in chunks so that a bomb is refused as soon as
its time passes the limit rather than after the tens of seconds a full check would take.
"""

from __future__ import annotations

import ctypes
import json
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from meshnet.errors import InvalidRequest
from meshnet.sampling import MAX_GRAMMAR_BYTES

__all__ = [
    "JSON_OBJECT_GRAMMAR",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_STEP_S",
    "GrammarCancelled",
    "GrammarRefused",
    "TokenGrammar",
    "check_grammar_cost",
    "grammar_step_s",
    "json_schema_grammar",
]

ROOT = "root"
# How many of the most likely tokens ``best`` asks the grammar about before masking the whole vocabulary.
_FIRST_CANDIDATES = 256
# The most CPU time one check of the whole vocabulary may take under a request's grammar (docs/api.md:
# realistic schema and tool grammars measured 1-40 ms on the bundled 49K vocabulary on an AVX-512 Xeon
# and up to ~100 ms (an enum of 100 strings) on an AVX2 EPYC; a bomb of 1,000 identical alternatives
# 1 s, of 9,000 1-5 s); a tail's per-token deadline (node.sampling_lane) backs it up.
MAX_GRAMMAR_STEP_S = 0.25
# Steps the cost check walks into the grammar (a grammar cheap at its start may not stay cheap).
_COST_STEPS = 4
_MASK_CHUNK = 4096  # tokens per call when masking: a cancelled check stops within one call
_COST_CHUNK = 512  # tokens per timed check: a bomb's chunk costs ~10 ms, so the check stops soon after its limit

# Any JSON object (``response_format: {"type": "json_object"}``): llama.cpp's grammars/json.gbnf.
JSON_OBJECT_GRAMMAR = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

# A character of a JSON string (llama.cpp's current rule; the Python port's older one admits raw control characters).
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'

Logits = npt.NDArray[np.float32]
# llama.cpp's llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class GrammarRefused(InvalidRequest):
    """A token the grammar does not allow was to be accepted, or the grammar allows no token at all."""


class GrammarCancelled(InvalidRequest):
    """A check of the vocabulary stopped because its step passed its deadline (``TokenGrammar.cancel``)."""

    code = "grammar_too_costly"


def json_schema_grammar(schema: object, *, param: str, root: str | None = None) -> str:
    """GBNF for JSON documents valid under ``schema``; with ``root``, a GBNF expression in which
    ``DOCUMENT`` stands for such a document (e.g. between tool-call tags). A schema the converter
    cannot express is a 400 naming ``param``."""
    from llama_cpp import llama_grammar

    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
    converter_class: Any = llama_grammar.SchemaConverter  # untyped
    converter = converter_class(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        name = converter.visit(resolved, "document" if root else "")
        if root:
            converter._add_rule(ROOT, root.replace("DOCUMENT", name))
        if "char" in converter._rules:  # the port lets raw control characters into strings: JSON does not
            converter._rules["char"] = _JSON_CHAR
        text = str(converter.format_grammar())
    except InvalidRequest:
        raise
    except Exception as exc:  # the converter raises bare exceptions (ValueError, KeyError, AssertionError...)
        why = f"{param}: this JSON schema cannot be turned into a grammar: {exc!r}"
        raise InvalidRequest(why, param=param) from None
    check_grammar_size(text, param=param)
    return text


def check_grammar_size(text: str, *, param: str) -> None:
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(
            f"{param}: the grammar is {size} bytes, more than the {MAX_GRAMMAR_BYTES} a route carries; "
            "use a smaller schema",
            param=param,
        )


def grammar_step_s(grammar: TokenGrammar, *, limit_s: float, steps: int = _COST_STEPS) -> float:
    """The CPU seconds of the costliest whole-vocabulary check over the grammar's first ``steps``
    states (each next state: after an allowed token picked by a fixed seed); stops as soon as one
    check passes ``limit_s`` and returns what it took so far. Leaves ``grammar`` where it walked to."""
    rng = np.random.default_rng(0)
    worst = 0.0
    data = np.zeros(grammar.n_vocab, dtype=_TOKEN_DATA)
    for _ in range(steps):
        data["id"] = np.arange(grammar.n_vocab, dtype=np.int32)
        data["logit"] = 0.0
        spent = 0.0
        for at in range(0, grammar.n_vocab, _COST_CHUNK):
            chunk = data[at : at + _COST_CHUNK]
            began = time.thread_time()
            grammar._apply(chunk)
            spent += time.thread_time() - began
            if spent > limit_s:
                return spent
        worst = max(worst, spent)
        allowed = np.flatnonzero(np.isfinite(data["logit"]))
        rng.shuffle(allowed)
        token = next((int(t) for t in allowed[:64] if not grammar.ends(int(t))), None)
        if token is None:  # complete: only an end of generation may follow
            break
        grammar.accept(token)
    return worst


def check_grammar_cost(
    compile_grammar: Callable[[], TokenGrammar], *, param: str, limit_s: float = MAX_GRAMMAR_STEP_S
) -> None:
    """Compile a request's grammar and time its steps; a grammar whose compile or step takes more
    than ``limit_s`` of CPU is a 400 naming ``param``, before any route is opened."""
    began = time.thread_time()
    grammar = compile_grammar()
    compiled_s = time.thread_time() - began
    try:
        step_s = compiled_s if compiled_s > limit_s else grammar_step_s(grammar, limit_s=limit_s)
    finally:
        grammar.close()
    if step_s > limit_s:
        raise InvalidRequest(
            f"{param}: this grammar is too costly to sample: one step took {1000 * step_s:.0f} ms of CPU "
            f"(over the whole vocabulary), more than the {1000 * limit_s:.0f} ms allowed; simplify it "
            "(fewer alternatives of the same text, fewer nested choices)",
            param=param,
            code="grammar_too_costly",
        )


class TokenGrammar:
    """One generation's grammar over a model's vocabulary (llama.cpp's grammar sampler).

    ``owner`` is the object that keeps the vocabulary alive (a ``LlamaVocab`` or a shard); the grammar
    holds it. Not thread-safe: one grammar per generation, like its ``Sampler``."""

    def __init__(self, owner: object, vocab: Any, n_vocab: int, text: str, *, param: str = "grammar") -> None:
        import llama_cpp

        check_grammar_size(text, param=param)
        self._ll = llama_cpp
        self._owner = owner
        handle = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), ROOT.encode())
        if not handle:
            raise InvalidRequest(
                f"{param}: llama.cpp's GBNF parser rejected the grammar (its rule {ROOT!r} must exist and every "
                "rule it names be defined); the node's log shows where",
                param=param,
            )
        self._handle = handle
        self._vocab = vocab
        self._free = weakref.finalize(self, llama_cpp.llama_sampler_free, handle)
        self.n_vocab = n_vocab
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self.accepted: list[int] = []  # the tokens the grammar state has consumed, in order
        self.accepted_at = 0.0  # time.monotonic() of the last token accepted (a step's progress: node.sampling_lane)
        self._cancelled = False

    # -- questions ---------------------------------------------------------------------------
    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (an end-of-generation token: whether the grammar is complete)."""
        if not 0 <= token < self.n_vocab:
            return False
        self._one["id"] = token
        self._one["logit"] = 0.0
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self, logits: Logits) -> Logits:
        """A copy of ``logits`` with every token the grammar refuses at -inf."""
        data = self._all
        data["logit"] = logits[: self.n_vocab]
        # In chunks, so that a step past its deadline stops here (``cancel``) instead of running on for
        # seconds on a worker thread; a realistic grammar's check costs no more for it.
        for at in range(0, self.n_vocab, _MASK_CHUNK):
            if self._cancelled:
                raise GrammarCancelled(f"the grammar's check of the vocabulary was stopped at token {at}: too costly",
                                       param="grammar")  # fmt: skip
            self._apply(data[at : at + _MASK_CHUNK])
        masked = data["logit"].astype(np.float32)
        if not np.isfinite(masked).any():
            raise GrammarRefused(f"the grammar allows no token after {len(self.accepted)} generated tokens")
        return masked

    def best(self, logits: Logits) -> int:
        """The most likely token the grammar allows (greedy under the grammar)."""
        n = min(_FIRST_CANDIDATES, self.n_vocab)
        top = np.argpartition(logits[: self.n_vocab], -n)[-n:]
        top = top[np.argsort(-logits[top], kind="stable")]
        some = np.zeros(n, dtype=_TOKEN_DATA)
        some["id"] = top
        some["logit"] = logits[top]
        self._apply(some)
        ok = np.flatnonzero(np.isfinite(some["logit"]))
        if ok.size:
            return int(top[ok[0]])
        return int(np.argmax(self.mask(logits)))

    def ends(self, token: int) -> bool:
        """Whether ``token`` ends a generation (the grammar allows it only where it is complete)."""
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    def cancel(self) -> None:
        """Stop the check of the vocabulary running on another thread (its step passed its deadline);
        this grammar answers no more checks of the whole vocabulary."""
        self._cancelled = True

    # -- state -------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        if not self.allows(token):
            raise GrammarRefused(
                f"token {token} after {len(self.accepted)} generated tokens is not allowed by the request's grammar"
            )
        self._ll.llama_sampler_accept(self._handle, token)
        self.accepted.append(token)
        self.accepted_at = time.monotonic()

    def sync(self, history: Sequence[int]) -> None:
        """Bring the state to "``history`` generated so far": consume what is new, or start over when
        ``history`` is not a continuation of what was consumed (a rewind)."""
        n = len(self.accepted)
        if len(history) < n or list(history[:n]) != self.accepted:
            self._ll.llama_sampler_reset(self._handle)
            self.accepted = []
            n = 0
        for token in history[n:]:
            self.accept(int(token))

    def close(self) -> None:
        self._free()

    def _apply(self, data: np.ndarray[Any, np.dtype[Any]]) -> None:
        ll = self._ll
        array = ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=data.shape[0], selected=-1, sorted=False
        )
        ll.llama_sampler_apply(self._handle, ctypes.byref(array))
