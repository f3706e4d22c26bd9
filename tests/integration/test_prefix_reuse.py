"""Prefix caching on ``meshnet up`` through the official client: a conversation's next turns reuse
their history from the nodes' prefix caches (``usage.prompt_tokens_details.cached_tokens``) and
say exactly what a cold prefill says — a second gateway on the same nodes with ``--prefix-cache
off``, which prefills every turn from scratch; two conversations share a long system prompt's KV."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.procs import Proc, admin_client, join_member, member_client, meshnet_process, tracker_url

pytestmark = pytest.mark.real

SYSTEM = (
    "You are a careful assistant for a hardware store. Facts you know: "
    + "; ".join(
        f"aisle {i} holds {['nails', 'screws', 'paint', 'rope', 'glue', 'tape'][i % 6]} at ${i * 3 % 17}"
        for i in range(40)
    )
    + ". Answer briefly."
)
N_TOKENS = 24


@pytest.fixture(scope="module")
def cold(swarm: Proc) -> Iterator[Proc]:
    """A gateway on the same swarm that reuses nothing (and leaves nothing in the caches)."""
    member = ["--swarm-dir", str(join_member(swarm, "gateway", "cold-gateway"))]
    args = ["gateway", "--tracker", tracker_url(swarm), "--port", "0", "--prefix-cache", "off", *member]
    with meshnet_process(args) as proc:
        yield proc


def turn(url: str, model: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """The answer, the prompt tokens and the cached prompt tokens the response reports."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180) as client:
        out = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=N_TOKENS)  # type: ignore[arg-type]
    usage = out.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return out.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_each_turn_of_a_conversation_reuses_its_history_and_says_what_a_cold_prefill_says(
    swarm: Proc, cold: Proc, model_id: str
) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the rope?"}]
    prompts, cached = [], []
    for question in ("How much is the glue, and how much is the tape in aisle 5?", "And the paint in aisle 2?", None):
        answer, prompt, reused = turn(swarm.url, model_id, messages)
        again, _, none = turn(cold.url, model_id, messages)
        assert answer == again and none == 0
        prompts.append(prompt)
        cached.append(reused)
        if question is None:
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    # each turn reuses every whole 128-token block of the one before it (turn 1 finds nothing: its
    # system prompt is this test's own)
    assert cached[0] == 0
    assert [cached[1], cached[2]] == [128 * (prompts[0] // 128), 128 * (prompts[1] // 128)], (prompts, cached)
    assert cached[1] > 0
    with admin_client(swarm) as admin:
        nodes = [n["url"] for n in httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()["nodes"]]
        stats = [admin.get(f"{url}/v1/health").json()["prefix_cache"] for url in nodes]
    assert all(s["hits"] >= 2 and s["reused_positions"] >= cached[1] + cached[2] for s in stats), stats


def test_two_conversations_share_a_long_system_prompt(swarm: Proc, cold: Proc, model_id: str) -> None:
    system = SYSTEM.replace("hardware store", "garden centre")
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Is there rope?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "What does aisle 7 hold?"}]
    turn(swarm.url, model_id, first)
    answer, _, reused = turn(swarm.url, model_id, second)
    assert reused >= 2 * 128  # the system prompt's whole blocks
    assert answer == turn(cold.url, model_id, second)[0]


