"""What a llama.cpp shard's eval callback copies out of its graph and overwrites in it.

llama.cpp calls a context's eval callback (``cb_eval``) for every node of every graph it computes:
first to ask whether the caller wants that node (``ask``), then, for a node it wants, once the node
is computed. A shard wants at most two of a few hundred: the last layer's output (``target``: the
rows that cross the seam to the next hop, copied into ``out``) and, in some families past the head,
the graph's rescaled input (``overwrite``: replaced by the inbound rows of the running chunk).

Two implementations behave alike, decision for decision:

- ``CompiledCapture``: the callback is C (``meshnet.backends._capture``, built when meshnet is
  installed: ``make install``); llama.cpp never enters Python during a decode.
- ``PythonCapture``: a ctypes callback. Every ask is a trip into the interpreter: ~330 a step on 10
  layers of the bundled model, 0.3-0.7 ms of a ~4.9 ms decode step on a 2-core CPU VM (``bench
  shards``). Used where the extension is not built (a source tree on ``PYTHONPATH``, a machine
  without a C compiler), with a warning saying so.

A capture is used by one shard on the thread that calls ``llama_decode`` (under the shard's compute
lock): ``begin`` before each decode, ``captured`` / ``overwritten`` after it.
"""

from __future__ import annotations

import abc
import ctypes
import functools
import logging
from typing import Any, Literal

import numpy as np

from meshnet.backends.ggml_layout import NAME_OFFSET, NE_OFFSET, tensor_get, tensor_set
from meshnet.errors import EngineError

__all__ = ["Capture", "CompiledCapture", "EvalCallback", "PythonCapture", "compiled_available", "make_capture"]

log = logging.getLogger("meshnet.backends")

EvalCallback = Literal["auto", "compiled", "python"]
F32 = np.ndarray[Any, np.dtype[np.float32]]


