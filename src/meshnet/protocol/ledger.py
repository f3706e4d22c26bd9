"""How a session's positions were computed: chunk lists and the running digest of each hop's inputs.

Why chunks matter: llama.cpp's CPU kernels do not give bit-identical results for a position
computed in a chunk of 64 positions or more and the same position computed in a smaller chunk
(measured on the bundled model: chunks of 1 to 63 agree to the bit, 64 and up take other kernels
and differ in the low bits). The KV a hop keeps therefore depends on how its positions were
chunked, and a route repair that rebuilt a hop from one big replay chunk gave it slightly
different KV than the hop it replaced: greedy text diverged a few dozen tokens later, fluent and
with no error. So every position is recomputed in exactly the chunk it was first computed in:
``X-Meshnet-Chunks`` tells a hop how to split one request body into compute calls, and each
hop records the chunk list it computed (its *ledger*).

The digest makes any remaining inconsistency impossible to miss: each hop keeps, per session,
a running digest over every chunk it computed — the chunk's start, size and input bytes (int32
token ids at the head, the float32 activations it received elsewhere) — and a second one over
what it sent onward. Answers carry them; the gateway computes the head's from its own token ids
and checks every seam (what a hop sent equals what the next one computed from). A route that
lost, doubled, misplaced or re-chunked a position fails the check, and the generation stops
with the reason instead of streaming text from it.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshnet.errors import RouteInconsistent, SeamMismatch
from meshnet.routes import Hop

if TYPE_CHECKING:
    from meshnet.protocol.messages import HopEntry

__all__ = [
    "DIGEST_BYTES",
    "EMPTY_DIGEST",
    "ChunkLedger",
    "check_answered_by",
    "extend_digest",
    "format_chunks",
    "pack_chunks",
    "parse_chunks",
    "verify_hops",
]

DIGEST_BYTES = 16
EMPTY_DIGEST = bytes(DIGEST_BYTES)  # the digest of a session with no positions
_MAX_CHUNK_ENTRIES = 4096  # run-length entries in one X-Meshnet-Chunks header


def extend_digest(previous: bytes, start: int, size: int, data: bytes) -> bytes:
    """The running digest after one more chunk of ``size`` positions from ``start`` with input ``data``."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_BYTES)
    h.update(struct.pack("<QQ", start, size))
    h.update(data)
    return h.digest()


def format_chunks(sizes: Sequence[int]) -> str:
    """``[128, 128, 37, 1, 1, 1]`` → ``"128x2,37,1x3"`` (run-length, ``SIZExCOUNT``)."""
    parts: list[str] = []
    for size, count in _runs(sizes):
        parts.append(f"{size}x{count}" if count > 1 else str(size))
    return ",".join(parts)


def parse_chunks(text: str | None, n: int) -> tuple[int, ...]:
    """``X-Meshnet-Chunks`` of a body of ``n`` positions; absent means one chunk of ``n``."""
    if text is None or not text.strip():
        return (n,)
    sizes: list[int] = []
    entries = text.split(",")
    if len(entries) > _MAX_CHUNK_ENTRIES:
        raise SeamMismatch(f"X-Meshnet-Chunks has {len(entries)} entries; at most {_MAX_CHUNK_ENTRIES}")
    for entry in entries:
        size, _, count = entry.strip().partition("x")
        if not (size.isascii() and size.isdigit() and (not count or (count.isascii() and count.isdigit()))):
            raise SeamMismatch(f"X-Meshnet-Chunks entry {entry!r} must be SIZE or SIZExCOUNT, e.g. '128x2,37,1x3'")
        repeat = int(count) if count else 1
        if int(size) < 1 or repeat < 1 or len(sizes) + repeat > n:
            raise SeamMismatch(f"X-Meshnet-Chunks {text!r} does not split the body's {n} positions")
        sizes += [int(size)] * repeat
    if sum(sizes) != n:
        raise SeamMismatch(f"X-Meshnet-Chunks {text!r} adds up to {sum(sizes)} positions, the body holds {n}")
    return tuple(sizes)


