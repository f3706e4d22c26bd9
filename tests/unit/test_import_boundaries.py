"""Package boundaries, checked on the source with ``ast`` (every import, at any depth of a file)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import meshnet

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "meshnet"

HEAVY = ("llama_cpp", "torch", "transformers")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted and absolute
    line: int


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def _imports(path: Path, src: Path = SRC) -> list[Import]:
    module = _module_name(path, src)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            found.append(Import(module, target, node.lineno))
            # "from pkg import sub" may import the submodule pkg.sub.
            found += [Import(module, f"{target}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append(Import(module, node.args[0].value, node.lineno))
    return found


def _all_imports() -> list[Import]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no sources under {PACKAGE}"
    return [imp for path in files for imp in _imports(path)]


def _is(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _in(module: str, package: str) -> bool:
    return _is(module, package)


def test_the_walk_sees_the_tree():
    imports = _all_imports()
    modules = {imp.module for imp in imports}
    assert {"meshnet", "meshnet.gateway.app", "meshnet.backends.fake", "meshnet.sampling"} <= modules
    # The lazy import inside a function of the llama.cpp backend is found.
    assert any(imp.module == "meshnet.backends.llama_full" and _is(imp.target, "llama_cpp") for imp in imports)


def test_resolve_relative_imports():
    assert _resolve("meshnet.gateway.app", False, 1, "telemetry") == "meshnet.gateway.telemetry"
    assert _resolve("meshnet.gateway.app", False, 2, "errors") == "meshnet.errors"
    assert _resolve("meshnet.gateway", True, 1, "app") == "meshnet.gateway.app"
    assert _resolve("meshnet.gateway.app", False, 1, None) == "meshnet.gateway"


def test_the_scanner_finds_nested_and_dynamic_imports(tmp_path: Path):
    fake_pkg = tmp_path / "meshnet" / "gateway"
    fake_pkg.mkdir(parents=True)
    source = fake_pkg / "x.py"
    source.write_text(
        "def f():\n"
        "    if True:\n"
        "        import torch.nn\n"
        "    from transformers import AutoModel\n"
        "    importlib.import_module('llama_cpp')\n"
        "    from . import y\n"
    )
    targets = {imp.target for imp in _imports(source, tmp_path)}
    assert {"torch.nn", "transformers", "llama_cpp", "meshnet.gateway.y"} <= targets


@pytest.mark.parametrize("heavy", HEAVY)
def test_only_backends_import_heavy_libraries(heavy: str):
    offenders = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _is(imp.target, heavy) and not _in(imp.module, "meshnet.backends")
    ]
    assert offenders == []


def test_protocol_imports_no_backend():
    offenders = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _in(imp.module, "meshnet.protocol") and _is(imp.target, "meshnet.backends")
    ]
    assert offenders == []


@pytest.mark.parametrize("framework", ["starlette", "fastapi", "uvicorn"])
def test_protocol_imports_no_web_framework(framework: str):
    """The wire (records, bindings, the hop client) is the same for a node, a gateway and a test in
    one process: no server framework in it (httpx and websockets are clients)."""
    offenders = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _in(imp.module, "meshnet.protocol") and _is(imp.target, framework)
    ]
    assert offenders == []


def test_tracker_never_imports_torch():
    offenders = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _in(imp.module, "meshnet.tracker") and _is(imp.target, "torch")
    ]
    assert offenders == []


def test_public_api_is_pinned():
    assert meshnet.__all__ == ["LayerRange", "MeshnetError", "__version__"]
    for name in meshnet.__all__:
        assert hasattr(meshnet, name)
    assert meshnet.__version__ == "0.1.0"
    assert meshnet.LayerRange is __import__("meshnet.layers", fromlist=["LayerRange"]).LayerRange
    assert meshnet.MeshnetError is __import__("meshnet.errors", fromlist=["MeshnetError"]).MeshnetError
