"""``--gpu-layers N|all`` (docs/backends.md, "GPU offload"): the flag, the config, the refusal of a CPU
build before anything loads, what llama.cpp lists of this machine's GPUs, and how a node advertises
them to the tracker."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

from meshnet.backends import gpu
from meshnet.backends.gpu import GpuDevice, gpu_devices, gpu_label, offload_error, offload_numerics
from meshnet.backends.llama_shard import LlamaShardConfig
from meshnet.cli.main import _build_parser
from meshnet.cli.serve import gpu_layers_arg
from meshnet.node.advert import host_hardware
from tests.procs import MESHNET

H200 = GpuDevice("CUDA0", "NVIDIA H200", 150 * 2**30, 140 * 2**30, integrated=False)
CPU_ONLY = types.SimpleNamespace(llama_supports_gpu_offload=lambda: False)
WITH_GPU = types.SimpleNamespace(llama_supports_gpu_offload=lambda: True)
FIX = "make install LLAMA_BACKEND=cuda"


def _offload_supported() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


# -- the flag --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [("all", -1), ("ALL", -1), ("0", 0), ("12", 12)])
def test_the_flag_reads_all_or_a_layer_count(text: str, value: int) -> None:
    assert gpu_layers_arg(text) == value


@pytest.mark.parametrize("command", [["serve"], ["node", "--layers", "0:10"], ["up"]])
def test_every_command_that_loads_llama_cpp_takes_the_flag(command: list[str]) -> None:
    parser = _build_parser()
    assert parser.parse_args([*command, "--gpu-layers", "all"]).gpu_layers == -1
    assert parser.parse_args([*command, "--gpu-layers", "12"]).gpu_layers == 12
    assert parser.parse_args(command).gpu_layers == 0  # the default: CPU only, as before the flag


@pytest.mark.parametrize("text", ["x", "-1", "2.5", ""])
def test_anything_else_is_a_usage_error_naming_the_flag(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _build_parser().parse_args(["serve", "--gpu-layers", text])
    assert exited.value.code == 2
    assert "--gpu-layers" in capsys.readouterr().err


# -- the config and the refusal ----------------------------------------------------------------------
def test_the_shard_config_takes_minus_one_and_up_only() -> None:
    assert LlamaShardConfig().gpu_layers == 0
    assert LlamaShardConfig(gpu_layers=-1).gpu_layers == -1
    with pytest.raises(ValueError, match="gpu_layers"):
        LlamaShardConfig(gpu_layers=-2)


def test_a_cpu_build_says_what_to_rebuild() -> None:
    message = offload_error(20, CPU_ONLY)
    assert message is not None
    assert message.startswith("--gpu-layers 20 needs llama-cpp-python built with a GPU backend")
    assert FIX in message and "drop --gpu-layers" in message
    assert (offload_error(-1, CPU_ONLY) or "").startswith("--gpu-layers all ")
    assert offload_error(0, CPU_ONLY) is None  # CPU only runs anywhere
    assert offload_error(20, WITH_GPU) is None


def test_the_numerics_name_the_offload_and_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert offload_numerics(0) == ""  # a CPU shard's numerics and load-check keys are what they were
    monkeypatch.setattr(gpu, "gpu_devices", lambda: [H200, H200])
    assert offload_numerics(-1) == "; gpu_layers all on 2x NVIDIA H200"
    assert offload_numerics(8) == "; gpu_layers 8 on 2x NVIDIA H200"
    assert gpu_label([]) == ""


# -- what llama.cpp lists ------------------------------------------------------------------------------
def test_a_cpu_build_lists_no_gpu() -> None:
    if _offload_supported():
        pytest.skip("this llama-cpp-python is a GPU build")
    assert gpu_devices() == []


def test_a_broken_driver_reports_no_gpu_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(gpu, "_libraries", broken)
    gpu._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="meshnet.gpu"):
        assert gpu_devices() == []
        assert gpu_devices() == []
    assert [r.getMessage() for r in caplog.records if "libcuda" in r.getMessage()] == [
        "cannot list llama.cpp's GPUs, reporting none: OSError('libcuda.so.1: cannot open shared object file')"
    ]


# -- the advertisement ---------------------------------------------------------------------------------
def test_host_hardware_reports_the_gpus_llama_cpp_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # a backend loaded it
    monkeypatch.setattr(gpu, "gpu_devices", lambda: [H200, H200])
    hw = host_hardware()
    assert hw["gpu"] == "2x NVIDIA H200"
    assert hw["gpu_memory_bytes"] == 2 * 150 * 2**30


def test_host_hardware_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "gpu_devices", list)
    hw = host_hardware()
    assert "gpu_memory_bytes" in hw
    if "torch" not in sys.modules:
        assert hw["gpu"] is None and hw["gpu_memory_bytes"] is None


# -- on this CPU build, with llama.cpp and the bundled model ----------------------------------------------
@pytest.mark.real
def test_loading_with_gpu_layers_on_a_cpu_build_is_refused_before_loading() -> None:
    from meshnet.artifacts.bundled import bundled_gguf
    from meshnet.backends.llama_full import LlamaFullEngine
    from meshnet.backends.llama_shard import LlamaShard
    from meshnet.errors import InvalidRequest

    if _offload_supported():
        pytest.skip("this llama-cpp-python is a GPU build")
    with pytest.raises(InvalidRequest, match="--gpu-layers all needs llama-cpp-python built with a GPU") as shard:
        LlamaShard(bundled_gguf(), config=LlamaShardConfig(n_ctx=256, max_sessions=1, gpu_layers=-1))
    assert FIX in shard.value.message
    with pytest.raises(InvalidRequest, match="--gpu-layers 4 needs llama-cpp-python built with a GPU") as whole:
        LlamaFullEngine(bundled_gguf(), n_ctx=256, gpu_layers=4)
    assert FIX in whole.value.message


@pytest.mark.real
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["serve", "--gpu-layers", "4", "--port", "0"], "--gpu-layers 4"),
        (["node", "--layers", "0:10", "--gpu-layers", "all", "--port", "0"], "--gpu-layers all"),
        (["up", "--gpu-layers", "2", "--no-tls", "--port", "0"], "--gpu-layers 2"),
    ],
    ids=["serve", "node", "up"],
)
def test_the_cli_on_a_cpu_build_exits_2_with_the_fix(args: list[str], flag: str) -> None:
    if _offload_supported():
        pytest.skip("this llama-cpp-python is a GPU build")
    done = subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert f"{flag} needs llama-cpp-python built with a GPU backend" in done.stderr
    assert FIX in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
