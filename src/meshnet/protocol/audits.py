"""Audit sampling: a trusted auditor's signed re-execution of one hop, and the verdict it gives
(docs/security.md, "Audit sampling").

A gateway audits a secret fraction of its sessions. After such a session's last token, before it
closes the route, it fetches every non-tail hop's seam log (what each sent on: the next hop's
inputs, bit for bit, as the signed digests prove) and, per hop of the route, sends a trusted
*auditor* node of the same layers and numerics the hop's inputs in the chunks they were computed
in (token ids at the head). The auditor computes them in a scratch session and signs an
``AuditStatement``: the running digests of what it computed from and what it would have sent on
(``protocol.ledger``), and at the tail, for every position whose token the tail answered with a
committed draw, the token and draw its own logits give with the session's sampler and seed.

``judge`` compares a statement with what the audited hop signed: its receipt (its latest entry:
the same positions and inputs must give the same output digest) and, at the tail, its signed
answers. Inside one numerics class llama.cpp's CPU path is bit-exact across thread counts and
batch shapes when the chunks are the same, so the comparison is equality: an honest hop never
fails, and a hop that skipped a layer, ran another quantization, added noise, or committed a
distribution its layers do not give always does (on the positions audited).

The statement's signed bytes are ``b"meshnet-audit/1\\n"`` and the compact JSON of the statement
without its ``sig``, keys sorted. The tracker checks a report's statements against the auditors'
registered hop keys and the receipt against the key the audited node was pinned with, so neither
a gateway nor an auditor alone can fail an honest node.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature

from meshnet.errors import InvalidRequest
from meshnet.protocol.ledger import format_chunks, parse_chunks
from meshnet.protocol.messages import HopEntry
from meshnet.protocol.signing import HopKey, b64, public_key, unb64
from meshnet.sampling import Draw

__all__ = [
    "AUDIT_MAGIC",
    "PROBABILITY_TOLERANCE",
    "RESIDUAL_TOLERANCE",
    "AuditRequest",
    "AuditStatement",
    "AuditStep",
    "Finding",
    "Verdict",
    "answer_at",
    "draw_deviation",
    "judge",
    "sign_statement",
    "statement_signed_by",
    "token_at",
]

AUDIT_MAGIC = b"MNAU"  # an audit request's body (node.audit)
_DOMAIN = b"meshnet-audit/1\n"
MAX_STEPS = 1 << 20  # answered positions one statement may cover
# Across numerics classes (another backend or build), calibrated on the bundled model, llama.cpp's CPU
# build against the PyTorch reference (docs/security.md, "Audit sampling"; benchmarks/bench_audits):
# over 60 honest sessions, residual updates deviated by at most 0.048 of their size and committed
# probabilities by at most 0.078; about 2.5 times that.
RESIDUAL_TOLERANCE = 0.12
PROBABILITY_TOLERANCE = 0.2
Verdict = Literal["pass", "fail"]


@dataclass(frozen=True, slots=True)
class AuditStep:
    """At the tail: what the auditor's logits give at ``position`` (the token answered there), having
    computed from inputs whose running digest is ``input_digest``."""

    position: int
    input_digest: str
    token: int
    draw: Draw

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "input_digest": self.input_digest, "token": self.token,
                "draw": self.draw.to_json()}  # fmt: skip

    @classmethod
    def from_json(cls, raw: object) -> AuditStep:
        if not isinstance(raw, Mapping):
            raise ValueError("an audit step is an object")
        position, digest, token = raw.get("position"), raw.get("input_digest"), raw.get("token")
        if not (_count(position) and _count(token) and isinstance(digest, str)):
            raise ValueError('an audit step has a "position", an "input_digest" and a "token"')
        return cls(int(position), digest, int(token), Draw.from_json(raw.get("draw")))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class AuditStatement:
    """What an auditor computed for one hop of one session, signed with the auditor's hop key."""

    session: str
    node: str  # the audited node
    layers: str
    auditor: str  # the auditor's node id
    held: int  # positions re-executed: 0..held - 1
    input_digest: str
    output_digest: str | None = None  # a hop that sends on: the running digest of what it would send
    steps: tuple[AuditStep, ...] = ()  # the tail: one per position answered with a committed draw
    # Another numerics class (``AuditRequest.cross``): compared within ``tolerance`` (a hop that
    # sends on: the largest deviation of its positions' residual updates from the auditor's, which
    # compared what the hop sent, whose running digest is ``compared_digest``; the tail: its draws)
    tolerance: float | None = None
    deviation: float | None = None
    compared_digest: str | None = None
    signature: str | None = None

    def to_json(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "session": self.session, "node": self.node, "layers": self.layers, "auditor": self.auditor,
            "held": self.held, "input_digest": self.input_digest, "output_digest": self.output_digest,
            "steps": [s.to_json() for s in self.steps],
        }  # fmt: skip
        if self.tolerance is not None:
            raw.update(tolerance=self.tolerance, deviation=self.deviation, compared_digest=self.compared_digest)
        if self.signature is not None:
            raw["sig"] = self.signature
        return raw

    @classmethod
    def from_json(cls, raw: object) -> AuditStatement:
        """Raises ``ValueError`` on anything but a statement ``to_json`` could have written."""
        if not isinstance(raw, Mapping):
            raise ValueError("an audit statement is an object")
        texts = [raw.get(k) for k in ("session", "node", "layers", "auditor", "input_digest")]
        if not all(isinstance(t, str) and 0 < len(t) <= 512 for t in texts):
            raise ValueError('an audit statement names its "session", "node", "layers", "auditor", "input_digest"')
        held, out, steps, sig = raw.get("held"), raw.get("output_digest"), raw.get("steps", []), raw.get("sig")
        if not _count(held):
            raise ValueError('an audit statement\'s "held" is a count')
        if not (out is None or isinstance(out, str)) or not (sig is None or isinstance(sig, str)):
            raise ValueError('an audit statement\'s "output_digest" and "sig" are strings')
        if not isinstance(steps, list) or len(steps) > MAX_STEPS:
            raise ValueError(f'an audit statement\'s "steps" is a list of at most {MAX_STEPS}')
        tolerance, deviation, compared = raw.get("tolerance"), raw.get("deviation"), raw.get("compared_digest")
        if not all(v is None or (isinstance(v, float) and v >= 0) for v in (tolerance, deviation)):
            raise ValueError('an audit statement\'s "tolerance" and "deviation" are numbers >= 0')
        if not (compared is None or isinstance(compared, str)):
            raise ValueError('an audit statement\'s "compared_digest" is a string')
        session, node, layers, auditor, digest = (str(t) for t in texts)
        return cls(session, node, layers, auditor, int(held), digest, out,  # type: ignore[arg-type]
                   tuple(AuditStep.from_json(s) for s in steps), tolerance, deviation, compared, sig)  # fmt: skip


