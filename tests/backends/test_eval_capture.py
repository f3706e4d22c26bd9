"""The eval callback llama.cpp shards copy their seam out through (backends/eval_capture.py): the C one
is built and used by default, computes the Python one's bits, and a node without it falls back loudly."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.backends import eval_capture
from meshnet.backends.eval_capture import CompiledCapture, PythonCapture, compiled_available, make_capture
from meshnet.backends.llama_shard import LlamaShard, LlamaShardConfig
from meshnet.backends.shard import DecodeStep, ShardOutput
from meshnet.errors import EngineError
from meshnet.ids import SessionId

pytestmark = pytest.mark.real


def _config(kind: str) -> LlamaShardConfig:
    return LlamaShardConfig(n_ctx=1024, max_sessions=4, n_threads=1, eval_callback=kind)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def middles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LlamaShard]]:
    cache = tmp_path_factory.mktemp("eval-capture")
    shards = {
        k: LlamaShard.from_model(bundled_gguf(), "10:20", cache_dir=cache, config=_config(k))
        for k in ("python", "compiled")
    }
    yield shards
    for shard in shards.values():
        shard.close()


def test_the_c_callback_is_built_and_shards_use_it_by_default(tmp_path: Path) -> None:
    assert compiled_available(), "meshnet.backends._capture is not built: `make install` (pip install -e .) builds it"
    head = LlamaShard.from_model(bundled_gguf(), "0:10", cache_dir=tmp_path, config=LlamaShardConfig(n_ctx=256))
    tail = LlamaShard.from_model(bundled_gguf(), "20:30", cache_dir=tmp_path, config=LlamaShardConfig(n_ctx=256))
    try:
        assert head.eval_callback == "compiled"
        assert tail.eval_callback is None  # a tail of a family without a seam fix copies nothing out
    finally:
        head.close()
        tail.close()


def test_both_callbacks_copy_out_the_same_rows(middles: dict[str, LlamaShard]) -> None:
    """A prefill in chunks, decode steps, and two sessions' steps in one batch: bit for bit."""
    rows = np.random.default_rng(3).standard_normal((48, 576)).astype(np.float32)
    got: dict[str, list[np.ndarray]] = {}
    for kind, shard in middles.items():
        assert shard.eval_callback == kind
        a, b = SessionId(f"{kind}-a"), SessionId(f"{kind}-b")
        outs = []
        for sid in (a, b):
            shard.open_session(sid)
            outs.append(shard.prefill(sid, 0, hidden=rows[:29]).hidden)
            outs.append(shard.prefill(sid, 29, hidden=rows[29:40]).hidden)
        for i in range(40, 44):
            outs.append(shard.decode_step(a, i, hidden=rows[i : i + 1]).hidden)
        batched = shard.decode_many([DecodeStep(a, 44, hidden=rows[44:45]), DecodeStep(b, 40, hidden=rows[45:46])])
        assert all(isinstance(out, ShardOutput) for out in batched), batched
        outs.extend(out.hidden for out in batched if isinstance(out, ShardOutput))
        for sid in (a, b):
            shard.close_session(sid)
        got[kind] = [np.asarray(o) for o in outs]
    assert all(o.shape[-1] == 576 for o in got["python"])
    assert all(np.array_equal(p, c) for p, c in zip(got["python"], got["compiled"], strict=True))


def test_compiled_is_refused_where_it_is_not_built_and_auto_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(eval_capture, "_compiled_eval", lambda: (None, "meshnet.backends._capture is not built (test)"))
    eval_capture._warn_python_once.cache_clear()
    out = np.zeros((4, 8), dtype=np.float32)
    kw = {"target": b"l_out-3\0", "overwrite": None, "out": out, "n_embd": 8, "row": 8}
    with pytest.raises(EngineError, match="not built"):
        make_capture(llama_cpp, "compiled", **kw)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="meshnet.backends"):
        capture = make_capture(llama_cpp, "auto", **kw)  # type: ignore[arg-type]
    assert isinstance(capture, PythonCapture)
    assert "Python eval callback" in caplog.text and "not built (test)" in caplog.text
    eval_capture._warn_python_once.cache_clear()


def test_a_c_state_laid_out_otherwise_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built from another version of the C struct would read the wrong fields."""
    from meshnet.backends import _capture

    monkeypatch.setattr(_capture, "STATE_LAYOUT", (8, 0, 0))
    address, why = eval_capture._compiled_eval.__wrapped__()
    assert address is None and "rebuild it" in why
    monkeypatch.undo()
    address, _ = eval_capture._compiled_eval.__wrapped__()
    assert address is not None
    out = np.zeros((4, 8), dtype=np.float32)
    capture = make_capture(llama_cpp, "auto", target=b"l_out-3\0", overwrite=None, out=out, n_embd=8, row=8)
    assert isinstance(capture, CompiledCapture) and capture.user_data is not None


def test_a_capture_needs_something_to_capture() -> None:
    out = np.zeros((1, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="needs a node"):
        make_capture(llama_cpp, "auto", target=None, overwrite=None, out=out, n_embd=8, row=8)
