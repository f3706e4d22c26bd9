from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procs import Proc, local_swarm, meshnet_process

# Small context keeps the KV allocation (and CI memory) low. One thread, as each node of `meshnet up`
# on 2 cores: past 256 positions llama.cpp's attention splits its sums by thread on some CPUs (AVX2
# builds), so text is compared between computations of the same thread count (docs/protocol.md).
SERVE_ARGS = ["serve", "--port", "0", "--threads", "1", "--ctx", "2048"]


@pytest.fixture(scope="session")
def server() -> Iterator[Proc]:
    with meshnet_process(SERVE_ARGS) as proc:
        yield proc


@pytest.fixture(scope="session")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """``meshnet up``: tracker + 3 llama.cpp nodes + gateway, shared by the modules that only send requests.
    Eight sessions at once: the concurrent-streams test runs eight through every node's batches.
    ``--draft-min 2``: every step the prompt lookup finds drafts for sends at least two, so every
    test whose text repeats also checks verify chunks against serve (by measured costs alone, on a
    loaded 2-core machine a chunk rarely pays, so whether one goes would be a matter of timing)."""
    workdir = tmp_path_factory.mktemp("swarm")
    with local_swarm(workdir, "--max-sessions", "8", "--draft-min", "2") as proc:
        yield proc


@pytest.fixture(scope="session")
def model_id(server: Proc) -> str:
    import httpx

    return str(httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"])
