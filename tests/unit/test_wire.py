"""Golden bytes of the hop protocol's tensor bodies (docs/protocol.md, "Bodies").

The expected bytes are written out by hand from IEEE 754 / bfloat16 bit patterns, not produced
by the encoder: a change to any of them is a wire-format change and needs a protocol version.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.errors import PayloadTooLarge, SeamMismatch
from meshnet.protocol import headers as H
from meshnet.protocol.wire import (
    DTYPES,
    decode_tensor,
    encode_tensor,
    format_shape,
    parse_range,
    parse_shape,
    split_token_ids,
    token_ids_prefix,
)

BIG = 1 << 20
SAMPLE = [[[1.0, -2.5, 0.1]]]  # shape [1, 1, 3]: one position of a 3-wide seam


def f32_from_bits(*bits: int) -> np.ndarray:
    """float32 values with exact bit patterns, shape [1, 1, n]."""
    return np.array(bits, dtype=np.uint32).view(np.float32).reshape(1, 1, -1)


# -- the pinned names -------------------------------------------------------------------------


def test_header_names_are_pinned():
    assert (H.MODEL, H.ROUTE_ID, H.TOKEN_RANGE, H.SHAPE, H.DTYPE, H.POSITION) == (
        "X-Meshnet-Model",
        "X-Meshnet-Route-Id",
        "X-Meshnet-Token-Range",
        "X-Meshnet-Shape",
        "X-Meshnet-Dtype",
        "X-Meshnet-Position",
    )
    assert (H.NEXT_HOPS, H.SAMPLING, H.SAMPLE) == ("X-Meshnet-Next-Hops", "X-Meshnet-Sampling", "X-Meshnet-Sample")
    assert H.TOKEN_IDS == "X-Meshnet-Token-Ids"


def test_dtype_table_is_pinned():
    assert {name: size for name, (size, _) in DTYPES.items()} == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "int32": 4,
    }


# -- encode: golden bytes ---------------------------------------------------------------------


def test_encode_int32_golden():
    frame = encode_tensor(np.array([[1, 258]], dtype=np.int32), "int32")
    assert frame.shape == (1, 2)
    assert frame.dtype == "int32"
    assert frame.body.hex() == "0100000002010000"


def test_encode_int32_from_int64_and_negative_golden():
    frame = encode_tensor(np.array([[-1, 2**31 - 1]], dtype=np.int64), "int32")
    assert frame.body.hex() == "ffffffffffffff7f"


@pytest.mark.parametrize(
    ("dtype", "golden"),
    [
        # 1.0 = 0x3F800000, -2.5 = 0xC0200000, 0.1 = 0x3DCCCCCD
        ("float32", "0000803f000020c0cdcccc3d"),
        # 1.0 = 0x3C00, -2.5 = 0xC100, 0.1 -> 0x2E66 (0.0999755859375)
        ("float16", "003c00c1662e"),
        # top halves 0x3F80, 0xC020; 0.1's low half 0xCCCD > 0x8000 rounds 0x3DCC up to 0x3DCD
        ("bfloat16", "803f20c0cd3d"),
    ],
)
def test_encode_floats_golden(dtype: str, golden: str):
    frame = encode_tensor(np.array(SAMPLE, dtype=np.float32), dtype)
    assert frame.shape == (1, 1, 3)
    assert frame.dtype == dtype
    assert frame.body.hex() == golden


@pytest.mark.parametrize(
    ("bits", "golden", "why"),
    [
        (0x3F808000, "803f", "1.00390625: a tie, 0x3F80 is even -> stays (1.0)"),
        (0x3F818000, "823f", "1.01171875: a tie, 0x3F81 is odd -> up to even 0x3F82 (1.015625)"),
        (0x3F808001, "813f", "just above a tie -> up"),
        (0x3F807FFF, "803f", "just below a tie -> down"),
        (0xBF808000, "80bf", "-1.00390625: ties to even on the magnitude"),
        (0xBF818000, "82bf", "-1.01171875: ties to even on the magnitude"),
        (0x7F7FFFFF, "807f", "float32 max rounds up to +inf, as IEEE round-to-nearest does"),
        (0x7F800000, "807f", "+inf stays +inf"),
        (0xFF800000, "80ff", "-inf stays -inf"),
        (0x7FC00000, "c07f", "the canonical quiet NaN stays a NaN"),
        (0x00000001, "0000", "the smallest subnormal rounds to +0"),
    ],
)
def test_encode_bfloat16_rounds_to_nearest_even(bits: int, golden: str, why: str):
    assert encode_tensor(f32_from_bits(bits), "bfloat16").body.hex() == golden, why


def test_encode_is_little_endian_c_order_whatever_the_input_layout():
    values = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=">f4").T  # big-endian and Fortran-ordered
    assert not values.flags.c_contiguous
    frame = encode_tensor(values, "float32")
    assert frame.shape == (2, 2)
    # C order of the transposed matrix: 1, 3, 2, 4
    assert frame.body.hex() == "0000803f000040400000004000008040"


def test_encode_refuses_an_unknown_dtype():
    with pytest.raises(
        SeamMismatch, match=r"cannot encode dtype 'float64'; use one of float32, float16, bfloat16, int32"
    ):
        encode_tensor(np.zeros((1, 1), dtype=np.float32), "float64")


@pytest.mark.parametrize("bits", [0x7FFFFFFF, 0xFFFFFFFF])
def test_bfloat16_never_turns_a_nan_into_a_number(bits: int):
    with pytest.raises(SeamMismatch):
        frame = encode_tensor(f32_from_bits(bits), "bfloat16")
        decode_tensor(frame.body, format_shape(frame.shape), frame.dtype, max_bytes=BIG)


# -- decode: golden bytes ---------------------------------------------------------------------


def test_decode_int32_golden():
    out = decode_tensor(bytes.fromhex("0100000002010000"), "1,2", "int32", max_bytes=BIG)
    assert out.dtype == np.int32
    assert out.tolist() == [[1, 258]]


@pytest.mark.parametrize(
    ("dtype", "body", "expected"),
    [
        ("float32", "0000803f000020c0cdcccc3d", [1.0, -2.5, np.float32(0.1)]),
        ("float16", "003c00c1662e", [1.0, -2.5, 0.0999755859375]),
        ("bfloat16", "803f20c0cd3d", [1.0, -2.5, 0.10009765625]),  # 0x3DCD0000
    ],
)
def test_decode_floats_golden(dtype: str, body: str, expected: list[float]):
    out = decode_tensor(bytes.fromhex(body), "1,1,3", dtype, max_bytes=BIG)
    assert out.dtype == np.float32  # every float dtype widens to float32 in memory
    assert out.shape == (1, 1, 3)
    assert out.reshape(-1).tolist() == [float(np.float32(v)) for v in expected]


def test_decode_dtype_header_is_case_and_space_insensitive():
    out = decode_tensor(bytes.fromhex("803f"), "1", " BFloat16 ", max_bytes=BIG)
    assert out.tolist() == [1.0]


def test_decode_accepts_a_body_of_exactly_max_bytes():
    assert decode_tensor(b"\0" * 8, "2", "float32", max_bytes=8).tolist() == [0.0, 0.0]


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_round_trip_is_exact_for_representable_values(dtype: str):
    # Small dyadic values are exact in every wire dtype; shape [1, n, 2, 3] is a multi-stream seam.
    values = (np.arange(-12, 12, dtype=np.float32) / 8).reshape(1, 2, 2, 6)[..., :3].copy()
    frame = encode_tensor(values, dtype)
    out = decode_tensor(frame.body, format_shape(frame.shape), frame.dtype, max_bytes=BIG)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def test_int32_round_trip():
    tokens = np.array([[0, 1, 255, 65535, 2**31 - 1]], dtype=np.int32)
    frame = encode_tensor(tokens, "int32")
    out = decode_tensor(frame.body, format_shape(frame.shape), "int32", max_bytes=BIG)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, tokens)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float16", 2**-11), ("bfloat16", 2**-8)])
def test_lossy_round_trip_stays_within_half_an_ulp(dtype: str, tolerance: float):
    values = np.random.default_rng(7).standard_normal((1, 16, 8)).astype(np.float32)
    frame = encode_tensor(values, dtype)
    out = decode_tensor(frame.body, format_shape(frame.shape), dtype, max_bytes=BIG)
    np.testing.assert_array_less(np.abs(out - values), tolerance * np.abs(values) + 1e-7)


# -- decode: every malformed input ------------------------------------------------------------


def test_decode_over_max_bytes_is_payload_too_large_before_any_other_check():
    with pytest.raises(PayloadTooLarge, match=r"^body of 13 bytes exceeds this node's limit of 12 bytes$") as info:
        decode_tensor(b"\0" * 13, None, "no-such-dtype", max_bytes=12)
    assert (info.value.status, info.value.code) == (413, "payload_too_large")


@pytest.mark.parametrize("dtype", [None, "", "float64", "int64", "bf16"])
def test_decode_refuses_an_unsupported_dtype(dtype: str | None):
    with pytest.raises(SeamMismatch, match=r"X-Meshnet-Dtype .* is not supported; use one of float32, float16") as info:
        decode_tensor(b"\0" * 4, "1", dtype, max_bytes=BIG)
    assert repr(dtype) in info.value.message
    assert (info.value.status, info.value.code) == (400, "seam_mismatch")


@pytest.mark.parametrize("shape", [None, ""])
def test_decode_needs_a_shape(shape: str | None):
    with pytest.raises(SeamMismatch, match=r"header X-Meshnet-Shape is required, e\.g\. '1,16,576'"):
        decode_tensor(b"\0" * 4, shape, "float32", max_bytes=BIG)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ("1,x", "must be comma-separated integers"),
        ("1.0", "must be comma-separated integers"),
        ("1,,1", "must be comma-separated integers"),
        ("0", "must have 1-4 positive dimensions"),
        ("1,-1", "must have 1-4 positive dimensions"),
        ("1,1,1,1,1", "must have 1-4 positive dimensions"),
    ],
)
def test_decode_refuses_a_bad_shape(shape: str, match: str):
    with pytest.raises(SeamMismatch, match=match) as info:
        decode_tensor(b"\0" * 4, shape, "float32", max_bytes=BIG)
    assert repr(shape) in info.value.message


@pytest.mark.parametrize(
    ("body_len", "shape", "dtype", "message"),
    [
        (11, "1,3", "float32", "body is 11 bytes but shape 1,3 of float32 needs 12 bytes"),
        (13, "1,3", "float32", "body is 13 bytes but shape 1,3 of float32 needs 12 bytes"),
        (0, "1", "int32", "body is 0 bytes but shape 1 of int32 needs 4 bytes"),
        (8, "1,2,3", "bfloat16", "body is 8 bytes but shape 1,2,3 of bfloat16 needs 12 bytes"),
        (24, "1,2,3", "float16", "body is 24 bytes but shape 1,2,3 of float16 needs 12 bytes"),
    ],
)
def test_decode_refuses_a_body_of_the_wrong_length(body_len: int, shape: str, dtype: str, message: str):
    with pytest.raises(SeamMismatch) as info:
        decode_tensor(b"\0" * body_len, shape, dtype, max_bytes=BIG)
    assert info.value.message == message


@pytest.mark.parametrize(
    ("dtype", "body"),
    [
        ("float32", "0000c07f"),  # NaN
        ("float32", "0000807f"),  # +inf
        ("float32", "000080ff"),  # -inf
        ("float16", "007e"),  # NaN
        ("float16", "007c"),  # +inf
        ("float16", "00fc"),  # -inf
        ("bfloat16", "c07f"),  # NaN
        ("bfloat16", "807f"),  # +inf
        ("bfloat16", "80ff"),  # -inf
    ],
)
def test_decode_refuses_nan_and_inf(dtype: str, body: str):
    good = encode_tensor(np.ones((1, 1, 2), dtype=np.float32), dtype).body
    with pytest.raises(SeamMismatch, match=r"^activations contain NaN or Inf$"):
        decode_tensor(good + bytes.fromhex(body), "1,1,3", dtype, max_bytes=BIG)


def test_int32_bodies_have_no_float_check():
    # 0x7FC00000 is a NaN as float32, a token id as int32: the head checks the vocabulary instead.
    assert decode_tensor(bytes.fromhex("0000c07f"), "1,1", "int32", max_bytes=BIG).tolist() == [[0x7FC00000]]


# -- header parsers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", (1,)), ("1,16,576", (1, 16, 576)), ("1,4,2,8", (1, 4, 2, 8)), ("1, 2", (1, 2))],
)
def test_parse_shape(text: str, expected: tuple[int, ...]):
    assert parse_shape(text) == expected
    assert parse_shape(format_shape(expected)) == expected


def test_format_shape():
    assert format_shape((1, 16, 576)) == "1,16,576"
    assert format_shape((7,)) == "7"


@pytest.mark.parametrize(("text", "expected"), [("0-15", (0, 16)), ("5-5", (5, 6)), ("128-255", (128, 256))])
def test_parse_range_is_inclusive(text: str, expected: tuple[int, int]):
    assert parse_range(text) == expected


@pytest.mark.parametrize("text", [None, ""])
def test_parse_range_is_required(text: str | None):
    with pytest.raises(SeamMismatch, match=r"header X-Meshnet-Token-Range is required on prefill, e\.g\. '0-15'"):
        parse_range(text)


@pytest.mark.parametrize("text", ["7", "0-", "-3", "-1-3", "a-b", "1.5-2", "0-2-3", "0:15"])
def test_parse_range_refuses_a_malformed_range(text: str):
    with pytest.raises(SeamMismatch, match=r"must look like 'FIRST-LAST', e\.g\. '0-15'") as info:
        parse_range(text)
    assert repr(text) in info.value.message


@pytest.mark.parametrize("text", ["5-4", "0--1"])
def test_parse_range_refuses_last_before_first(text: str):
    with pytest.raises(SeamMismatch, match=r"must satisfy 0 <= FIRST <= LAST"):
        parse_range(text)


# -- token ids beside activations (X-Meshnet-Token-Ids) ---------------------------------------------
def test_token_ids_go_first_in_the_body_golden():
    ids = token_ids_prefix(np.array([[1, 258]], dtype=np.int64))
    hidden = encode_tensor(np.array([[[1.0], [-2.5]]], dtype=np.float32), "float32").body
    assert (ids + hidden).hex() == "01000000020100000000803f000020c0"
    got, rest = split_token_ids(ids + hidden, "2", 2)
    assert got.tolist() == [1, 258] and got.dtype == np.int32 and rest == hidden


@pytest.mark.parametrize(
    ("announced", "body", "needle"), [("3", b"\0" * 8, "position count 2"), ("2", b"\0" * 7, "shorter")]
)
def test_token_ids_that_do_not_fit_the_chunk_are_refused(announced: str, body: bytes, needle: str):
    with pytest.raises(SeamMismatch, match=needle):
        split_token_ids(body, announced, 2)
