"""Audit sampling on a real swarm (docs/security.md, "Audit sampling").

A tracker, a head (0:15) and a tail (15:30), an auditor of each range (``meshnet node --auditor``,
never routed) with another thread count than the node it audits, and a gateway auditing every
session (``--audit-rate 1``), driven by the official ``openai`` client.

- Honest nodes pass every audit, greedy and sampled, with and without a seed, with penalties and
  streamed: re-execution on another thread count gives the same bits.
- A node that lies in its computation — noise on what it sends on, lossy rounding, a skipped
  layer, a tail that commits to a distribution its layers do not give — signs a consistent chain
  and streams plausible text, and fails its audit on the first session: the gateway and the
  tracker list the failure, the tracker suspends the node and voids its pay.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import Proc, meshnet_process, start_together

pytestmark = pytest.mark.real

MODEL = "SmolLM2-135M-Instruct.Q4_1"
LIAR = [sys.executable, "-m", "tests.liar_node"]


def _audits(url: str, want: int, **params: str) -> list[dict[str, Any]]:
    """``GET /v1/audits`` once it lists ``want`` audits (bounded wait)."""
    deadline = time.monotonic() + 120
    while True:
        found = httpx.get(f"{url}/v1/audits", params={"limit": "1000", **params}, timeout=10).json()["audits"]
        if len(found) >= want:
            return found
        assert time.monotonic() < deadline, f"{len(found)} audits of {want} after 120 s: {found}"
        time.sleep(0.2)


def _billed(tracker: str, node: str) -> list[dict[str, Any]]:
    """``node``'s billing records once the gateway's outbox delivered them (bounded wait)."""
    deadline = time.monotonic() + 60
    while True:
        records = httpx.get(f"{tracker}/v1/billing", params={"node_id": node}, timeout=10).json()["records"]
        if records:
            return list(records)
        assert time.monotonic() < deadline, f"no billing record of {node} after 60 s"
        time.sleep(0.2)


def _wait_nodes(tracker: str, names: set[str]) -> None:
    deadline = time.monotonic() + 120
    while not names <= {n["node_id"] for n in httpx.get(f"{tracker}/v1/nodes", timeout=10).json()["nodes"]}:
        assert time.monotonic() < deadline, f"nodes {sorted(names)} never all registered"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def other_quantization(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model requantized to Q4_0 (llama.cpp's own quantizer), under the bundled file's
    name: a cheaper model a liar can serve while it advertises the bundled one."""
    import ctypes

    import llama_cpp

    from meshnet.artifacts.bundled import bundled_gguf

    honest = bundled_gguf()
    other = tmp_path_factory.mktemp("q4_0") / honest.name
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True
    assert llama_cpp.llama_model_quantize(str(honest).encode(), str(other).encode(), ctypes.byref(params)) == 0
    return other


@contextlib.contextmanager
def _swarm(
    tmp_path: Path, lie: str | None = None, liar: str = "head", liar_args: tuple[str, ...] = (),
    auditor_args: tuple[str, ...] = (),
) -> Iterator[tuple[str, Proc]]:  # fmt: skip
    """The audited swarm; with ``lie``, node ``liar`` (head or tail) lies that way (tests.liar_node);
    ``auditor_args``: more flags for the auditors (another backend: another numerics class)."""
    db = f"sqlite:///{tmp_path}/tracker.db"
    common = ["--ctx", "512", "--max-sessions", "2"]
    with meshnet_process(["tracker", "--port", "0", "--db", db]) as tracker, contextlib.ExitStack() as stack:
        url = tracker.url
        starting: dict[str, Any] = {}  # started together: the nodes load at once
        for name, layers, threads in (("head", "0:15", "1"), ("tail", "15:30", "2")):
            args = ["node", "--layers", layers, "--node-id", name, "--tracker", url, "--threads", threads, *common]
            lying = lie is not None and name == liar
            starting[name] = (
                meshnet_process([lie, "--", *args, *liar_args], command=LIAR) if lying else meshnet_process(args)
            )
        for name, layers, threads in (("audit-head", "0:15", "2"), ("audit-tail", "15:30", "1")):
            args = ["node", "--layers", layers, "--node-id", name, "--tracker", url, "--threads", threads, "--auditor"]
            starting[name] = meshnet_process([*args, *common, *auditor_args])
        gateway_args = ["gateway", "--tracker", url, "--port", "0", "--ctx", "512", "--audit-rate", "1"]
        starting["gateway"] = meshnet_process(gateway_args)
        gateway = start_together(stack, starting)["gateway"]
        _wait_nodes(url, {"head", "tail", "audit-head", "audit-tail"})
        yield url, gateway
        assert gateway.popen.poll() is None


