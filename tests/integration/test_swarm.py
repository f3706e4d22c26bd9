"""``meshnet up``: tracker + 3 node processes + gateway on loopback, driven by the official client."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, admin_client, join_member, meshnet_process, tracker_url

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a story about a dragon.",
    "What is the capital of France?",
    "List three uses of copper.",
    "Explain photosynthesis to a child.",
]
N_TOKENS = 64


def chat(url: str, model: str, prompt: str, *, stream: bool = False) -> str:
    messages = [{"role": "user", "content": prompt}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180) as client:
        if not stream:
            out = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=N_TOKENS)
            return out.choices[0].message.content or ""
        text = ""
        for chunk in client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=N_TOKENS, stream=True
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text


def test_three_llama_nodes_match_single_node_serve(swarm: Proc, server: Proc, model_id: str) -> None:
    # The long prompt spans several 128-token prefill chunks, pipelined through the nodes.
    long_prompt = "Summarize this list: " + ", ".join(f"item {i} is {i * 7 % 13}" for i in range(60))
    for prompt in [*PROMPTS[:2], long_prompt]:
        assert chat(swarm.url, model_id, prompt) == chat(server.url, model_id, prompt)


def test_eight_concurrent_streams_each_match_their_solo_run(swarm: Proc, model_id: str) -> None:
    """The nodes compute the steps of sessions that reach them together as one llama.cpp batch,
    and the text stays each session's own."""
    nodes = [n["url"] for n in httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()["nodes"]]
    with admin_client(swarm) as admin:  # a private swarm's nodes answer members only
        limits = [admin.get(f"{url}/v1/health").json()["decode_batch"] for url in nodes]
    assert limits == [8] * 3  # measured at load; capped by --max-sessions 8
    prompts = [*PROMPTS, *(f"{p} Answer in one sentence." for p in PROMPTS)]
    solo = [chat(swarm.url, model_id, p) for p in prompts]
    calls = [_metric(swarm, url, "meshnet_node_decode_batches_total") for url in nodes]
    steps = [_metric(swarm, url, "meshnet_node_decode_batch_steps_total") for url in nodes]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: chat(swarm.url, model_id, p, stream=True), prompts))
    assert together == solo
    # some node computed several sessions' steps in one call
    calls = [_metric(swarm, url, "meshnet_node_decode_batches_total") - c for url, c in zip(nodes, calls, strict=True)]
    steps = [
        _metric(swarm, url, "meshnet_node_decode_batch_steps_total") - s for url, s in zip(nodes, steps, strict=True)
    ]
    assert any(s > c for s, c in zip(steps, calls, strict=True)), (calls, steps)