_HEADER = struct.Struct("<4sI")
_MAX_HEADER = 1 << 24
_WIRE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class AuditRequest:
    """What an auditor re-executes (``POST /v1/audit``): one hop's inputs of one session, positions
    ``0..held - 1`` in the chunks they were computed in — token ids at the head (``dtype`` int32),
    the activations the hop before it sent (its seam log) elsewhere — and the session's token ids
    (``ids``) where the layers read them or the tail's sampler needs them.

    Body: ``b"MNAU"`` ‖ u32 LE header length ‖ JSON header ‖ inputs ‖ ids."""

    session: str
    node: str
    layers: str
    chunks: tuple[int, ...]
    dtype: str  # of ``inputs``
    inputs: bytes
    wire_dtype: str = "float32"  # what the audited hop sent on (its output digest covers those values)
    ids: bytes = b""  # int32 LE, one per position (empty: not sent)
    sampling: dict[str, Any] | None = None  # the tail: the session's sampling parameters, seed included
    positions: tuple[int, ...] = ()  # the tail: the positions whose token it answered with a committed draw
    # Another numerics class than the hop's: the auditor compares within a tolerance, and needs what
    # the hop sent on (its seam log, in ``wire_dtype``; the tail: nothing) to compare against.
    cross: bool = False
    outputs: bytes = b""

    @property
    def held(self) -> int:
        return sum(self.chunks)

    def encode(self) -> bytes:
        header = {
            "session": self.session, "node": self.node, "layers": self.layers, "chunks": format_chunks(self.chunks),
            "dtype": self.dtype, "wire_dtype": self.wire_dtype, "inputs_bytes": len(self.inputs),
            "ids_bytes": len(self.ids), "sampling": self.sampling, "positions": list(self.positions),
            "cross": self.cross, "outputs_bytes": len(self.outputs),
        }  # fmt: skip
        raw = json.dumps(header, separators=(",", ":")).encode()
        return _HEADER.pack(AUDIT_MAGIC, len(raw)) + raw + self.inputs + self.ids + self.outputs

    @classmethod
    def decode(cls, body: bytes) -> AuditRequest:
        """``InvalidRequest`` (400) on anything but a body ``encode`` could have written."""
        if len(body) < _HEADER.size or body[:4] != AUDIT_MAGIC:
            raise InvalidRequest("an audit request's body starts with b'MNAU' and its header length")
        _, size = _HEADER.unpack_from(body)
        if size > _MAX_HEADER or _HEADER.size + size > len(body):
            raise InvalidRequest("an audit request's header length runs past its body")
        try:
            header = json.loads(body[_HEADER.size : _HEADER.size + size])
            return cls._of(header, body[_HEADER.size + size :])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidRequest(f"a malformed audit request header: {exc}") from None

    @classmethod
    def _of(cls, header: dict[str, Any], rest: bytes) -> AuditRequest:
        n_inputs, n_ids = int(header["inputs_bytes"]), int(header["ids_bytes"])
        n_outputs = int(header.get("outputs_bytes", 0))
        if min(n_inputs, n_ids, n_outputs) < 0 or n_inputs + n_ids + n_outputs != len(rest):
            raise ValueError(f"its parts add up to {n_inputs + n_ids + n_outputs} bytes; {len(rest)} follow the header")
        chunks = parse_chunks(str(header["chunks"]), _chunk_total(str(header["chunks"])))  # SeamMismatch: a 400
        dtype, wire = str(header["dtype"]), str(header.get("wire_dtype", "float32"))
        if dtype not in ("int32", *_WIRE_DTYPES) or wire not in _WIRE_DTYPES:
            raise ValueError(f"dtype {dtype!r} / wire_dtype {wire!r}: int32 or {', '.join(_WIRE_DTYPES)}")
        positions = tuple(int(p) for p in header.get("positions") or ())
        total = sum(chunks)
        if any(not 0 < p <= total for p in positions) or len(set(positions)) != len(positions):
            raise ValueError(f"positions are distinct, within 1..{total}")
        if n_ids not in (0, 4 * total):
            raise ValueError(f"ids are 4 bytes for each of the {total} positions, or none")
        sampling = header.get("sampling")
        if not (sampling is None or isinstance(sampling, dict)):
            raise ValueError("sampling is an object of sampling parameters")
        cross = header.get("cross", False)
        if not isinstance(cross, bool):
            raise ValueError("cross is true or false")
        ids = rest[n_inputs : n_inputs + n_ids]
        return cls(str(header["session"]), str(header["node"]), str(header["layers"]), chunks, dtype,
                   rest[:n_inputs], wire, ids, sampling, positions, cross, rest[n_inputs + n_ids :])  # fmt: skip


