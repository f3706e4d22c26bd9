"""Prompt prefixes as chained block hashes, and the compact filter nodes advertise them in.

A prompt's *blocks* are its consecutive runs of ``block`` token ids from position 0 (the
gateway's prefill chunk: a block is computed as exactly one compute call, so cached KV has the
bits a cold prefill would give, protocol.ledger). Block ``i``'s hash covers every token before
its end, chained as vLLM and SGLang do::

    h_0 = blake2b("meshnet-prefix" ‖ block ‖ namespace) (the seed: other block sizes never match)
    h_i = blake2b(h_{i-1} ‖ int32 LE ids of block i)    (8 bytes each)

The gateway hashes each API key's prompts in a namespace of its own (``namespace``: a digest of
the key; empty on a gateway without keys), so a key never reuses, and so never learns from
``cached_tokens`` or timing, what another key recently sent: the caches hold both, apart.

Equal hashes mean equal prefixes (up to a 2^-64 collision, which the ledger digests still
catch: the gateway checks the reused KV's digests against its own token ids before it streams a
token). Only full blocks are hashed; a prompt holds ``len // block`` of them.

``PrefixFilter``: the hashes a node holds, as a Bloom filter of ``FILTER_BITS`` bits (2 KiB; four
probes per hash). The tracker reads it to count, per candidate node, the prompt blocks it would not
recompute; a false positive (about 2% at 1,500 blocks) only makes a route look warmer than it is:
the node's own lookup (``POST …/prefix``) finds the truth.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Iterable, Sequence

__all__ = [
    "FILTER_BITS",
    "HASH_BYTES",
    "MAX_PREFIX_BLOCKS",
    "PrefixFilter",
    "block_hashes",
    "format_prefix",
    "matched_blocks",
    "parse_prefix",
]

HASH_BYTES = 8
FILTER_BITS = 1 << 14
_PROBES = 4
# The most blocks one session names (X-Meshnet-Prefix): 512 blocks of 128 = the first 64K tokens
# of a prompt; a header of them is under 9 KiB.
MAX_PREFIX_BLOCKS = 512


def block_hashes(
    tokens: Sequence[int], block: int, *, limit: int = MAX_PREFIX_BLOCKS, namespace: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full ``block``-token blocks of ``tokens`` (at most ``limit``), in
    ``namespace`` (folded into the seed: equal prompts in two namespaces share no hash)."""
    if block < 1:
        raise ValueError(f"a prefix block holds at least one token, got {block}")
    seed = b"meshnet-prefix" + struct.pack("<I", block) + namespace
    previous = hashlib.blake2b(seed, digest_size=HASH_BYTES).digest()
    out: list[bytes] = []
    for begin in range(0, min(len(tokens) // block, limit) * block, block):
        ids = struct.pack(f"<{block}i", *tokens[begin : begin + block])
        previous = hashlib.blake2b(previous + ids, digest_size=HASH_BYTES).digest()
        out.append(previous)
    return out


def format_prefix(block: int, hashes: Sequence[bytes]) -> str:
    """``X-Meshnet-Prefix``: ``BLOCK:HEX,HEX,...``."""
    return f"{block}:" + ",".join(h.hex() for h in hashes)


def parse_prefix(text: str) -> tuple[int, tuple[bytes, ...]]:
    """``(block, hashes)`` of an ``X-Meshnet-Prefix`` value; ``ValueError`` saying what is wrong."""
    size, sep, rest = text.strip().partition(":")
    if not sep or not (size.isascii() and size.isdigit()) or not 1 <= int(size) <= 1 << 16:
        raise ValueError("must be BLOCK:HASH,HASH,... with BLOCK the block size in tokens (1..65536)")
    hashes: list[bytes] = []
    for part in rest.split(",") if rest else []:
        try:
            raw = bytes.fromhex(part)
        except ValueError:
            raw = b""
        if len(raw) != HASH_BYTES:
            raise ValueError(f"block hash {part[:40]!r} is not {2 * HASH_BYTES} hex digits")
        hashes.append(raw)
    if len(hashes) > MAX_PREFIX_BLOCKS:
        raise ValueError(f"names {len(hashes)} blocks; at most {MAX_PREFIX_BLOCKS}")
    return int(size), tuple(hashes)


def matched_blocks(hashes: Sequence[bytes], held: PrefixFilter | Iterable[bytes]) -> int:
    """How many leading blocks of ``hashes`` ``held`` contains (chained: a miss ends the prefix)."""
    have = held if isinstance(held, PrefixFilter) else set(held)
    count = 0
    for h in hashes:
        if h not in have:
            break
        count += 1
    return count


class PrefixFilter:
    """A Bloom filter over block hashes (``FILTER_BITS`` bits, ``_PROBES`` probes)."""

    __slots__ = ("bits",)

    def __init__(self, bits: bytes | None = None) -> None:
        size = FILTER_BITS // 8
        if bits is not None and len(bits) != size:
            raise ValueError(f"a prefix filter is {size} bytes, got {len(bits)}")
        self.bits = bytearray(bits if bits is not None else size)

    @staticmethod
    def _slots(h: bytes) -> tuple[int, ...]:
        return tuple(v % FILTER_BITS for v in struct.unpack("<4H", h[:8]))

    def add(self, h: bytes) -> None:
        for slot in self._slots(h):
            self.bits[slot >> 3] |= 1 << (slot & 7)

    def __contains__(self, h: object) -> bool:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            return False
        return all(self.bits[slot >> 3] >> (slot & 7) & 1 for slot in self._slots(h))

    def __bool__(self) -> bool:
        return any(self.bits)

    def encode(self) -> str:
        return base64.b64encode(bytes(self.bits)).decode()

    @classmethod
    def decode(cls, text: str) -> PrefixFilter:
        """``ValueError`` unless ``text`` is what ``encode`` wrote."""
        try:
            raw = base64.b64decode(text.encode(), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise ValueError("a prefix filter is base64") from None
        return cls(raw)

    @classmethod
    def of(cls, hashes: Iterable[bytes]) -> PrefixFilter:
        out = cls()
        for h in hashes:
            out.add(h)
        return out