def test_route_telemetry_and_swarm_view(swarm: Proc, model_id: str) -> None:
    response = httpx.post(
        f"{swarm.url}/v1/completions",
        json={"model": model_id, "prompt": "One, two, three,", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200
    gid = response.headers["x-meshnet-generation-id"]
    events = [
        json.loads(line[6:])
        for line in httpx.get(f"{swarm.url}/v1/generations/{gid}/events", timeout=30).text.splitlines()
        if line.startswith("data: ")
    ]
    accepted = events[0]
    assert accepted["type"] == "route.accepted"
    assert [n["layers"] for n in accepted["nodes"]] == ["0:10", "10:20", "20:30"]
    health = [e for e in events if e["type"] == "route.health"][-1]
    assert [h["layers"] for h in health["hops"]] == ["0:10", "10:20", "20:30"]
    assert all(h["decode_step_ms"] is not None and h["decode_step_ms"] > 0 for h in health["hops"])
    view = httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()
    assert view["tracker"].startswith("https://127.0.0.1:")  # meshnet up runs a private swarm by default
    assert all(n["url"].startswith("https://127.0.0.1:") for n in view["nodes"])
    assert sorted(n["layers"] for n in view["nodes"]) == ["0:10", "10:20", "20:30"]
    assert all(n["health"]["status"] == "ok" for n in view["nodes"])
    # The finished session frees its KV on every node (the close travels down the chain).
    deadline = time.monotonic() + 10
    while any(n["health"]["sessions"] for n in view["nodes"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        view = httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()
    assert all(n["health"]["sessions"] == 0 and n["health"]["kv_bytes_used"] == 0 for n in view["nodes"])


def test_torch_backend_route_matches_a_single_torch_node(tmp_path_factory: pytest.TempPathFactory) -> None:
    # PyTorch dequantizes to float32, so its tokens differ from llama.cpp's; the reference is a
    # single torch node holding every layer, against three torch nodes splitting them.
    prompts = PROMPTS[:2]
    outputs = []
    for nodes in ("1", "3"):
        workdir = tmp_path_factory.mktemp(f"torch-{nodes}")
        args = ["up", "--port", "0", "--nodes", nodes, "--backend", "torch", "--workdir", str(workdir)]
        with meshnet_process(args, ready_timeout_s=300) as proc:
            outputs.append([chat(proc.url, "SmolLM2-135M-Instruct.Q4_1", p) for p in prompts])
    assert outputs[0] == outputs[1]
    assert all(outputs[0])


def test_ctrl_c_stops_every_process_of_the_swarm(tmp_path: Path) -> None:
    import psutil

    args = ["up", "--port", "0", "--nodes", "2", "--workdir", str(tmp_path)]
    with meshnet_process(args, ready_timeout_s=300) as proc:
        children = psutil.Process(proc.popen.pid).children(recursive=True)
        assert len(children) >= 4  # tracker, 2 nodes, gateway
        proc.popen.send_signal(signal.SIGINT)
        proc.popen.wait(60)
        assert "swarm stopped" in proc.output()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    logs = {path.name: path.read_text() for path in tmp_path.glob("*.log")}
    assert len(logs) == 4 and all("listening on" in text for text in logs.values())
    noisy = {name: text[-1500:] for name, text in logs.items() if "Traceback" in text}
    assert not noisy, noisy  # a clean stop, not a KeyboardInterrupt traceback in every child's log


def test_logit_bias_steers_the_route_as_it_steers_serve(swarm: Proc, server: Proc, model_id: str) -> None:
    """OpenAI's logit_bias through the official client: banning the greedy answer's first token
    changes the text, the same way on the route (applied by its tail) as on ``meshnet serve``; an id
    outside the vocabulary is a 400 naming the parameter."""
    from meshnet.artifacts.bundled import bundled_gguf
    from meshnet.backends.llama_vocab import LlamaVocab

    messages = [{"role": "user", "content": PROMPTS[1]}]
    texts: dict[str, tuple[str, str]] = {}
    vocab = LlamaVocab(bundled_gguf())
    try:
        for name, url in (("route", swarm.url), ("serve", server.url)):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
            plain = client.chat.completions.create(
                model=model_id, messages=messages, temperature=0, max_tokens=N_TOKENS
            )
            plain_text = plain.choices[0].message.content or ""
            first = vocab.tokenize(plain_text, add_special=False)[0]
            steered = client.chat.completions.create(
                model=model_id, messages=messages, temperature=0, max_tokens=N_TOKENS, logit_bias={str(first): -100}
            )
            text = steered.choices[0].message.content or ""
            assert text and text != plain_text and vocab.tokenize(text, add_special=False)[0] != first
            texts[name] = (plain_text, text)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model=model_id, messages=messages, max_tokens=4, logit_bias={"9999999": 5}
                )
            assert "logit_bias" in str(err.value)
    finally:
        vocab.close()
    assert texts["route"] == texts["serve"]


COPY_TEXT = (
    "Meshnet splits a model's layers over a swarm of nodes. Each node keeps the KV cache of its own "
    "layers for every session, and only a one-token hidden state crosses each seam while decoding."
)


def test_speculative_decoding_gives_serves_text_with_drafts_accepted(swarm: Proc, server: Proc, model_id: str) -> None:
    """A copy-heavy request drafts from the prompt (``--speculative ngram``, the default): the route
    verifies several tokens per walk and the text is still exactly the non-speculative serve's."""
    prompt = f"Repeat this text exactly:\n\n{COPY_TEXT}"
    client = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="unused", max_retries=0, timeout=180)
    gid = "gen-speculative"
    text = ""
    for chunk in client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=N_TOKENS,
        stream=True, extra_headers={"X-Meshnet-Generation-Id": gid},
    ):  # fmt: skip
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == chat(server.url, model_id, prompt)
    assert COPY_TEXT[10:60] in text  # the model did copy: the drafts had something to match
    snapshot = httpx.get(f"{swarm.url}/v1/generations/{gid}", timeout=10).json()
    drafted, accepted = snapshot["speculation"]["drafted_tokens"], snapshot["speculation"]["accepted_tokens"]
    assert drafted >= 16 and accepted >= drafted // 2, snapshot["speculation"]
    events = [
        json.loads(line[6:])
        for line in httpx.get(f"{swarm.url}/v1/generations/{gid}/events", timeout=30).text.splitlines()
        if line.startswith("data: ")
    ]
    last = [e for e in events if e["type"] == "decode.progress"][-1]
    assert (last["drafted_tokens"], last["accepted_tokens"]) == (drafted, accepted)
    # a seeded sampled request through verify chunks draws serve's text: each position draws the same,
    # drafted or not, however the gateway cut the rounds (by measured costs, other in every run)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180) as alone:
        sampled = [
            c.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": prompt}], temperature=0.7, seed=11,
                max_tokens=24,
            )
            .choices[0]
            .message.content
            for c in (client, client, alone)
        ]  # fmt: skip
    assert sampled[0] == sampled[1] == sampled[2] and sampled[0]