def _chunk_total(text: str) -> int:
    """The positions ``X-Meshnet-Chunks`` text describes (``parse_chunks`` checks it against them)."""
    total = 0
    for entry in text.split(","):
        size, _, count = entry.strip().partition("x")
        if not size.isdigit() or (count and not count.isdigit()):
            raise ValueError(f"chunks {text!r}: SIZE or SIZExCOUNT entries, e.g. '128x2,37,1x3'")
        total += int(size) * (int(count) if count else 1)
    if total < 1:
        raise ValueError("an audit covers at least one position")
    return total


def _signed_bytes(statement: AuditStatement) -> bytes:
    body = dataclasses.replace(statement, signature=None).to_json()
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_statement(key: HopKey, statement: AuditStatement) -> AuditStatement:
    return dataclasses.replace(statement, signature=b64(key.sign_bytes(_signed_bytes(statement))))


def statement_signed_by(key: str, statement: AuditStatement) -> bool:
    """Whether ``statement`` carries the signature of the auditor whose hop key is ``key``."""
    if statement.signature is None:
        return False
    try:
        public_key(key).verify(unb64(statement.signature), _signed_bytes(statement))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class Finding:
    verdict: Verdict
    reason: str
    position: int | None = None  # the tail: the first position whose answer its layers do not give
    deviation: float | None = None  # across numerics classes: the largest deviation measured