class _State(ctypes.Structure):
    """The ctypes mirror of ``struct capture`` in ``_capture.c``."""

    _fields_ = [
        ("target", ctypes.c_char_p),
        ("target_len", ctypes.c_int64),
        ("overwrite", ctypes.c_char_p),
        ("overwrite_len", ctypes.c_int64),
        ("name_offset", ctypes.c_int64),
        ("ne_offset", ctypes.c_int64),
        ("n_embd", ctypes.c_int64),
        ("row", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_size", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
        ("rows_size", ctypes.c_int64),
        ("get", ctypes.c_void_p),
        ("put", ctypes.c_void_p),
        ("captured", ctypes.c_int64),
        ("overwritten", ctypes.c_int64),
    ]


@functools.cache
def _compiled_eval() -> tuple[int | None, str]:
    """The C callback's address, or None and why it cannot be used."""
    try:
        from meshnet.backends import _capture
    except ImportError as exc:
        return None, f"meshnet.backends._capture is not built ({exc}); `make install` builds it"
    layout = (ctypes.sizeof(_State), _State.captured.offset, _State.overwritten.offset)
    if tuple(_capture.STATE_LAYOUT) != layout:
        return (
            None,
            f"meshnet.backends._capture lays its state out as {_capture.STATE_LAYOUT}, not {layout}: rebuild it",
        )
    return int(_capture.EVAL), ""


def compiled_available() -> bool:
    return _compiled_eval()[0] is not None


class Capture(abc.ABC):
    """One shard's eval callback and what it did in the last ``llama_decode``."""

    kind: str
    callback: Any  # a ctypes ggml_backend_sched_eval_callback: cparams.cb_eval
    user_data: int | None  # cparams.cb_eval_user_data

    @abc.abstractmethod
    def begin(self, rows: F32 | None) -> None:
        """Before a decode: zero the counters; ``rows`` are the chunk's inbound rows (overwrite), kept alive
        by the caller until the decode returns."""

    @property
    @abc.abstractmethod
    def captured(self) -> int:
        """Rows copied out by the last decode."""

    @property
    @abc.abstractmethod
    def overwritten(self) -> int:
        """Floats overwritten by the last decode."""


class CompiledCapture(Capture):
    kind = "compiled"

    def __init__(
        self, ll: Any, *, target: bytes | None, overwrite: bytes | None, out: F32, n_embd: int, row: int
    ) -> None:
        address, why = _compiled_eval()
        if address is None:
            raise EngineError(why)
        self._names = (target, overwrite)  # the state points into these bytes: keep them alive
        self._out = out
        self._state = _State(
            target,
            len(target or b""),
            overwrite,
            len(overwrite or b""),
            NAME_OFFSET,
            NE_OFFSET,
            n_embd,
            row,
            out.ctypes.data,
            out.size,
            None,
            0,
            ctypes.cast(tensor_get(ll), ctypes.c_void_p).value,
            ctypes.cast(tensor_set(ll), ctypes.c_void_p).value,
            0,
            0,
        )
        self.callback = ll.ggml_backend_sched_eval_callback(address)
        self.user_data = ctypes.addressof(self._state)

    def begin(self, rows: F32 | None) -> None:
        state = self._state
        state.captured = state.overwritten = 0
        state.rows = None if rows is None else rows.ctypes.data
        state.rows_size = 0 if rows is None else rows.size

    @property
    def captured(self) -> int:
        return int(self._state.captured)

    @property
    def overwritten(self) -> int:
        return int(self._state.overwritten)


class PythonCapture(Capture):
    kind = "python"

    def __init__(
        self, ll: Any, *, target: bytes | None, overwrite: bytes | None, out: F32, n_embd: int, row: int
    ) -> None:
        self._rows: F32 | None = None
        self._captured = self._overwritten = 0
        # Runs for every node of every graph: read only as many name bytes as the longest name.
        width = max(len(t) for t in (target, overwrite) if t is not None)
        get, put = tensor_get(ll), tensor_set(ll)

        def callback(tensor: int, ask: bool, _: Any) -> bool:
            name = ctypes.string_at(tensor + NAME_OFFSET, width)
            ours = target is not None and name.startswith(target)
            rescaled = overwrite is not None and name.startswith(overwrite)
            if not (ours or rescaled):
                return not ask  # not ours: do not ask for it (and never abort a running graph)
            if ask:
                return True
            ne = [ctypes.c_int64.from_address(tensor + NE_OFFSET + 8 * i).value for i in range(4)]
            elements = ne[0] * ne[1] * ne[2] * ne[3]
            # A batch of several sequences may run as several micro-batches, one graph each, in
            # batch order: each takes the next rows of the inbound block / the next rows of ``out``.
            if rescaled:
                rows, done = self._rows, self._overwritten
                if rows is None or ne[0] != n_embd or done + elements > rows.size:
                    return False  # abort the graph: llama_decode fails, nothing wrong is computed
                put(tensor, rows.ctypes.data + 4 * done, 0, elements * 4)
                self._overwritten += elements
                return True
            at = self._captured * row
            if ne[0] != n_embd or elements % row or at + elements > out.size:
                return False
            get(tensor, out.ctypes.data + 4 * at, 0, elements * 4)
            self._captured += elements // row
            return True

        self.callback = ll.ggml_backend_sched_eval_callback(callback)
        self.user_data = None

    def begin(self, rows: F32 | None) -> None:
        self._rows = rows
        self._captured = self._overwritten = 0

    @property
    def captured(self) -> int:
        return self._captured

    @property
    def overwritten(self) -> int:
        return self._overwritten


def make_capture(
    ll: Any, choice: EvalCallback, *, target: bytes | None, overwrite: bytes | None, out: F32, n_embd: int, row: int
) -> Capture:
    """The capture ``choice`` names: ``auto`` is the compiled one where it is built (else the Python one,
    with a warning), ``compiled`` refuses (``EngineError``) where it is not."""
    if target is None and overwrite is None:
        raise ValueError("an eval capture needs a node to copy out or one to overwrite")
    if choice == "python" or (choice == "auto" and not compiled_available()):
        if choice == "auto":
            _warn_python_once()
        return PythonCapture(ll, target=target, overwrite=overwrite, out=out, n_embd=n_embd, row=row)
    return CompiledCapture(ll, target=target, overwrite=overwrite, out=out, n_embd=n_embd, row=row)


@functools.cache
def _warn_python_once() -> None:
    log.warning(
        "llama.cpp shards use the Python eval callback (~0.5 ms slower a decode step on 10 layers): %s",
        _compiled_eval()[1],
    )