def test_a_draft_model_at_the_gateway_gives_serves_text_with_drafts_accepted(
    swarm: Proc, server: Proc, model_id: str
) -> None:
    """``--speculative draft``: a draft model at the gateway (here the bundled model itself, which
    shares its vocabulary) drafts on text that does not repeat; the route verifies several tokens
    per walk, and the text is exactly serve's."""
    from meshnet.artifacts.bundled import bundled_gguf

    member = ["--swarm-dir", str(join_member(swarm, "gateway", "draft-gateway"))]
    args = [
        "gateway",
        "--tracker",
        tracker_url(swarm),
        "--port",
        "0",
        "--speculative",
        "draft",
        "--draft-min",
        "4",
        *member,
    ]
    with meshnet_process([*args, "--draft-gguf", str(bundled_gguf())]) as gateway:
        gid = "gen-draft-model"
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=180)
        out = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": PROMPTS[3]}], temperature=0, max_tokens=N_TOKENS,
            extra_headers={"X-Meshnet-Generation-Id": gid},
        )  # fmt: skip
        assert out.choices[0].message.content == chat(server.url, model_id, PROMPTS[3])
        speculation = httpx.get(f"{gateway.url}/v1/generations/{gid}", timeout=10).json()["speculation"]
    drafted, accepted = speculation["drafted_tokens"], speculation["accepted_tokens"]
    assert drafted >= 16 and accepted >= drafted // 2, speculation


def test_logprobs_on_the_route_are_serves(swarm: Proc, server: Proc, model_id: str) -> None:
    """The tail reports each token's logprob and top alternatives: the same as the whole model's,
    through plain steps and through verify chunks (the copy-heavy prompt drafts)."""
    for prompt in (PROMPTS[1], f"Repeat this text exactly:\n\n{COPY_TEXT}"):
        answers = []
        for url in (swarm.url, server.url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
            out = client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24,
                logprobs=True, top_logprobs=3,
            )  # fmt: skip
            answers.append(out.choices[0].logprobs.content)
        route, serve = answers
        assert [e.token for e in route] == [e.token for e in serve] and len(route) == 24
        assert [e.logprob for e in route] == pytest.approx([e.logprob for e in serve], abs=1e-4)
        for r, s in zip(route, serve, strict=True):
            assert [a.token for a in r.top_logprobs] == [a.token for a in s.top_logprobs]
            assert r.top_logprobs[0].token == r.token and len(r.top_logprobs) == 3


def test_n_choices_on_the_route_through_the_official_client(swarm: Proc, server: Proc, model_id: str) -> None:
    """``n`` choices run as generations of their own (each its own session on the route): greedy,
    every choice is serve's text; seeded, choice i draws from seed + i, so the request repeats."""
    client = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="unused", max_retries=0, timeout=180)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    out = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=N_TOKENS, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    expected = chat(server.url, model_id, PROMPTS[2])
    assert [c.message.content for c in out.choices] == [expected, expected]

    def seeded() -> list[str | None]:
        out = client.chat.completions.create(
            model=model_id, messages=messages, temperature=0.9, seed=3, max_tokens=16, n=3
        )
        return [c.message.content for c in out.choices]

    sampled = [seeded(), seeded()]
    assert sampled[0] == sampled[1] and len(set(sampled[0])) > 1


