"""A seeded fuzzer over the hop protocol: valid prefill, decode, verify, reroute and prefix
requests — and session snapshots — to a node's HTTP surface (``create_node_app`` over a fake shard
here; a real ``meshnet node`` process in tests/integration/test_hop_fuzz_real.py), with their
headers and bodies mutated. Every answer must be a 2xx (a mutant that stayed valid) or a 4xx in
OpenAI's error shape — never a 5xx — and after the run the node must continue a session it held
with the very tokens an untouched node gives."""

from __future__ import annotations

import math
import os
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from starlette.testclient import TestClient

from meshnet.ids import SessionId
from meshnet.node.app import create_node_app
from meshnet.node.service import NodeConfig
from meshnet.protocol.http_binding import encode_prefix, encode_request, encode_reroute
from meshnet.protocol.messages import HopRequest, Payload, PrefixClaim, PrefixRequest, RerouteRequest, Verb
from meshnet.protocol.prefix import block_hashes
from meshnet.protocol.wire import encode_tensor
from tests.unit.test_node_service import PROMPT, MixShard

SEED = int(os.environ.get("MESHNET_FUZZ_SEED", "1312"))
CASES = 300
BUDGET_S = 60.0
GARBAGE = ["", "-1", "-9223372036854775809", "1e309", "NaN", "inf", "0x10", "1,2", "[]", "{}", "ü∂ß",
           "9" * 400, "a" * 8000, "1 2", "float64", "int8", "bfloat16", "3x", "1,-1", "0,0", "\t1"]  # fmt: skip
Request = tuple[str, dict[str, str], bytes]


def _ids(tokens: list[int]) -> Payload:
    return Payload(encode_tensor(np.array([tokens], dtype=np.int32), "int32"))


def _prefill(sid: str, model: str, tokens: list[int] = PROMPT) -> HopRequest:
    return HopRequest(Verb.PREFILL, SessionId(sid), 0, len(tokens), _ids(tokens), model=model, route_id="r1",
                      next_hops=(), sample=True, prefix=PrefixClaim(4, tuple(block_hashes(tokens, 4))))  # fmt: skip


def _step(sid: str, token: int, position: int, drafts: tuple[int, ...] = ()) -> HopRequest:
    verb = Verb.VERIFY if drafts else Verb.DECODE
    return HopRequest(verb, SessionId(sid), position, 1 + len(drafts), _ids([token, *drafts]), route_id="r1",
                      drafts=drafts)  # fmt: skip


def _mutate_headers(rng: random.Random, headers: dict[str, str]) -> dict[str, bytes]:
    out = dict(headers)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice([*out, "X-Meshnet-Next-Hops", "X-Meshnet-Chunks", "X-Meshnet-Draft", "X-Meshnet-Sampling"])
        action = rng.randrange(6)
        if action == 0:
            out.pop(name, None)
        elif action == 1:
            out[name] = rng.choice(GARBAGE)
        elif action == 2:
            out[name] = str(rng.choice([-1, -(2**63), 2**31, 2**64, 10**30, 0, 513]))
        elif action == 3:  # a duplicated value, as a proxy that joins repeated headers would send it
            out[name] = f"{out.get(name, '1')},{out.get(name, '1')}"
        elif action == 4:
            out[name] = "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randint(1, 40)))
        else:
            out[name] = rng.choice(["http://169.254.169.254:80", "1,2,3", "128x2,37", '{"temperature":1e-310}'])
    return {k: v.encode("utf-8") for k, v in out.items()}  # raw UTF-8 bytes on the wire


