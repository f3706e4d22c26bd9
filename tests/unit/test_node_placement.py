"""A ``--layers auto`` node's side: its ask from the GGUF's header, and the drain a move starts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gguf
import pytest

from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.gguf_source import open_gguf
from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.node.placement import AutoPlacement, allows, ask_from_gguf


def test_the_sizes_the_ask_reads_are_gguf_py_s() -> None:
    path = bundled_gguf()
    reader = gguf.GGUFReader(str(path))
    assert _sizes(path) == {t.name: int(t.n_bytes) for t in reader.tensors}


def test_a_file_that_is_no_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(InvalidRequest, match="no GGUF magic"):
        ask_from_gguf(bad, kv_tokens=1, budget_bytes=1 << 20, max_layers=None)


def _sizes(path: Path) -> dict[str, int]:
    return {t.name: t.nbytes for t in open_gguf(path).tensors}


def test_the_ask_of_the_bundled_model_counts_weights_kv_and_the_tables() -> None:
    tokens = 2 * 512
    ask = ask_from_gguf(bundled_gguf(), kv_tokens=tokens, budget_bytes=64 << 20, max_layers=None)
    sizes = _sizes(bundled_gguf())
    block0 = sum(v for k, v in sizes.items() if k.startswith("blk.0."))
    assert ask["layer_bytes"][0] == block0 + 768 * tokens  # 768 KV bytes per position per layer (f16)
    assert ask["boundaries"] == list(range(31))
    table = sizes["token_embd.weight"]
    assert (ask["head_bytes"], ask["tail_bytes"]) == (table, table + sizes["output_norm.weight"])
    assert allows(ask, LayerRange(10, 20, 30))
    assert not allows(ask, LayerRange(0, 30, 30))  # the whole model needs ~100 MB of the 64 MiB
    assert not allows({**ask, "max_layers": 5}, LayerRange(10, 20, 30))


class _Store:
    def __init__(self, sessions: int) -> None:
        self.sessions = sessions

    def __len__(self) -> int:
        return self.sessions


def _ask() -> dict[str, object]:
    return {"layer_bytes": [1] * 12, "budget_bytes": 100, "boundaries": [0, 4, 8, 12], "head_bytes": 0,
            "tail_bytes": 0, "base_bytes": 0, "max_layers": 4}  # fmt: skip


def test_a_move_drains_the_sessions_then_stops_the_server_once() -> None:
    async def scenario() -> tuple[bool, LayerRange | None, int]:
        placement = AutoPlacement(_ask(), drain_timeout_s=30)
        server = type("Server", (), {"should_exit": False})()
        placement.attach(server)
        store = _Store(1)
        here = LayerRange(0, 4, 12)
        placement.on_answer({"move": {"layers": "8:12", "reason": "hole"}}, store, here)
        placement.on_answer({"move": {"layers": "4:8", "reason": "again"}}, store, here)
        await asyncio.sleep(0.7)
        waited = server.should_exit
        store.sessions = 0
        for _ in range(40):
            if server.should_exit:
                break
            await asyncio.sleep(0.1)
        return waited, placement.target, placement.moves

    waited, target, moves = asyncio.run(scenario())
    assert not waited  # a session was still open
    assert target == LayerRange(8, 12, 12) and moves == 0  # the first move holds; the repeat is ignored


def test_a_move_to_a_range_the_node_cannot_hold_is_refused() -> None:
    async def scenario() -> LayerRange | None:
        placement = AutoPlacement(_ask(), drain_timeout_s=0)
        placement.attach(type("Server", (), {"should_exit": False})())
        here = LayerRange(0, 4, 12)
        for bad in ("2:6", "0:12", "x", "4:4"):  # off the boundaries, too big, not a range, empty
            placement.on_answer({"move": {"layers": bad}}, _Store(0), here)
        await asyncio.sleep(0.1)
        return placement.target

    assert asyncio.run(scenario()) is None


def test_the_default_budget_counts_the_gpus_free_memory_where_the_layers_will_live(monkeypatch) -> None:
    """--layers auto without --memory-gb: the host's memory on the CPU; with --gpu-layers all the
    discrete GPUs' free memory; with --gpu-layers N both. An integrated GPU adds nothing."""
    from meshnet.backends import gpu
    from meshnet.node import advert, placement

    gib = 2**30
    devices = [gpu.GpuDevice("CUDA0", "NVIDIA H200", 141 * gib, 100 * gib, False),
               gpu.GpuDevice("Vulkan1", "Intel UHD", 8 * gib, 8 * gib, True)]  # fmt: skip
    monkeypatch.setattr(gpu, "gpu_devices", lambda: devices)
    monkeypatch.setattr(advert, "host_hardware", lambda threads=None: {"ram_available_bytes": 20 * gib,
                                                                       "ram_total_bytes": 32 * gib})  # fmt: skip
    assert placement.default_budget_bytes() == int(0.9 * 20 * gib)
    assert placement.default_budget_bytes(-1) == int(0.9 * 100 * gib)
    assert placement.default_budget_bytes(8) == int(0.9 * 120 * gib)
    monkeypatch.setattr(gpu, "gpu_devices", lambda: devices[1:])  # only the integrated one: the host's memory
    assert placement.default_budget_bytes(-1) == int(0.9 * 20 * gib)