REQUESTS: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 0.8},  # the gateway seeds it
    {"temperature": 0.7, "seed": 5, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"temperature": 0, "stream": True},
]


def test_honest_nodes_pass_every_audit_across_thread_counts(tmp_path) -> None:
    with _swarm(tmp_path) as (tracker, gateway):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        for extra in REQUESTS:
            stream = extra.pop("stream", False)
            asked = {"model": MODEL, "prompt": "Name three rivers of Europe:", "max_tokens": 24, **extra}
            if stream:
                text = "".join(c.choices[0].text for c in client.completions.create(**asked, stream=True))
            else:
                text = client.completions.create(**asked).choices[0].text
            assert text
        audits = _audits(gateway.url, 2 * len(REQUESTS))
        assert {(a["node_id"], a["verdict"]) for a in audits} == {("head", "pass"), ("tail", "pass")}, audits
        assert all(a["reported"] for a in audits), audits
        assert {a["auditors"][0] for a in audits} == {"audit-head", "audit-tail"}
        kept = _audits(tracker, 2 * len(REQUESTS))
        assert {a["verdict"] for a in kept} == {"pass"} and not httpx.get(f"{tracker}/v1/audits").json()["suspended"]
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        assert f'meshnet_gateway_audits{{verdict="pass"}} {2 * len(REQUESTS)}.0' in metrics


@pytest.mark.parametrize(
    ("lie", "liar"),
    [("noise:1e-3", "head"), ("noise:1e-6", "head"), ("lossy", "head"), ("skip", "head"), ("noise:1e-4", "tail")],
    ids=["noise-1e-3", "noise-1e-6", "lossy-bf16", "skipped-layer", "tail-forged-distribution"],
)
def test_a_node_that_computes_otherwise_fails_its_audit_and_is_suspended_unpaid(tmp_path, lie: str, liar: str) -> None:
    with _swarm(tmp_path, lie, liar) as (tracker, gateway):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        asked = {"model": MODEL, "prompt": "Name three rivers of Europe:", "max_tokens": 16}
        assert client.completions.create(**asked, temperature=0.8, seed=3).choices[0].text  # plausible text streams
        audits = _audits(gateway.url, 2)
        verdicts = {a["node_id"]: a for a in audits}
        honest = "tail" if liar == "head" else "head"
        assert verdicts[liar]["verdict"] == "fail", audits
        assert verdicts[honest]["verdict"] == "pass", audits
        assert len(verdicts[liar]["auditors"]) >= 1
        kept = _audits(tracker, 1, node_id=liar, verdict="fail")
        assert kept[0]["verdict"] == "fail"
        answer = httpx.get(f"{tracker}/v1/audits", timeout=10).json()
        assert [s["node_id"] for s in answer["suspended"]] == [liar]
        voided = _billed(tracker, liar)
        assert all(r["voided"] for r in voided), voided
        # Suspended: no route has it any more (no other node holds its layers; auditors are never routed).
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**asked, temperature=0)
        assert refused.value.status_code == 503


def test_a_node_serving_a_cheaper_quantization_as_the_advertised_one_fails_its_audit(
    tmp_path, other_quantization: Path
) -> None:
    from meshnet.artifacts.bundled import bundled_gguf

    lie = f"quant:{bundled_gguf()}"
    with _swarm(tmp_path, lie, "head", ("--gguf", str(other_quantization))) as (tracker, gateway):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        asked = {"model": MODEL, "prompt": "Name three rivers of Europe:", "max_tokens": 16, "temperature": 0}
        assert client.completions.create(**asked).choices[0].text
        verdicts = {a["node_id"]: a["verdict"] for a in _audits(gateway.url, 2)}
        assert verdicts == {"head": "fail", "tail": "pass"}
        assert [s["node_id"] for s in httpx.get(f"{tracker}/v1/audits", timeout=10).json()["suspended"]] == ["head"]