def pack_chunks(sizes: Sequence[int], per_request: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """Group consecutive chunks into requests of at most ``per_request`` positions (a bigger chunk
    travels alone): yields ``(start, sizes)`` per request."""
    start, total = 0, 0
    group: list[int] = []
    for size in sizes:
        if group and total + size > per_request:
            yield start, tuple(group)
            start, group, total = start + total, [], 0
        group.append(size)
        total += size
    if group:
        yield start, tuple(group)


def _runs(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    run: list[int] = []
    for size in sizes:
        if run and run[0] != size:
            yield run[0], len(run)
            run = []
        run.append(size)
    if run:
        yield run[0], len(run)


@dataclass
class ChunkLedger:
    """One session's record on one hop: the chunks it computed, in order, with running digests.

    ``inputs[i]`` / ``outputs[i]`` are the digests after chunk ``i``; ``outputs`` is kept only by
    a hop that ``sends`` onward (not the tail). Not thread-safe: its node mutates it on one event loop.
    """

    sends: bool
    ends: list[int] = field(default_factory=list)
    inputs: list[bytes] = field(default_factory=list)
    outputs: list[bytes] = field(default_factory=list)

    @property
    def position(self) -> int:
        return self.ends[-1] if self.ends else 0

    def sizes(self) -> list[int]:
        return [end - begin for begin, end in zip([0, *self.ends], self.ends, strict=False)]

    def record(self, size: int, data: bytes, sent: bytes = b"") -> None:
        """One more chunk of ``size`` positions computed from ``data`` (and ``sent`` onward by a hop that sends)."""
        start = self.position
        self.inputs.append(extend_digest(self.inputs[-1] if self.inputs else EMPTY_DIGEST, start, size, data))
        if self.sends:
            self.outputs.append(extend_digest(self.outputs[-1] if self.outputs else EMPTY_DIGEST, start, size, sent))
        self.ends.append(start + size)

    def rewind(self, position: int) -> bool:
        """Forget the chunks past ``position``; False when ``position`` falls inside a chunk (the
        record can no longer describe the session, so it is cleared and every check will fail)."""
        while self.ends and self.ends[-1] > position:
            self.ends.pop()
            self.inputs.pop()
            if self.sends:
                self.outputs.pop()
        if self.position != position:
            self.ends.clear()
            self.inputs.clear()
            self.outputs.clear()
            return False
        return True

    def at(self, position: int) -> ChunkLedger:
        """The record as it stood when it held ``position`` positions (what ``describe`` says then), for
        checking an answer to an earlier request while later ones are in flight; ``ValueError`` when
        no chunk ends there."""
        index = bisect.bisect_left(self.ends, position)
        if position == 0:
            return ChunkLedger(self.sends)
        if index >= len(self.ends) or self.ends[index] != position:
            raise ValueError(f"no chunk of this session ends at position {position}")
        return ChunkLedger(self.sends, [position], [self.inputs[index]], [self.outputs[index]] if self.sends else [])

    def describe(self) -> dict[str, object]:
        """What an answer says about this hop's session: the positions it holds and the two digests."""
        fields: dict[str, object] = {
            "held": self.position,
            "input_digest": (self.inputs[-1] if self.inputs else EMPTY_DIGEST).hex(),
        }
        if self.sends:
            fields["output_digest"] = (self.outputs[-1] if self.outputs else EMPTY_DIGEST).hex()
        return fields


def check_answered_by(route: Sequence[Hop], hops: Sequence[HopEntry]) -> None:
    """Raise ``RouteInconsistent`` unless an answer's ``hops`` entries name the nodes of ``route``,
    one each, in order."""
    if [h.node for h in hops] != [h.node for h in route]:
        raise RouteInconsistent(
            f"the route answered for nodes {[h.node for h in hops]}; the session is on {[h.node for h in route]}"
        )


def verify_hops(expected: ChunkLedger, route: Sequence[Hop], hops: Sequence[HopEntry]) -> None:
    """Raise ``RouteInconsistent`` unless the ``hops`` entries of an answer show every hop of
    ``route`` holding the positions of ``expected`` (the gateway's own ledger of the token ids it
    sent), the head having computed them from those token ids in those chunks, and every other hop
    from exactly what the hop before it sent."""
    want = expected.describe()
    check_answered_by(route, hops)
    for i, (hop, seen) in enumerate(zip(route, hops, strict=True)):
        where = f"node {hop.node} (layers {hop.layers})"
        if seen.held != want["held"]:
            raise RouteInconsistent(f"{where} holds {seen.held} positions; the route should hold {want['held']}")
        sent = want["input_digest"] if i == 0 else hops[i - 1].output_digest
        if seen.input_digest != sent:
            source = "the gateway's token ids in its chunks" if i == 0 else f"what node {route[i - 1].node} sent it"
            raise RouteInconsistent(f"{where} computed its {want['held']} positions from other inputs than {source}")
