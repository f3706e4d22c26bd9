"""A draft model for the gateway (``--speculative draft --draft-gguf PATH``).

A small GGUF that shares the target model's vocabulary continues the text greedily; its tokens go
through the route as one verify chunk (``gateway.speculative``), where the tail keeps the ones
the target agrees with. The draft never decides the text: with greedy sampling the output is the
target's token for token, and with sampling the tail's acceptance rule keeps the target's
distribution (``Sampler.verify``). A draft model only changes how many tokens one walk yields.

One llama.cpp context serves every generation of the gateway, one draft at a time (drafting is
short: a few small-model steps). The context keeps the tokens it last computed; the next draft
reuses their KV up to where the new text departs from them (the common prefix), so a generation
drafting step after step evaluates only the tokens the route accepted since, and drafts of
concurrent generations cost a re-prefill of the part that differs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshnet.errors import EngineError

__all__ = ["DraftModel"]

_PROBE_TOKENS = 512  # token ids whose bytes must agree between the draft and the target vocabulary


class DraftModel:
    def __init__(
        self,
        gguf: Path,
        *,
        n_vocab: int,
        token_bytes: Callable[[int], bytes],
        n_ctx: int,
        threads: int,
        lease: contextlib.AbstractContextManager[object] | None = None,
    ) -> None:
        """Load ``gguf`` and check that it speaks the target's vocabulary (``n_vocab`` ids whose
        bytes ``token_bytes`` gives); ``ValueError`` saying what differs otherwise. ``lease``: held
        around each compute call (the machine's core lease, ``meshnet.cores``)."""
        import llama_cpp

        if not Path(gguf).is_file():
            raise ValueError(f"no draft model GGUF at {gguf}")
        self.path = Path(gguf)
        self.n_ctx = n_ctx
        self._lease: contextlib.AbstractContextManager[object] = lease or contextlib.nullcontext()
        try:
            self._llm: Any = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=n_ctx,
                n_batch=min(256, n_ctx),
                n_threads=threads,
                n_threads_batch=threads,
                logits_all=False,
                flash_attn=True,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"cannot load the draft model {gguf}: {exc}") from None
        self.n_vocab = int(self._llm.n_vocab())
        self._lock = threading.Lock()
        try:
            self._check_vocabulary(n_vocab, token_bytes)
        except ValueError:
            self.close()
            raise
        self._held: list[int] = []  # the tokens whose KV the context holds, in order
        self.drafts = 0  # draft calls, and tokens evaluated for them (prefill and draft steps)
        self.evaluated = 0

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens the draft model would write after ``tokens`` (greedy); fewer near the
        end of its context, none when ``tokens`` does not fit."""
        if k < 1 or not tokens or len(tokens) >= self.n_ctx:
            return []
        k = min(k, self.n_ctx - len(tokens))
        with self._lock, self._lease:
            llm = self._llm
            common = 0
            limit = min(len(self._held), len(tokens) - 1)  # the last token is evaluated again: its logits
            while common < limit and self._held[common] == tokens[common]:
                common += 1
            llm.n_tokens = common  # eval() drops the KV from n_tokens on first
            self._eval(tokens[common:])
            out: list[int] = []
            while True:
                out.append(int(np.argmax(self._last_logits())))
                if len(out) == k:
                    break
                self._eval(out[-1:])
            self._held = [*tokens, *out[:-1]]  # the last draft was never evaluated
            self.drafts += 1
            return out

    def _eval(self, tokens: Sequence[int]) -> None:
        try:
            self._llm.eval(list(tokens))
        except RuntimeError as exc:
            self._held = []
            raise EngineError(f"the draft model failed: {exc}") from exc
        self.evaluated += len(tokens)

    def _last_logits(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.ctypeslib.as_array(self._llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def _check_vocabulary(self, n_vocab: int, token_bytes: Callable[[int], bytes]) -> None:
        if self.n_vocab != n_vocab:
            raise ValueError(
                f"the draft model {self.path.name} has {self.n_vocab} tokens, the target {n_vocab}: a draft model must "
                "share the target's vocabulary (same tokenizer family)"
            )
        from meshnet.backends.llama_vocab import LlamaVocab

        vocab = LlamaVocab(self.path)
        try:
            step = max(1, n_vocab // _PROBE_TOKENS)
            for token in range(0, n_vocab, step):
                mine = vocab.token_bytes(token)
                if mine != token_bytes(token):
                    raise ValueError(
                        f"the draft model {self.path.name} spells token {token} as {mine!r}, the target as "
                        f"{token_bytes(token)!r}: a draft model must share the target's vocabulary"
                    )
        finally:
            vocab.close()

    def close(self) -> None:
        with self._lock:  # after a draft (or a read ahead of drafting) still running on another thread
            self._llm.close()
