"""The two fields of ``struct ggml_tensor`` a llama.cpp shard reads in its eval callback, and the
check that they are where this code says they are.

The eval callback (``LlamaShard._make_callback``) gets a raw ``struct ggml_tensor *`` for every node
of every graph and must read its name and shape in well under a microsecond, so it reads them at
fixed offsets instead of calling back into libggml. The offsets are those of ``ggml.h`` at the
llama.cpp commit llama-cpp-python 0.3.36 vendors::

    type(4) + pad(4), buffer(8), ne[4] int64 at 16, nb[4] at 48, op(4) at 80, op_params[16] int32
    at 84, flags at 148, src[10] at 152, view_src at 232, view_offs at 240, data at 248, name[64] at 256

Another llama.cpp may move them, and the callback would then read garbage: no error, wrong rows.
:func:`check_tensor_layout` makes a tensor of a known name and shape with libggml's own functions
(no model, no allocation) and reads it back at the offsets; a shard refuses to load when they do
not hold. docs/backends.md says what else to re-check on an upgrade.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnet.errors import EngineError

__all__ = [
    "NAME_OFFSET",
    "NE_OFFSET",
    "RowsToFloat",
    "check_tensor_layout",
    "rows_to_float",
    "tensor_get",
    "tensor_set",
]

NE_OFFSET = 16
NAME_OFFSET = 256
_GGML_TYPE_F32 = 0
_PROBE_NAME = b"meshnet-layout-probe"
_PROBE_SHAPE = (7, 3)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@functools.cache
def _base(llama_cpp: Any) -> ctypes.CDLL:
    """libggml-base as llama-cpp-python ships it."""
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))


def _data_fn(llama_cpp: Any, name: str) -> Any:
    """``name``, a ``(tensor, data, offset, size)`` function of libggml-base."""
    fn = getattr(_base(llama_cpp), name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    fn.restype = None
    return fn


@functools.cache
def tensor_get(llama_cpp: Any) -> Any:
    return _data_fn(llama_cpp, "ggml_backend_tensor_get")


@functools.cache
def tensor_set(llama_cpp: Any) -> Any:
    return _data_fn(llama_cpp, "ggml_backend_tensor_set")


def _probe(llama_cpp: Any, ne_offset: int, name_offset: int) -> str | None:
    """What is wrong with the offsets, read off a probe tensor; ``None`` when they hold."""
    lib = _base(llama_cpp)
    lib.ggml_init.argtypes, lib.ggml_init.restype = [_InitParams], ctypes.c_void_p
    lib.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.ggml_new_tensor_2d.restype = ctypes.c_void_p
    lib.ggml_set_name.argtypes, lib.ggml_set_name.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.ggml_free.argtypes, lib.ggml_free.restype = [ctypes.c_void_p], None
    ctx = lib.ggml_init(_InitParams(1 << 16, None, True))  # metadata only: no tensor data is allocated
    if not ctx:
        return "ggml_init failed"
    try:
        tensor = lib.ggml_new_tensor_2d(ctx, _GGML_TYPE_F32, *_PROBE_SHAPE)
        lib.ggml_set_name(tensor, _PROBE_NAME)
        problems = []
        if lib.ggml_get_name(tensor) - tensor != name_offset:
            problems.append(f"name is at {lib.ggml_get_name(tensor) - tensor}, not {name_offset}")
        elif ctypes.string_at(tensor + name_offset, len(_PROBE_NAME)) != _PROBE_NAME:
            problems.append(f"the name read at {name_offset} is not the probe's")
        ne = [ctypes.c_int64.from_address(tensor + ne_offset + 8 * i).value for i in range(4)]
        if ne != [*_PROBE_SHAPE, 1, 1]:
            problems.append(f"ne[] read at {ne_offset} is {ne}, not {[*_PROBE_SHAPE, 1, 1]}")
        return "; ".join(problems) or None
    finally:
        lib.ggml_free(ctx)


def check_tensor_layout(llama_cpp: Any, *, ne_offset: int = NE_OFFSET, name_offset: int = NAME_OFFSET) -> None:
    """Raise :class:`EngineError` unless ``struct ggml_tensor``'s ``ne`` and ``name`` are at these
    offsets in the llama.cpp this process loaded (checked once per process for the real offsets)."""
    wrong = _checked(llama_cpp, ne_offset, name_offset)
    if wrong is not None:
        raise EngineError(
            f"this llama-cpp-python ({getattr(llama_cpp, '__version__', '?')}) lays out struct ggml_tensor "
            f"differently from the one meshnet's llama.cpp shards were written for (0.3.36): {wrong}. "
            "Install llama-cpp-python==0.3.36, or update meshnet/backends/ggml_layout.py (docs/backends.md, "
            "'Upgrading llama.cpp')"
        )


@functools.cache
def _checked(llama_cpp: Any, ne_offset: int, name_offset: int) -> str | None:
    return _probe(llama_cpp, ne_offset, name_offset)


class _TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h), as far as ``to_float``."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64)
RowsToFloat = Callable[[bytes, int, int], None]  # (blocks, float* out, elements)


@functools.cache
def rows_to_float(llama_cpp: Any, ggml_type: int, name: str, block: tuple[int, int]) -> RowsToFloat | None:
    """ggml's own ``to_float`` of a tensor type (``void(const void *, float *, int64_t)``): what llama.cpp's
    CPU ``get_rows`` dequantizes a token embedding with, ~10 µs a row where gguf-py's NumPy takes 50-150.
    None where ggml has none (f32) or where its traits do not describe the type as gguf-py does (``name``,
    ``block``: elements and bytes per block) — another ggml, whose struct the caller must not trust."""
    lib = _base(llama_cpp)
    lib.ggml_get_type_traits.argtypes, lib.ggml_get_type_traits.restype = [ctypes.c_int], ctypes.POINTER(_TypeTraits)
    traits = lib.ggml_get_type_traits(ggml_type).contents
    described = ((traits.type_name or b"").decode(errors="replace").lower(), traits.blck_size, traits.type_size)
    if not traits.to_float or described != (name.lower(), *block):  # ggml says "q4_K", gguf-py "Q4_K"
        return None
    return _TO_FLOAT(traits.to_float)