def _mutate_body(rng: random.Random, body: bytes) -> bytes:
    action = rng.randrange(6)
    if action == 0:
        return body[: rng.randrange(len(body) + 1)]
    if action == 1:
        return body + os.urandom(rng.randint(1, 64))
    if action == 2:
        return os.urandom(rng.randint(0, 256))
    if action == 3 and len(body) >= 4:
        i = 4 * rng.randrange(len(body) // 4)
        bad = struct.pack("<f", rng.choice([math.nan, math.inf, -math.inf]))
        return body[:i] + bad + body[i + 4 :]
    if action == 4 and len(body) >= 4:
        i = 4 * rng.randrange(len(body) // 4)
        return body[:i] + struct.pack("<i", rng.choice([-1, 50, 2**31 - 1, -(2**31)])) + body[i + 4 :]
    return body


def _cases(rng: random.Random, n: int, model: str) -> list[tuple[str, Callable[[Any, str], Request]]]:
    def prefill(_: Any, sid: str) -> Request:
        return encode_request(_prefill(sid, model))

    def prefix(_: Any, sid: str) -> Request:
        claim = PrefixClaim(4, tuple(block_hashes(PROMPT, 4)))
        path, headers = encode_prefix(PrefixRequest(SessionId(sid), claim, 2, "r1", model=model))
        return path, headers, b""

    def snapshot(_: Any, sid: str) -> Request:  # an open swarm keeps none: 409, whatever comes
        return f"/v1/snapshots/{sid}", {"X-Meshnet-Ticket": "mnt1.x.y"}, b"MNSS" + os.urandom(rng.randint(0, 64))

    def opened_then(verb: str) -> Callable[[Any, str], Request]:
        def make(client: Any, sid: str) -> Request:
            path, headers, body = encode_request(_prefill(sid, model))
            answer = client.post(path, headers=headers, content=body)
            assert answer.status_code == 200, answer.text
            token, position = int(answer.json()["token"]), len(PROMPT)
            if verb == "reroute":
                path, headers = encode_reroute(RerouteRequest(SessionId(sid), (), "r1", step=position))
                return path, headers, b""
            if verb == "restore":
                return f"/v1/sessions/{sid}-again/restore", {"X-Meshnet-Route-Id": "r1"}, b""
            return encode_request(_step(sid, token, position, (1, 2) if verb == "verify" else ()))

        return make

    kinds = {"prefill": prefill, "prefix": prefix, "snapshot": snapshot}
    kinds |= {v: opened_then(v) for v in ("decode", "verify", "reroute", "restore")}
    return [(kind, kinds[kind]) for kind in (rng.choice(list(kinds)) for _ in range(n))]


def _generate(client: Any, sid: str, n: int, model: str) -> list[int]:
    path, headers, body = encode_request(_prefill(sid, model))
    tokens = [int(client.post(path, headers=headers, content=body).json()["token"])]
    for _ in range(n):
        path, headers, body = encode_request(_step(sid, tokens[-1], len(PROMPT) + len(tokens) - 1))
        tokens.append(int(client.post(path, headers=headers, content=body).json()["token"]))
    return tokens


def fuzz(client: Any, model: str, *, cases: int = CASES, budget_s: float = BUDGET_S) -> dict[int, int]:
    """Run the seeded cases against the node ``client`` reaches (a ``TestClient`` or an ``httpx.Client``
    with its ``base_url``); how many answers of each class (2xx, 4xx) came back."""
    rng = random.Random(SEED)
    want = _generate(client, "reference", 6, model)
    client.delete("/v1/sessions/reference")
    live = _generate(client, "live", 2, model)  # a session that must go on unchanged after the run
    deadline, seen = time.monotonic() + budget_s, {2: 0, 4: 0}
    for i, (kind, make) in enumerate(_cases(rng, cases, model)):
        if time.monotonic() > deadline:
            break
        sid = f"fuzz-{i}"
        path, headers, body = make(client, sid)
        sent = _mutate_headers(rng, headers) if rng.random() < 0.7 else headers
        body = _mutate_body(rng, body) if kind not in ("reroute", "prefix", "restore") and rng.random() < 0.6 else body
        try:
            answer = client.post(path, headers=sent, content=body)
        except httpx.LocalProtocolError:  # over a real socket the client itself refuses an illegal header
            client.delete(f"/v1/sessions/{sid}")
            continue
        context = f"seed {SEED} case {i} ({kind}): {sent} body {body[:64]!r}"
        assert answer.status_code < 500, f"{context} -> {answer.status_code} {answer.text}"
        if answer.status_code >= 400:
            error = answer.json()["error"]
            assert {"message", "type", "param", "code"} <= set(error) and error["message"], context
        seen[answer.status_code // 100] += 1
        client.delete(f"/v1/sessions/{sid}")
    assert client.get("/v1/health").status_code == 200
    for _ in range(4):
        path, headers, body = encode_request(_step("live", live[-1], len(PROMPT) + len(live) - 1))
        answer = client.post(path, headers=headers, content=body)
        assert answer.status_code == 200, answer.text
        live.append(int(answer.json()["token"]))
    assert live == want
    client.delete("/v1/sessions/live")
    return seen


def test_mutated_hop_requests_are_4xx_never_5xx_and_the_node_goes_on() -> None:
    config = NodeConfig(node_id="n", url="http://n:1", max_body_bytes=64 * 1024)
    with TestClient(create_node_app(MixShard("0:12"), config), raise_server_exceptions=False) as client:
        seen = fuzz(client, "mix")
    assert seen[4] > CASES // 4, seen  # the mutants mostly broke the request