def test_a_node_that_withholds_its_seam_log_fails_as_withheld_and_loses_that_sessions_pay(tmp_path) -> None:
    with _swarm(tmp_path, "withhold", "head") as (tracker, gateway):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        asked = {"model": MODEL, "prompt": "Name three rivers of Europe:", "max_tokens": 8, "temperature": 0}
        assert client.completions.create(**asked).choices[0].text
        (audit,) = _audits(gateway.url, 1)
        assert (audit["node_id"], audit["verdict"], audit["kind"]) == ("head", "fail", "withheld"), audit
        counts = httpx.get(f"{gateway.url}/v1/audits", timeout=10).json()["counts"]
        assert counts.get("skipped", 0) == 0  # the tail, whose inputs were the head's log, is not judged
        kept = _audits(tracker, 1, node_id="head")
        assert (kept[0]["verdict"], kept[0]["kind"]) == ("fail", "withheld")
        head = _billed(tracker, "head")
        assert all(r["voided"] for r in head), head
        assert not httpx.get(f"{tracker}/v1/audits", timeout=10).json()["suspended"]  # the gateway's word only


@pytest.mark.parametrize(
    ("lie", "verdict"),
    [(None, "pass"), ("skip", "fail"), ("noise:1e-1", "fail"), ("noise:1e-3", "pass")],
    ids=["honest", "skipped-layer", "noise-1e-1", "noise-1e-3-below-tolerance"],
)
def test_across_numerics_classes_a_pytorch_auditor_compares_within_the_calibrated_tolerance(
    tmp_path, lie: str | None, verdict: str
) -> None:
    """Auditors on the PyTorch reference backend (another numerics class than llama.cpp's): an honest
    head passes within the tolerance calibrated for the pair, gross lies fail, and noise far below
    the two backends' own difference is not told apart (docs/security.md says so)."""
    with _swarm(tmp_path, lie, "head", auditor_args=("--backend", "torch")) as (_, gateway):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
        asked = {"model": MODEL, "prompt": "Name three rivers of Europe:", "max_tokens": 12}
        assert client.completions.create(**asked, temperature=0.8, seed=4).choices[0].text
        verdicts = {a["node_id"]: a for a in _audits(gateway.url, 2)}
        assert verdicts["head"]["verdict"] == verdict, verdicts
        assert verdicts["tail"]["verdict"] == "pass", verdicts
        assert "numerics class" in verdicts["head"]["reason"]


def _flip_a_verify_token(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """A tail that answers another last token of a verify chunk (which commits no draw, so only an
    audit can tell): the next step then carries it, so the route stays consistent."""
    tokens = data.get("tokens")
    if not path.endswith("/verify") or not isinstance(tokens, list) or len(tokens) < 2:
        return None
    tokens[-1] = tokens[-1] + 1 if tokens[-1] < 40 else tokens[-1] - 1
    return data


def test_a_tail_that_changes_a_speculative_verify_chunks_token_fails_its_audit(tmp_path) -> None:
    from meshnet.protocol.signing import HopKey
    from tests.asgi import serve_in_thread
    from tests.integration.test_lying_hop import Liar, _register_liar

    with (
        _swarm(tmp_path) as (tracker, gateway),
        meshnet_process(["node", "--layers", "15:30", "--node-id", "liar", "--ctx", "512"]) as backend,
    ):
        liar = Liar(backend.url, _flip_a_verify_token, key=HopKey.generate())
        with serve_in_thread(liar.app) as liar_url:
            _register_liar(tracker, "tail", liar, backend, liar_url)
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
            prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
            assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices
            assert liar.lied, "no verify chunk reached the liar (no drafts?)"
            verdicts = {a["node_id"]: a for a in _audits(gateway.url, 2)}
            assert verdicts["liar"]["verdict"] == "fail" and "answered token" in verdicts["liar"]["reason"], verdicts
            assert verdicts["head"]["verdict"] == "pass", verdicts
            kept = _audits(tracker, 1, node_id="liar", verdict="fail")
            assert kept[0]["kind"] == "reexecuted"
