"""Tensor bodies of the hop protocol: dtypes, shapes, encoding and the one decoder.

A hop request carries one raw tensor: token ids (int32) at the head, activations elsewhere in
float32, float16 or bfloat16 (little-endian, C order). ``X-Meshnet-Shape`` gives its shape and
``X-Meshnet-Dtype`` its element type; the body length must equal shape x element size. Every
malformed body maps to ``SeamMismatch`` (400) or ``PayloadTooLarge`` (413) here — nothing else
in Meshnet parses tensor bytes. See docs/protocol.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meshnet.errors import PayloadTooLarge, SeamMismatch

__all__ = [
    "DTYPES",
    "TensorFrame",
    "checked_values",
    "decode_tensor",
    "encode_tensor",
    "format_shape",
    "frame_of",
    "frame_values",
    "parse_range",
    "parse_shape",
    "read_frame",
    "split_token_ids",
    "token_ids_prefix",
]

# Wire dtype name -> (element size, numpy storage dtype). bfloat16 travels as raw uint16.
DTYPES: dict[str, tuple[int, np.dtype[np.generic]]] = {
    "float32": (4, np.dtype("<f4")),
    "float16": (2, np.dtype("<f2")),
    "bfloat16": (2, np.dtype("<u2")),
    "int32": (4, np.dtype("<i4")),
}
_MAX_RANK = 4


@dataclass(frozen=True, slots=True)
class TensorFrame:
    shape: tuple[int, ...]
    dtype: str
    body: bytes


def parse_shape(text: str | None) -> tuple[int, ...]:
    if not text:
        raise SeamMismatch("header X-Meshnet-Shape is required, e.g. '1,16,576'")
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SeamMismatch(f"X-Meshnet-Shape {text!r} must be comma-separated integers, e.g. '1,16,576'") from None
    if not 1 <= len(shape) <= _MAX_RANK or any(d <= 0 for d in shape):
        raise SeamMismatch(f"X-Meshnet-Shape {text!r} must have 1-{_MAX_RANK} positive dimensions")
    return shape


def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in shape)


def parse_range(text: str | None) -> tuple[int, int]:
    """``X-Meshnet-Token-Range: A-B`` (inclusive) → ``(A, B + 1)``."""
    if not text:
        raise SeamMismatch("header X-Meshnet-Token-Range is required on prefill, e.g. '0-15'")
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise SeamMismatch(f"X-Meshnet-Token-Range {text!r} must look like 'FIRST-LAST', e.g. '0-15'") from None
    if not sep or a < 0 or b < a:
        raise SeamMismatch(f"X-Meshnet-Token-Range {text!r} must satisfy 0 <= FIRST <= LAST")
    return a, b + 1


def decode_tensor(
    body: bytes, shape_header: str | None, dtype_header: str | None, *, max_bytes: int
) -> npt.NDArray[np.float32] | npt.NDArray[np.int32]:
    """Validate and decode a hop body: int32 stays int32, every float dtype becomes float32."""
    return checked_values(read_frame(body, shape_header, dtype_header, max_bytes=max_bytes))


def read_frame(body: bytes, shape_header: str | None, dtype_header: str | None, *, max_bytes: int) -> TensorFrame:
    """A hop body as a frame whose size matches its shape and dtype; its values are read later
    (``checked_values``), by the one that knows what it must hold."""
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes exceeds this node's limit of {max_bytes} bytes")
    dtype = (dtype_header or "").strip().lower()
    if dtype not in DTYPES:
        raise SeamMismatch(f"X-Meshnet-Dtype {dtype_header!r} is not supported; use one of {', '.join(DTYPES)}")
    return frame_of(body, parse_shape(shape_header), dtype)


def frame_of(body: bytes, shape: tuple[int, ...], dtype: str) -> TensorFrame:
    """``body`` as a frame of ``shape`` and ``dtype`` (one of ``DTYPES``), its size checked against
    them (the body's own limit is the caller's)."""
    if not 1 <= len(shape) <= _MAX_RANK or any(d <= 0 for d in shape):
        raise SeamMismatch(f"a tensor shape {format_shape(shape)!r} must have 1-{_MAX_RANK} positive dimensions")
    expected = math.prod(shape) * DTYPES[dtype][0]
    if len(body) != expected:
        raise SeamMismatch(
            f"body is {len(body)} bytes but shape {format_shape(shape)} of {dtype} needs {expected} bytes"
        )
    return TensorFrame(shape, dtype, body)


def checked_values(frame: TensorFrame) -> npt.NDArray[np.float32] | npt.NDArray[np.int32]:
    """The values of a frame ``read_frame`` accepted: int32 as is, floats widened and all finite."""
    values = frame_values(frame)
    if frame.dtype != "int32" and not np.isfinite(values).all():
        raise SeamMismatch("activations contain NaN or Inf")
    return values


def frame_values(frame: TensorFrame) -> npt.NDArray[np.float32] | npt.NDArray[np.int32]:
    """What the receiver of ``frame`` will compute from (float32, or int32 token ids), unchecked."""
    raw = np.frombuffer(frame.body, dtype=DTYPES[frame.dtype][1]).reshape(frame.shape)
    return raw.astype(np.int32) if frame.dtype == "int32" else _widen(raw, frame.dtype)


def _widen(raw: npt.NDArray[np.generic], dtype: str) -> npt.NDArray[np.float32]:
    # bfloat16 is the top half of a float32: widen by shifting the bits back into place.
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def encode_tensor(values: npt.NDArray[np.generic], dtype: str) -> TensorFrame:
    """Encode token ids (int32) or activations (as ``dtype``) for the wire."""
    if dtype not in DTYPES:
        raise SeamMismatch(f"cannot encode dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in values.shape)
    if dtype == "int32":
        data = np.ascontiguousarray(values, dtype="<i4").tobytes()
    elif dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        # Round to nearest even, as torch and llama.cpp do when they narrow float32 to bfloat16.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # Rounding must not carry a NaN's payload into a number: keep NaNs NaN (the receiver refuses them).
        rounded = np.where(np.isnan(bits.view(np.float32)), 0x7FC0, rounded)
        data = rounded.astype("<u2").tobytes()
    else:
        data = np.ascontiguousarray(values, dtype=DTYPES[dtype][1]).tobytes()
    return TensorFrame(shape, dtype, data)


def token_ids_prefix(ids: npt.NDArray[np.generic]) -> bytes:
    """The token ids that go first in a hop's body, before the activations (``X-Meshnet-Token-Ids``):
    int32 little-endian, one per position of the chunk."""
    return np.ascontiguousarray(ids, dtype="<i4").reshape(-1).tobytes()


def split_token_ids(body: bytes, announced: str, n: int) -> tuple[npt.NDArray[np.int32], bytes]:
    """``(ids, activations body)`` of a body whose ``X-Meshnet-Token-Ids`` header is ``announced``."""
    if announced != str(n):
        raise SeamMismatch(f"X-Meshnet-Token-Ids must be the chunk's position count {n}, got {announced!r}")
    if len(body) < 4 * n:
        raise SeamMismatch(f"the body is shorter than the {n} token ids X-Meshnet-Token-Ids announces")
    return np.frombuffer(body[: 4 * n], dtype="<i4").astype(np.int32), body[4 * n :]
