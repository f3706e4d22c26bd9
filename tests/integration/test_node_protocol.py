"""The hop protocol against real node processes: every bad input, then the session carries on."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from meshnet.ids import SessionId
from meshnet.protocol.channel import Kind, decode_frame, step_frame
from meshnet.protocol.messages import HopRequest, Payload, Verb
from meshnet.protocol.wire import encode_tensor, format_shape
from tests.procs import Proc, meshnet_process
from tests.ws import open_channel

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HIDDEN = 576


@pytest.fixture(scope="module")
def tail() -> Iterator[Proc]:
    with meshnet_process(["node", "--layers", "20:30", "--threads", "1", "--ctx", "256", "--max-sessions", "3"]) as p:
        yield p


@pytest.fixture(scope="module")
def middle(tail: Proc) -> Iterator[Proc]:
    args = ["node", "--layers", "10:20", "--threads", "1", "--ctx", "256", "--max-sessions", "3", "--max-body-mb", "1"]
    with meshnet_process(args) as p:
        yield p


def activations(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, n, HIDDEN)).astype(np.float32)


def post(
    node: Proc,
    sid: str,
    values: np.ndarray,
    *,
    start: int | None = None,
    position: int | None = None,
    dtype: str = "float32",
    route: str = "rte-test",
    tail_url: str | None = None,
    extra: dict[str, str] | None = None,
    body: bytes | Iterator[bytes] | None = None,
    sample: bool = True,
    drafts: list[int] | None = None,
) -> httpx.Response:
    frame = encode_tensor(values, dtype)
    headers = {
        "X-Meshnet-Model": MODEL,
        "X-Meshnet-Route-Id": route,
        "X-Meshnet-Shape": format_shape(frame.shape),
        "X-Meshnet-Dtype": dtype,
        "Content-Type": "application/octet-stream",
    }
    if position is None:
        assert start is not None
        headers["X-Meshnet-Token-Range"] = f"{start}-{start + values.shape[1] - 1}"
        if tail_url:
            headers["X-Meshnet-Next-Hops"] = tail_url
        if sample:
            headers["X-Meshnet-Sample"] = "1"
        path = "prefill"
    else:
        headers["X-Meshnet-Position"] = str(position)
        path = "decode-step"
        if drafts is not None:
            headers["X-Meshnet-Draft"] = ",".join(map(str, drafts))
            path = "verify"
    headers.update(extra or {})
    return httpx.post(f"{node.url}/v1/sessions/{sid}/{path}", content=body if body is not None else frame.body,
                      headers=headers, timeout=60)  # fmt: skip


def run_session(middle: Proc, tail: Proc, sid: str, steps: int) -> list[int]:
    """Prefill 6 positions, then ``steps`` decode steps of fixed activations; the tokens the tail picked."""
    first = post(middle, sid, activations(6, 1), start=0, tail_url=tail.url)
    assert first.status_code == 200, first.text
    tokens = [first.json()["token"]]
    for step in range(steps):
        r = post(middle, sid, activations(1, 100 + step), position=6 + step)
        assert r.status_code == 200, r.text
        tokens.append(r.json()["token"])
    return tokens


def error(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert needle in message, message


def test_every_bad_input_gets_a_clear_4xx_and_the_session_continues(middle: Proc, tail: Proc) -> None:
    control = run_session(middle, tail, "control", 4)
    httpx.delete(f"{middle.url}/v1/sessions/control", timeout=30)

    sid = "victim"
    r = post(middle, sid, activations(6, 1), start=0, tail_url=tail.url)
    assert r.status_code == 200
    got = [r.json()["token"]]
    nxt = activations(1, 100)
    error(post(middle, sid, nxt, position=6, route="rte-other"), 409, "pinned to route")
    error(post(middle, sid, nxt, position=6, extra={"X-Meshnet-Model": "other-model"}), 409, "serves model")
    error(post(middle, sid, np.zeros((1, 1, 575), np.float32), position=6), 400, "shape 1,1,576")
    error(post(middle, sid, nxt, position=6, extra={"X-Meshnet-Dtype": "float64"}), 400, "not supported")
    error(post(middle, sid, nxt, position=6, body=b"\x00" * 10), 400, "needs 2304 bytes")
    error(post(middle, sid, np.full((1, 1, HIDDEN), np.nan, np.float32), position=6), 400, "NaN")
    error(post(middle, sid, nxt, position=7), 409, "expects position 6")
    error(post(middle, sid, nxt, position=5), 409, "rewind")
    error(post(middle, sid, nxt, position=6, extra={"X-Meshnet-Position": "six"}), 400, "X-Meshnet-Position")
    error(post(middle, sid, activations(500, 3), start=6, sample=False), 413, "exceeds this node's limit")
    big = activations(500, 3).tobytes()  # the same body chunked, with no Content-Length to refuse it by
    chunked = (big[i : i + 65536] for i in range(0, len(big), 65536))
    error(post(middle, sid, activations(500, 3), start=6, sample=False, body=chunked), 413, "streamed past it")
    error(post(middle, sid, activations(300, 3), start=6, sample=False, dtype="bfloat16"), 400, "capped at 256")
    error(post(middle, "ghost", nxt, position=9), 410, "restarted or the session expired")
    no_range = post(middle, sid, nxt, start=6, extra={"X-Meshnet-Token-Range": ""})
    error(no_range, 400, "X-Meshnet-Token-Range")
    for step in range(4):
        r = post(middle, sid, activations(1, 100 + step), position=6 + step)
        assert r.status_code == 200, r.text
        got.append(r.json()["token"])
    assert got == control
    health = httpx.get(f"{middle.url}/v1/health", timeout=10).json()
    assert health["sessions"] == 1 and health["kv_bytes_used"] == 10 * health["kv_bytes_per_token"]
    assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def test_wire_dtypes_all_work(middle: Proc, tail: Proc) -> None:
    for dtype in ("float32", "float16", "bfloat16"):
        r = post(middle, f"dtype-{dtype}", activations(4, 7), start=0, tail_url=tail.url, dtype=dtype)
        assert r.status_code == 200, r.text
        assert [h["layers"] for h in r.json()["hops"]] == ["10:20", "20:30"]
        httpx.delete(f"{middle.url}/v1/sessions/dtype-{dtype}", timeout=30)


def test_a_second_concurrent_request_on_a_session_is_refused(middle: Proc, tail: Proc) -> None:
    sid = "racer"
    assert post(middle, sid, activations(2, 1), start=0, tail_url=tail.url, sample=False).status_code == 202
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        big = pool.submit(post, middle, sid, activations(50, 2), start=2, sample=True)
        deadline = time.monotonic() + 30  # once the big one is in flight there (on a loaded machine its
        while time.monotonic() < deadline and not big.done():  # upload can take longer than any fixed sleep)
            if httpx.get(f"{middle.url}/v1/sessions/{sid}", timeout=10).json()["busy"]:
                break
            time.sleep(0.002)
        second = pool.submit(post, middle, sid, activations(1, 3), position=52)
        big_answer, second_answer = big.result(), second.result()
    assert big_answer.status_code == 200, big_answer.text
    error(second_answer, 409, "in flight")
    httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30)


def test_store_full_is_503_with_retry_after(middle: Proc, tail: Proc) -> None:
    sids = [f"full-{i}" for i in range(4)]
    answers = [post(middle, sid, activations(2, 1), start=0, tail_url=tail.url) for sid in sids]
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    error(answers[3], 503, "maximum of 3 sessions")
    assert answers[3].headers["retry-after"]
    for sid in sids[:3]:
        assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200
    health = httpx.get(f"{middle.url}/v1/health", timeout=10).json()
    assert health["sessions"] == 0 and health["kv_bytes_used"] == 0
    tail_health = httpx.get(f"{tail.url}/v1/health", timeout=10).json()
    assert tail_health["sessions"] == 0  # the delete travelled down the chain


def test_idle_sessions_expire_and_a_restarted_node_answers_410() -> None:
    args = ["node", "--layers", "20:30", "--threads", "1", "--ctx", "64", "--session-ttl", "1"]
    with meshnet_process(args) as node:
        r = post(node, "idle", activations(3, 1), start=0)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 15
        while httpx.get(f"{node.url}/v1/health", timeout=10).json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(f"{node.url}/v1/health", timeout=10).json()["sessions"] == 0
        error(post(node, "idle", activations(1, 2), position=3), 410, "expired")
        port = node.url.rsplit(":", 1)[1]
    # A node restarted on the same port knows nothing of the old session.
    with meshnet_process([*args[:-2], "--port", port]) as again:
        error(post(again, "idle", activations(1, 2), position=3), 410, "restarted")


def test_unknown_paths_and_methods(middle: Proc) -> None:
    assert httpx.get(f"{middle.url}/v1/nothing", timeout=10).status_code == 404
    r = httpx.get(f"{middle.url}/v1/sessions/x/prefill", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]
    metrics = httpx.get(f"{middle.url}/metrics", timeout=10).text
    assert "meshnet_node_positions_total" in metrics and "meshnet_node_seam_bytes_total" in metrics
    assert json.loads(httpx.get(f"{middle.url}/v1/health", timeout=10).text)["layers"] == "10:20"


def test_a_dead_next_hop_breaks_the_session_instead_of_diverging(middle: Proc) -> None:
    args = ["node", "--layers", "20:30", "--threads", "1", "--ctx", "64"]
    with meshnet_process(args) as doomed:
        sid = "doomed"
        first = post(middle, sid, activations(3, 1), start=0, tail_url=doomed.url)
        assert first.status_code == 200, first.text
        doomed.popen.kill()
        doomed.popen.wait(10)
        lost = post(middle, sid, activations(1, 2), position=3)
        error(lost, 502, "next hop")
        # The middle advanced past position 3 but the tail never did: the session is reported
        # broken on every later request, never silently continued.
        error(post(middle, sid, activations(1, 3), position=4), 409, "broken")
        error(post(middle, sid, activations(1, 3), position=3), 409, "broken")
        assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def reroute(node: Proc, sid: str, next_hops: str, replay: int, *, route: str = "rte-test") -> httpx.Response:
    headers = {"X-Meshnet-Model": MODEL, "X-Meshnet-Route-Id": route, "X-Meshnet-Next-Hops": next_hops,
               "X-Meshnet-Replay": str(replay)}  # fmt: skip
    return httpx.post(f"{node.url}/v1/sessions/{sid}/reroute", headers=headers, timeout=60)


def test_reroute_replays_the_seam_log_into_a_new_tail_and_the_session_goes_on(middle: Proc, tail: Proc) -> None:
    control = run_session(middle, tail, "ctl-reroute", 4)
    httpx.delete(f"{middle.url}/v1/sessions/ctl-reroute", timeout=30)
    with meshnet_process(["node", "--layers", "20:30", "--threads", "1", "--ctx", "256"]) as spare:
        sid = "moved"
        first = post(middle, sid, activations(6, 1), start=0, tail_url=tail.url)
        got = [first.json()["token"]]
        for step in range(2):
            got.append(post(middle, sid, activations(1, 100 + step), position=6 + step).json()["token"])
        error(reroute(middle, sid, spare.url, 1, route="rte-other"), 409, "pinned to route")
        error(reroute(middle, sid, spare.url, 2), 400, "X-Meshnet-Replay")
        error(reroute(middle, "nobody", spare.url, 1), 404, "no session")
        # Replay positions 0..6 into the spare, resend position 7: the spare answers step 7's token again.
        moved = reroute(middle, sid, spare.url, 1)
        assert moved.status_code == 200, moved.text
        assert moved.json()["token"] == got[-1] and moved.json()["position"] == 8
        spare_health = httpx.get(f"{spare.url}/v1/health", timeout=10).json()
        assert spare_health["sessions"] == 1 and spare_health["kv_bytes_used"] == 8 * spare_health["kv_bytes_per_token"]
        for step in range(2, 4):  # decode carries on through the spare, token-identical to the control
            r = post(middle, sid, activations(1, 100 + step), position=6 + step)
            assert r.status_code == 200, r.text
            got.append(r.json()["token"])
        assert got == control
        assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200
        assert httpx.get(f"{spare.url}/v1/health", timeout=10).json()["sessions"] == 0  # the delete followed
    httpx.delete(f"{tail.url}/v1/sessions/{sid}", timeout=30)  # the old tail's copy, cut out of the route


def test_a_resent_step_with_rewind_replaces_the_one_a_hop_already_holds(middle: Proc, tail: Proc) -> None:
    control = run_session(middle, tail, "ctl-rewind", 2)
    httpx.delete(f"{middle.url}/v1/sessions/ctl-rewind", timeout=30)
    sid = "rewound"
    post(middle, sid, activations(6, 1), start=0, tail_url=tail.url)
    post(middle, sid, activations(1, 100), position=6)
    error(post(middle, sid, activations(1, 100), position=6), 409, "rewind")  # without the header: refused
    again = post(middle, sid, activations(1, 100), position=6, extra={"X-Meshnet-Rewind": "1"})
    assert again.status_code == 200 and again.json()["token"] == control[1]
    last = post(middle, sid, activations(1, 101), position=7)
    assert last.json()["token"] == control[2]
    health = httpx.get(f"{middle.url}/v1/health", timeout=10).json()
    assert health["kv_bytes_used"] == 8 * health["kv_bytes_per_token"]
    assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def hops(response: httpx.Response) -> list[dict[str, object]]:
    assert response.status_code == 200, response.text
    return list(response.json()["hops"])


def test_a_replay_recomputes_every_position_in_its_first_chunk_so_the_new_hop_is_bit_identical(
    middle: Proc, tail: Proc
) -> None:
    """Regression: positions first computed one at a time (decode steps) were replayed in one chunk of
    79; llama.cpp computes a chunk of 64 or more with other kernels, so the new tail's KV differed in
    the low bits and greedy text diverged some tokens later. Now the replay carries the chunk list."""
    steps = 70

    def session(sid: str, reroute_to: Proc | None) -> list[float]:
        first = post(middle, sid, activations(10, 1), start=0, tail_url=tail.url)
        assert first.status_code == 200, first.text
        for step in range(steps):
            r = post(middle, sid, activations(1, 100 + step), position=10 + step)
            assert r.status_code == 200, r.text
        if reroute_to is not None:
            moved = reroute(middle, sid, reroute_to.url, 1)
            [me, new_tail] = hops(moved)
            assert me["held"] == new_tail["held"] == 10 + steps
            assert new_tail["input_digest"] == me["output_digest"]
        logprobs = []
        for step in range(steps, steps + 6):
            r = post(middle, sid, activations(1, 100 + step), position=10 + step)
            logprobs.append(r.json()["logprob"])
            assert [h["held"] for h in hops(r)] == [11 + step, 11 + step]
        assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200
        return logprobs

    control = session("ctl-chunks", None)
    with meshnet_process(["node", "--layers", "20:30", "--threads", "1", "--ctx", "256"]) as spare:
        assert session("replayed-chunks", spare) == control  # to the last bit, not only the argmax
    httpx.delete(f"{tail.url}/v1/sessions/replayed-chunks", timeout=30)


def test_a_chunk_list_splits_one_request_into_compute_calls(middle: Proc, tail: Proc) -> None:
    """``X-Meshnet-Chunks`` on one request gives the same session as one request per chunk."""
    values = activations(12, 7)
    for pos, n in ((0, 4), (4, 4), (8, 4)):
        r = post(middle, "ctl-split", values[:, pos : pos + n], start=pos, tail_url=tail.url if pos == 0 else None)
        assert r.status_code == 200, r.text
    want = [(h["held"], h["input_digest"]) for h in hops(r)]
    bad = post(middle, "split", values, start=0, tail_url=tail.url, extra={"X-Meshnet-Chunks": "4x2"})
    error(bad, 400, "adds up to 8 positions")
    error(post(middle, "split", values, start=0, tail_url=tail.url, extra={"X-Meshnet-Chunks": "4,x"}), 400, "SIZE")
    one = post(middle, "split", values, start=0, tail_url=tail.url, extra={"X-Meshnet-Chunks": "4x3"})
    assert [(h["held"], h["input_digest"]) for h in hops(one)] == want
    assert one.json()["token"] == r.json()["token"] and one.json()["logprob"] == r.json()["logprob"]
    # One request of 12 positions is a different computation: the digests say so.
    whole = post(middle, "whole", values, start=0, tail_url=tail.url)
    assert [h["input_digest"] for h in hops(whole)] != [d for _, d in want]
    for sid in ("ctl-split", "split", "whole"):
        assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def test_a_verify_chunk_keeps_the_accepted_drafts_and_leaves_the_kv_of_plain_decoding(middle: Proc, tail: Proc) -> None:
    control = run_session(middle, tail, "ctl-verify", 4)  # steps at 6..9 from activations 100..103
    httpx.delete(f"{middle.url}/v1/sessions/ctl-verify", timeout=30)
    assert httpx.get(f"{tail.url}/v1/health", timeout=10).json()["max_verify"] >= 3
    sid = "verified"
    post(middle, sid, activations(6, 1), start=0, tail_url=tail.url)
    chunk = np.concatenate([activations(1, 100 + i) for i in range(4)], axis=1)
    wrong = (control[3] + 1) % 1000
    # bad verify requests: clear 400s, the session untouched
    error(post(middle, sid, chunk, position=6, drafts=[]), 400, "X-Meshnet-Draft")
    error(post(middle, sid, chunk, position=6, drafts=[1, 2, 3, 4]), 400, "shape 1,5,576")
    error(post(middle, sid, activations(1, 5), position=6, drafts=list(range(13))), 400, "at most 12")
    error(post(middle, sid, chunk, position=6, drafts=[1, 2, 3], extra={"X-Meshnet-Replay": "1"}), 400, "replayed")
    # the tail's own tokens for positions 7 and 8 are control[1] and control[2]: both kept, the
    # wrong third draft is replaced by the tail's token, and position 9 (the wrong draft's) dropped
    r = post(middle, sid, chunk, position=6, drafts=[control[1], control[2], wrong])
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["tokens"] == control[1:4] and (answer["drafted"], answer["accepted"]) == (3, 2)
    assert answer["position"] == 9 and len(answer["logprobs"]) == 3
    assert [h["held"] for h in answer["hops"]] == [9, 9]
    # from here the session decodes exactly as one that never drafted
    step = post(middle, sid, activations(1, 103), position=9)
    assert step.status_code == 200 and step.json()["token"] == control[4]
    for node in (middle, tail):
        health = httpx.get(f"{node.url}/v1/health", timeout=10).json()
        assert health["kv_bytes_used"] == 10 * health["kv_bytes_per_token"]
    assert httpx.delete(f"{middle.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def test_decode_steps_over_the_channel_match_http_and_a_bad_frame_hurts_no_session(middle: Proc, tail: Proc) -> None:
    """The decode channel against real nodes: a gateway-side channel to the middle and one to the
    tail; steps go to the middle, which passes them on over its own channel and sends its own signed
    entry back on the gateway's channel to it, and the tail's token comes back on the tail's channel —
    the same tokens as the HTTP binding. A malformed frame gets an ERROR and the session goes on."""
    expected = run_session(middle, tail, "ses-chan-http", 4)
    first = post(middle, "ses-chan", activations(6, 1), start=0, tail_url=tail.url)
    assert first.status_code == 200, first.text
    tokens = [first.json()["token"]]
    with (
        open_channel(middle.url, open_timeout_s=10, compression=None) as to_middle,
        open_channel(tail.url, open_timeout_s=10, compression=None) as to_tail,
    ):
        returns = [
            decode_frame(bytes(ws.recv(timeout=10, decode=False))).header["channel"] for ws in (to_middle, to_tail)
        ]

        def step(seq: int, position: int, values: np.ndarray) -> bytes:
            payload = Payload(encode_tensor(values, "float32"))
            request = HopRequest(Verb.DECODE, SessionId("ses-chan"), position, 1, payload, model=MODEL,
                                 route_id="rte-test")  # fmt: skip
            return step_frame(request, seq, returns)

        for n in range(4):
            if n == 2:  # garbage, then a step with a wrong shape: errors for that step only
                to_middle.send(b"MN\x01\x02garbage")
                bad = decode_frame(bytes(to_middle.recv(timeout=10, decode=False)))
                assert bad.kind is Kind.ERROR and bad.header["status"] == 400, bad.header
                to_middle.send(step(99, 6 + n, activations(2, 5)))
                bad = decode_frame(bytes(to_middle.recv(timeout=10, decode=False)))
                assert bad.header["seq"] == 99 and "shape" in bad.header["error"]["message"], bad.header
            to_middle.send(step(n, 6 + n, activations(1, 100 + n)))
            entry = decode_frame(bytes(to_middle.recv(timeout=30, decode=False)))
            assert entry.kind is Kind.ENTRY and entry.header["seq"] == n, entry.header
            assert entry.header["entry"]["node"] == hop_id(middle) and entry.header["entry"]["held"] == 7 + n
            assert entry.header["entry"]["sig"]  # signed, once the step had gone on
            token = decode_frame(bytes(to_tail.recv(timeout=30, decode=False)))
            assert token.kind is Kind.TOKEN and token.header["seq"] == n, token.header
            answer = token.header["answer"]
            assert [h["node"] for h in answer["hops"]] == [hop_id(tail)]  # the middle's came on its own channel
            tokens.append(answer["token"])
        state = httpx.get(f"{tail.url}/v1/sessions/ses-chan", timeout=10).json()
        assert state["seq"] == 3 and state["position"] == 10 and state["broken"] is None
    assert tokens == expected


def hop_id(node: Proc) -> str:
    return str(httpx.get(f"{node.url}/v1/health", timeout=10).json()["node_id"])