def test_penalties_on_the_route_are_serves(swarm: Proc, server: Proc, model_id: str) -> None:
    """Presence and frequency penalties need the tokens generated so far where the logits are: the
    token ids travel to the tail beside the activations. Greedy text equals serve's, through plain
    steps and verify chunks, and the penalties do change it."""
    for prompt in (PROMPTS[0], f"Repeat this text exactly:\n\n{COPY_TEXT}"):
        texts = []
        for url in (swarm.url, server.url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
            out = client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=N_TOKENS,
                presence_penalty=0.6, frequency_penalty=0.8,
            )  # fmt: skip
            texts.append(out.choices[0].message.content)
        assert texts[0] == texts[1]
        if prompt == PROMPTS[0]:  # a story repeats words the penalties push down (a copy keeps its text)
            assert texts[0] != chat(server.url, model_id, prompt)


def test_the_decode_channel_on_and_off_give_serves_text(swarm: Proc, server: Proc, model_id: str) -> None:
    """``meshnet up``'s gateway decodes over the channel; a second gateway on the same nodes sends
    HTTP requests per hop (``--decode-channel off``): both give ``serve``'s greedy text, streamed or
    not, with drafts and without, and the nodes really took steps over their channels. A third, on
    the channel without speculation, has the tail relay most of its steps to the head itself (member
    TLS both ways, the head taking them from the tail). Steps with drafts are never relayed: where a
    text repeats itself (this prompt's greedy text does on some CPUs), ``meshnet up``'s gateway drafts."""
    nodes = [n["url"] for n in httpx.get(f"{swarm.url}/v1/swarm", timeout=30).json()["nodes"]]
    before = [_metric(swarm, url, "meshnet_node_channel_steps_total") for url in nodes]
    gateway = ["gateway", "--tracker", tracker_url(swarm), "--port", "0", "--speculative", "off"]
    http_flags = ["--decode-channel", "off", "--swarm-dir", str(join_member(swarm, "gateway", "http-gateway"))]
    plain_flags = ["--swarm-dir", str(join_member(swarm, "gateway", "plain-gateway"))]
    with meshnet_process([*gateway, *http_flags]) as http_gateway, meshnet_process([*gateway, *plain_flags]) as plain:
        prompts = ("Repeat after me: one two three, one two three, one two three.", PROMPTS[3])
        expected = {prompt: chat(server.url, model_id, prompt) for prompt in prompts}
        for prompt, text in expected.items():
            assert chat(swarm.url, model_id, prompt, stream=True) == text
            assert chat(http_gateway.url, model_id, prompt) == text
        relayed = sum(_metric(swarm, url, "meshnet_node_relayed_steps_total") for url in nodes)
        with openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=180) as client:
            out = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPTS[3]}],
                                                 temperature=0, max_tokens=N_TOKENS)  # fmt: skip
        assert out.choices[0].message.content == expected[PROMPTS[3]]
    after = [_metric(swarm, url, "meshnet_node_channel_steps_total") for url in nodes]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    steps = out.usage.completion_tokens if out.usage is not None else 0
    relays = sum(_metric(swarm, url, "meshnet_node_relayed_steps_total") for url in nodes) - relayed
    assert relays >= steps // 2 > 0, f"{relays} of {steps} steps relayed; the gateway said:\n{plain.output()}"
    assert all(_metric(swarm, url, "meshnet_node_channels_open") >= 1 for url in nodes)  # kept open between steps


def _metric(swarm: Proc, url: str, name: str) -> float:
    with admin_client(swarm) as admin:
        text = admin.get(f"{url}/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(f"{name} ")).split()[1])


def test_up_routes_over_its_own_trusted_nodes(swarm: Proc) -> None:
    """``meshnet up`` joins its nodes trusted (issue #28): none serves on probation, so a member that
    joins its swarm later, untrusted and unmeasured, heads none of its routes whatever speed it claims
    (tests/integration/test_attacks_floods.py)."""
    with admin_client(swarm) as admin:
        nodes = admin.get(f"{tracker_url(swarm)}/v1/nodes").json()["nodes"]
    assert len(nodes) == 3 and {(n["trusted"], n["probation"]) for n in nodes} == {(True, False)}
