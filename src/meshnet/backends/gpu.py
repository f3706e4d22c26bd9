"""GPU offload for llama.cpp: what llama.cpp sees of this machine's GPUs, and the check that this
llama-cpp-python can offload at all (docs/backends.md, "GPU offload").

Devices are read through ggml's public device API (``ggml-backend.h``) with ``ctypes``, on the
libraries llama-cpp-python ships: ``libggml`` holds the registry (``ggml_backend_dev_count``,
``ggml_backend_dev_get``), ``libggml-base`` the per-device calls (name, description, type, memory).
Only devices of type GPU and IGPU are reported: a CPU build lists its CPU alone, so it reports none.

``gpu_layers`` is llama-server's ``--n-gpu-layers``: 0 computes on the CPU only, -1 offloads every
layer of the model (or shard) file, N the last N of its layers, llama.cpp counting the output layer as
one (``llama_model::load_tensors``: ``i_gpu_start = n_layer + 1 - n_gpu_layers``; the input embeddings
always stay on the CPU).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest

__all__ = [
    "ALL_LAYERS",
    "GpuDevice",
    "discrete_gpus",
    "gpu_devices",
    "gpu_label",
    "gpu_layers_flag",
    "offload_error",
    "offload_numerics",
    "require_offload",
]

log = logging.getLogger("meshnet.gpu")

ALL_LAYERS = -1  # gpu_layers: every layer, as llama.cpp's negative n_gpu_layers
# enum ggml_backend_dev_type (ggml-backend.h): CPU, GPU, IGPU, ACCEL, META
_DEVICE_GPU, _DEVICE_IGPU = 1, 2
_LIB_SUFFIXES = (".so", ".dylib")


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU as llama.cpp's backend registry lists it; ``integrated`` GPUs use host memory."""

    name: str  # ggml's device name, e.g. "CUDA0", "Vulkan0", "Metal"
    description: str  # the product, e.g. "NVIDIA H200"
    memory_total_bytes: int
    memory_free_bytes: int
    integrated: bool


def gpu_layers_flag(gpu_layers: int) -> str:
    """``gpu_layers`` as the command line writes it: ``all`` for -1."""
    return "all" if gpu_layers == ALL_LAYERS else str(gpu_layers)


def offload_error(gpu_layers: int, llama_cpp: Any = None) -> str | None:
    """Why ``gpu_layers`` cannot run with this llama-cpp-python (``None``: it can); ``llama_cpp`` is
    the loaded module (imported here when not given). 0 always runs: it never imports llama.cpp."""
    if gpu_layers == 0:
        return None
    if llama_cpp is None:
        import llama_cpp as loaded

        llama_cpp = loaded
    if llama_cpp.llama_supports_gpu_offload():
        return None
    return (
        f"--gpu-layers {gpu_layers_flag(gpu_layers)} needs llama-cpp-python built with a GPU backend (CUDA, Metal "
        "or Vulkan); this one runs on the CPU only. Rebuild it with `make install LLAMA_BACKEND=cuda` "
        '(docs/backends.md, "GPU offload"), or drop --gpu-layers'
    )


def require_offload(llama_cpp: Any, gpu_layers: int) -> None:
    """Raise :class:`InvalidRequest` (what to fix) unless this build can offload ``gpu_layers``;
    called before a model is loaded, so a CPU build never silently runs a GPU configuration."""
    problem = offload_error(gpu_layers, llama_cpp)
    if problem is not None:
        raise InvalidRequest(problem, param="gpu_layers")


def offload_numerics(gpu_layers: int) -> str:
    """What the offload adds to a shard's numerics string and load-check key (``""`` on the CPU):
    GPU kernels compute other low bits than CPU ones, and one GPU model's than another's, so results
    are compared and cached only within the same offload and devices."""
    if gpu_layers == 0:
        return ""
    return f"; gpu_layers {gpu_layers_flag(gpu_layers)} on {gpu_label(gpu_devices()) or 'no GPU found'}"


def discrete_gpus(devices: Sequence[GpuDevice]) -> list[GpuDevice]:
    """The GPUs with memory of their own: an integrated GPU's memory is the host's, so it adds
    nothing to a memory budget."""
    return [d for d in devices if not d.integrated]


def gpu_label(devices: Sequence[GpuDevice]) -> str:
    """The devices by product, ``"2x NVIDIA H100"`` for several alike (llama.cpp splits offloaded
    layers over every GPU it lists); ``""`` for none."""
    counts = Counter(d.description or d.name for d in devices)
    return ", ".join(f"{n}x {d}" if n > 1 else d for d, n in sorted(counts.items()))


def gpu_devices() -> list[GpuDevice]:
    """The GPUs llama.cpp can offload to, with their memory now; ``[]`` on a CPU build, and ``[]``
    (logged once) when the libraries or a driver fail: a node's heartbeat must not stop for it."""
    try:
        lib = _libraries()
        if lib is None:
            return []
        registry, base = lib
        found = []
        for i in range(registry.ggml_backend_dev_count()):
            dev = registry.ggml_backend_dev_get(i)
            kind = base.ggml_backend_dev_type(dev)
            if not dev or kind not in (_DEVICE_GPU, _DEVICE_IGPU):
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            found.append(
                GpuDevice(
                    name=_text(base.ggml_backend_dev_name(dev)),
                    description=_text(base.ggml_backend_dev_description(dev)),
                    memory_total_bytes=int(total.value),
                    memory_free_bytes=int(free.value),
                    integrated=kind == _DEVICE_IGPU,
                )
            )
        return found
    except Exception as exc:  # a broken driver, a library without these symbols
        _warn_once(f"cannot list llama.cpp's GPUs, reporting none: {exc!r}")
        return []


def _text(raw: bytes | None) -> str:
    return raw.decode(errors="replace") if raw else ""


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


@functools.cache
def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """(libggml, libggml-base) of the installed llama-cpp-python, their signatures set; found without
    importing ``llama_cpp`` (its Python module loads libllama too). ``None`` when it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        _warn_once("llama-cpp-python is not installed: no GPU is reported")
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    registry, base = (ctypes.CDLL(str(_library(lib_dir, name))) for name in ("libggml", "libggml-base"))
    registry.ggml_backend_dev_count.argtypes, registry.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    registry.ggml_backend_dev_get.argtypes, registry.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        fn = getattr(base, name)
        fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes, base.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    size_p = ctypes.POINTER(ctypes.c_size_t)
    base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    base.ggml_backend_dev_memory.restype = None
    return registry, base


def _library(lib_dir: Path, stem: str) -> Path:
    """``stem`` in ``lib_dir`` as this platform names a shared library (Linux .so, macOS .dylib)."""
    for suffix in _LIB_SUFFIXES:
        path = lib_dir / f"{stem}{suffix}"
        if path.is_file():
            return path
    raise OSError(f"no {stem} shared library in {lib_dir}")