def test_a_history_whose_sequences_live_sessions_took_is_reused_from_host_memory(
    swarm: Proc, cold: Proc, model_id: str
) -> None:
    """One KV budget per node: a finished turn's blocks stay parked in its llama.cpp sequence; as many
    other conversations as a node has sequences then take them all (each parks its own blocks, and
    the oldest parked ones yield), so the first conversation's KV is written out to host memory —
    and its next turn still reuses every whole block and says what a cold prefill says."""
    system = SYSTEM.replace("hardware store", "boat yard")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is the glue?"}]
    answer, prompt, _ = turn(swarm.url, model_id, messages)
    with admin_client(swarm) as admin:
        nodes = [n["url"] for n in httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()["nodes"]]
        health = [admin.get(f"{url}/v1/health").json() for url in nodes]
        assert all(h["kv_bytes_parked"] > 0 and h["prefix_cache"]["parked"] >= 1 for h in health), health
        before = [h["prefix_cache"]["demoted"] for h in health]
        for i in range(max(h["max_sessions"] for h in health)):
            other = f"Ledger {i}. " + " ".join(f"Crate {k} weighs {(k * 7 + i) % 23} kg." for k in range(30))
            complete(swarm.url, model_id, other)  # > 128 tokens: each parks a block of its own
        after = [admin.get(f"{url}/v1/health").json()["prefix_cache"]["demoted"] for url in nodes]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the tape?"}]
    again, _, reused = turn(swarm.url, model_id, messages)
    assert reused == 128 * (prompt // 128) and reused > 0
    assert again == turn(cold.url, model_id, messages)[0]


def test_telemetry_says_how_much_of_the_prompt_came_from_the_caches(swarm: Proc, model_id: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the tape?"}]
    turn(swarm.url, model_id, messages)
    response = httpx.post(
        f"{swarm.url}/v1/chat/completions",
        json={"model": model_id, "messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200
    body = response.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and body["meshnet"]["cached_tokens"] == cached
    gid = response.headers["x-meshnet-generation-id"]
    events = httpx.get(f"{swarm.url}/v1/generations/{gid}/events", timeout=30).text
    assert f'"cached_tokens":{cached}' in events.replace(" ", "")


def test_a_poisoned_cache_entry_is_refused_by_its_digests_and_replaced(swarm: Proc, cold: Proc, model_id: str) -> None:
    """A member gateway computes one prompt's KV but names another prompt's blocks, so the nodes
    keep the wrong KV under the right hashes. The next request for the named prompt finds those
    blocks on every hop (their hit counters move), but the digests of what they were computed from
    are not the digests of its token ids: the gateway refuses them, prefills cold — the text is the
    cold gateway's, no token reported cached — and that session's blocks replace the bad entry."""
    from meshnet.artifacts.bundled import bundled_gguf
    from meshnet.backends.llama_vocab import LlamaVocab
    from meshnet.protocol import http_binding
    from meshnet.protocol.messages import HopRequest, Payload, PrefixClaim, Verb
    from meshnet.protocol.prefix import block_hashes
    from meshnet.protocol.wire import encode_tensor

    text = "Stock list. " + " ".join(f"Item {i} costs {i * 3 % 17} coins." for i in range(50))
    decoy = text.replace("coins", "beads")
    vocab = LlamaVocab(bundled_gguf())
    real, fake = vocab.tokenize(text, add_special=True), vocab.tokenize(decoy, add_special=True)
    vocab.close()
    blocks = min(len(real), len(fake)) // 128
    assert blocks >= 2
    claim = PrefixClaim(128, tuple(block_hashes(real, 128)[:blocks]))
    hashes = {"block": 128, "hashes": [h.hex() for h in claim.hashes]}
    with member_client(join_member(swarm, "gateway", "poisoner")) as poisoner:
        tracker = tracker_url(swarm)
        opened = poisoner.post(f"{tracker}/v1/sessions", json={"model": model_id, "prefix": hashes}).json()
        sid, urls, ticket = opened["session_id"], [h["url"] for h in opened["hops"]], opened["ticket"]
        for begin in range(0, blocks * 128, 128):
            ids = encode_tensor(np.asarray([fake[begin : begin + 128]], dtype=np.int32), "int32")
            request = HopRequest(
                Verb.PREFILL, sid, begin, 128, Payload(ids), model=model_id, route_id=opened["route_id"],
                next_hops=tuple(urls[1:]) if begin == 0 else None, sample=begin + 128 == blocks * 128,
                ticket=ticket if begin == 0 else None, prefix=claim if begin == 0 else None,
            )  # fmt: skip
            path, headers, body = http_binding.encode_request(request)
            assert poisoner.post(f"{urls[0]}{path}", content=body, headers=headers).status_code in (200, 202)
        assert poisoner.delete(f"{urls[0]}/v1/sessions/{sid}", headers={"X-Meshnet-Ticket": ticket}).status_code == 200
        assert poisoner.delete(f"{tracker}/v1/sessions/{sid}").status_code == 200
    with admin_client(swarm) as admin:
        hits = [admin.get(f"{url}/v1/health").json()["prefix_cache"]["hits"] for url in urls]
        first = complete(swarm.url, model_id, text)
        after = [admin.get(f"{url}/v1/health").json()["prefix_cache"]["hits"] for url in urls]
    assert first[1] == len(real), "the test's token ids must be the gateway's"
    assert all(b > a for a, b in zip(hits, after, strict=True)), (hits, after)  # the bad blocks were found
    assert first[2] == 0 and first[0] == complete(cold.url, model_id, text)[0]
    second = complete(swarm.url, model_id, text)
    assert second[2] == 128 * ((len(real) - 1) // 128) and second[0] == first[0]


def complete(url: str, model: str, prompt: str) -> tuple[str, int, int]:
    """A greedy completion's text, prompt tokens and cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    usage = out["usage"]
    return out["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