def judge(
    statement: AuditStatement,
    receipt: HopEntry,
    answers: Mapping[int, tuple[HopEntry, Mapping[str, Any]]] | None = None,
    *,
    complete: bool = True,
) -> Finding:
    """The verdict on the hop that signed ``receipt`` (its latest entry of the session) and, at the
    tail, ``answers`` (position -> its signed entry and the answer it vouched for): all of them
    (``complete``), or the ones a report brings as evidence. Signatures are the caller's to check;
    ``ValueError`` when the statement is not about that receipt's work."""
    if (statement.node, statement.layers) != (receipt.node, receipt.layers):
        raise ValueError(f"the statement is about node {statement.node} layers {statement.layers}, "
                         f"the receipt of node {receipt.node} layers {receipt.layers}")  # fmt: skip
    if statement.held != receipt.held or statement.input_digest != receipt.input_digest:
        raise ValueError(
            f"the auditor computed {statement.held} positions from other inputs than node {receipt.node} "
            f"signed for ({receipt.held} positions)"
        )
    if statement.tolerance is not None:
        return _judge_across(statement, receipt, answers or {}, complete=complete)
    if receipt.output_digest is not None:
        if statement.output_digest != receipt.output_digest:
            return Finding("fail", f"layers {receipt.layers} of its {receipt.held} positions give other "
                                   "activations than it sent on (its signed output digest)")  # fmt: skip
        return Finding("pass", f"{receipt.held} positions re-executed bit for bit")
    return _judge_tail(statement, receipt, answers or {}, complete=complete)


def _judge_tail(
    statement: AuditStatement, receipt: HopEntry, answers: Mapping[int, tuple[HopEntry, Mapping[str, Any]]],
    *, complete: bool,
) -> Finding:  # fmt: skip
    steps = _steps(statement, answers, complete=complete)
    for position in sorted(answers):
        entry, claim = answers[position]
        step = steps[position]
        # A one-token answer's entry describes the inputs up to it; a verify chunk's, the whole chunk
        # (its inputs are bound by the receipt: the statement's inputs are the tail's, checked above).
        if "token" in claim and entry.input_digest != step.input_digest:
            raise ValueError(f"at position {position} the auditor computed from other inputs than the tail")
        token, draw = token_at(claim, position), claim.get("draw")
        if token != step.token:
            return Finding("fail", f"at position {position} it answered token {token}; its layers and the "
                                   f"session's seed give token {step.token}", position)  # fmt: skip
        if draw is not None and draw != step.draw.to_json():
            return Finding("fail", f"at position {position} it committed to a distribution its layers do not give",
                           position)  # fmt: skip
    why = f"{receipt.held} positions re-executed, {len(answers)} answered tokens re-derived bit for bit"
    return Finding("pass", why)


