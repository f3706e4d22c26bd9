"""DeepSeek-V4, Qwen3.5-MoE and GLM-5.x split over PyTorch node processes (``meshnet node --backend
torch --hf``).

Each tiny random model is saved with ``save_pretrained``; one node process holds it whole (the
reference), three hold its layers 0:1, 1:3, 3:4 (GLM: two, 0:2 and 2:4, where its ranges may
open). Driven over HTTP exactly as the gateway drives a route — token ids to the head,
``X-Meshnet-Next-Hops`` on the first chunk, decode steps — the route gives the whole model's greedy
tokens. DeepSeek-V4's hash-routed layers read the token ids at every
hop: they travel beside the ``[hc_mult, hidden]`` activations (``X-Meshnet-Token-Ids``), also when
route repair replays a hop's seam log into a replacement.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshnet.backends.tiny_models import TINY_MODELS
from meshnet.protocol.wire import encode_tensor, format_shape
from tests.procs import Proc, meshnet_process

pytestmark = pytest.mark.real

PROMPT = [5, 17, 99, 3, 42, 7, 128, 64, 11, 200, 31, 77]
STEPS = 6
RANGES = ("0:1", "1:3", "3:4")
# GLM-5.x: ranges open only on layers computing their own top-k selection (layers 0 and 2 here)
RANGES_FOR = {"glm_moe_dsa": ("0:2", "2:4")}


def node(folder: Path, layers: str, *extra: str) -> list[str]:
    return ["node", "--backend", "torch", "--hf", str(folder), "--layers", layers, "--threads", "1", *extra]


def post(url: str, sid: str, model: str, ids: list[int], headers: dict[str, str], path: str) -> httpx.Response:
    frame = encode_tensor(np.asarray([ids], dtype=np.int32), "int32")
    send = {
        "X-Meshnet-Model": model,
        "X-Meshnet-Route-Id": "rte-torch",
        "X-Meshnet-Shape": format_shape(frame.shape),
        "X-Meshnet-Dtype": "int32",
        "Content-Type": "application/octet-stream",
        **headers,
    }
    return httpx.post(f"{url}/v1/sessions/{sid}/{path}", content=frame.body, headers=send, timeout=120)


def generate(head: Proc, rest: list[Proc], sid: str, model: str, steps: int = STEPS) -> list[int]:
    """Greedy tokens of PROMPT through ``head`` and ``rest``, as the gateway drives a route."""
    first = {"X-Meshnet-Token-Range": f"0-{len(PROMPT) - 1}", "X-Meshnet-Sample": "1"}
    if rest:
        first["X-Meshnet-Next-Hops"] = ",".join(p.url for p in rest)
    answer = post(head.url, sid, model, PROMPT, first, "prefill")
    assert answer.status_code == 200, answer.text
    tokens = [answer.json()["token"]]
    for step in range(steps):
        position = len(PROMPT) + step
        answer = post(head.url, sid, model, [tokens[-1]], {"X-Meshnet-Position": str(position)}, "decode-step")
        assert answer.status_code == 200, answer.text
        tokens.append(answer.json()["token"])
    return tokens


@pytest.fixture(scope="module", params=["deepseek_v4", "qwen3_5_moe_text", "glm_moe_dsa"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("hf") / request.param
    TINY_MODELS[request.param]().save_pretrained(folder)
    yield folder


def test_three_torch_nodes_give_the_whole_models_tokens(model_dir: Path) -> None:
    model = model_dir.name
    with meshnet_process(node(model_dir, "0:4")) as whole:
        want = generate(whole, [], "whole", model)
    with ExitStack() as stack:
        procs = [stack.enter_context(meshnet_process(node(model_dir, r))) for r in RANGES_FOR.get(model, RANGES)]
        assert generate(procs[0], procs[1:], "split", model) == want
        if model != "deepseek_v4":
            return
        # Past the head every hop needs the ids beside the activations: without them, a clear 400.
        hidden = encode_tensor(np.zeros((1, 1, 4, 64), dtype=np.float32), "float32")
        bare = httpx.post(
            f"{procs[1].url}/v1/sessions/bare/prefill",
            content=hidden.body,
            headers={
                "X-Meshnet-Model": model,
                "X-Meshnet-Route-Id": "r",
                "X-Meshnet-Shape": "1,1,4,64",
                "X-Meshnet-Dtype": "float32",
                "X-Meshnet-Token-Range": "0-0",
            },
            timeout=30,
        )
        assert bare.status_code == 400 and "X-Meshnet-Token-Ids: 1" in bare.json()["error"]["message"]
        # Route repair: the middle replays its seam log — activations and token ids — into a fresh tail.
        sid = "repaired"
        got = generate(procs[0], procs[1:], sid, model, steps=3)
        spare = stack.enter_context(meshnet_process(node(model_dir, RANGES[-1])))
        moved = httpx.post(
            f"{procs[1].url}/v1/sessions/{sid}/reroute",
            headers={
                "X-Meshnet-Model": model,
                "X-Meshnet-Route-Id": "rte-torch",
                "X-Meshnet-Next-Hops": spare.url,
                "X-Meshnet-Replay": "1",
            },
            timeout=120,
        )
        assert moved.status_code == 200, moved.text
        assert moved.json()["token"] == got[-1]
        for step in range(3, STEPS):
            position = len(PROMPT) + step
            answer = post(procs[0].url, sid, model, [got[-1]], {"X-Meshnet-Position": str(position)}, "decode-step")
            assert answer.status_code == 200, answer.text
            got.append(answer.json()["token"])
        assert got == want