def _steps(statement: AuditStatement, answers: Mapping[int, Any], *, complete: bool) -> dict[int, AuditStep]:
    """The statement's steps by position: one for every answer (``complete``: for exactly those)."""
    steps = {s.position: s for s in statement.steps}
    if (set(steps) != set(answers)) if complete else not set(answers) <= set(steps):
        raise ValueError(f"the auditor derived positions {sorted(steps)[:8]}, the tail answered {sorted(answers)[:8]}")
    return steps


def token_at(claim: Mapping[str, Any], position: int) -> object:
    """The token a tail's signed answer gives for ``position``: a one-token answer's, or the one of a
    verify chunk's tokens that lands there (they fill the positions up to the answer's ``position``)."""
    if "token" in claim:
        return claim.get("token") if claim.get("position") == position else None
    tokens, after = claim.get("tokens"), claim.get("position")
    if not isinstance(tokens, list) or not isinstance(after, int):
        return None
    index = position - (after - len(tokens) + 1)
    return tokens[index] if 0 <= index < len(tokens) else None


def _judge_across(
    statement: AuditStatement, receipt: HopEntry, answers: Mapping[int, tuple[HopEntry, Mapping[str, Any]]],
    *, complete: bool,
) -> Finding:  # fmt: skip
    """Another numerics class: the deviation the auditor measured (a hop that sends on) or the
    committed draws' (the tail) within the tolerance calibrated for such pairs."""
    tolerance = statement.tolerance
    assert tolerance is not None
    if receipt.output_digest is not None:
        if statement.compared_digest != receipt.output_digest or statement.deviation is None:
            raise ValueError("the auditor compared other activations than the hop signed for sending on")
        deviation = statement.deviation
        if deviation > tolerance:
            return Finding("fail", f"its residual updates deviate by {deviation:.3g} of their size from another "
                                   f"numerics class's (tolerance {tolerance:g})", deviation=deviation)  # fmt: skip
        why = f"{receipt.held} positions within {deviation:.3g} of another numerics class"
        return Finding("pass", why, deviation=deviation)
    steps = _steps(statement, answers, complete=complete)
    worst = 0.0
    for position in sorted(answers):
        entry, claim = answers[position]
        if "draw" not in claim:
            continue  # a verify chunk's token: across classes a greedy choice may differ honestly
        if entry.input_digest != steps[position].input_digest:
            raise ValueError(f"at position {position} the auditor computed from other inputs than the tail")
        try:
            committed = Draw.from_json(claim.get("draw"))
        except ValueError:
            return Finding("fail", f"at position {position} it committed a malformed distribution", position)
        deviation = draw_deviation(committed, steps[position].draw)
        if deviation > tolerance:
            return Finding("fail", f"at position {position} its committed probabilities deviate by {deviation:.3g} "
                                   f"from another numerics class's (tolerance {tolerance:g})", position,
                           deviation)  # fmt: skip
        worst = max(worst, deviation)
    return Finding("pass", f"{len(answers)} draws within {worst:.3g} of another numerics class", deviation=worst)


def draw_deviation(a: Draw, b: Draw) -> float:
    """The largest difference of a candidate's probability between two draws' committed candidates (a
    candidate one of them did not commit counts the probability the other gives it)."""
    pa, pb = dict(zip(a.ids, a.probs, strict=True)), dict(zip(b.ids, b.probs, strict=True))
    return max(abs(pa.get(t, 0.0) - pb.get(t, 0.0)) for t in {*pa, *pb})


def answer_at(position: int, entry: HopEntry, claim: Mapping[str, Any]) -> dict[str, Any]:
    """A tail's signed answer as a report carries it (its entry and what it vouched for)."""
    return {"position": position, "entry": entry.to_json(), "answer": dict(claim)}


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
