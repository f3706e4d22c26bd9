"""The family table: one record per architecture, the manifest's list taken from it, and
docs/models.md's support table written from the same records (``make certify``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshnet.artifacts.manifest import KNOWN_ARCHITECTURES
from meshnet.models.families import FAMILIES, UncertifiedArchitecture, certification, family, require_certified

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_manifest_knows_exactly_the_table() -> None:
    assert tuple(KNOWN_ARCHITECTURES) == tuple(FAMILIES)


def test_the_docs_table_says_what_the_records_say() -> None:
    text = DOC.read_text()
    table = text.split("<!-- table: python -m tests.certify.table -->")[1].split("<!-- end of table -->")[0]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+) \|", table, re.M)}
    assert set(rows) == set(FAMILIES), "run make certify"
    for arch, record in FAMILIES.items():
        assert (rows[arch].strip() == "**certified**") == record.llama_route, arch


def test_an_unknown_or_uncertified_architecture_is_refused_with_the_reason() -> None:
    assert certification("llama") == (True, FAMILIES["llama"].why)
    # a PyTorch node names its transformers model_type: the same record
    assert certification("deepseek_v4", "torch") == (True, FAMILIES["deepseek4"].why)
    assert certification("qwen3_5_moe_text") == certification("qwen35moe")
    assert family("no-such-arch").llama_route is False
    assert require_certified("deepseek4") is None
    with pytest.raises(UncertifiedArchitecture, match=r"'exaone' is not certified.*EXAONE.*docs/models.md"):
        require_certified("exaone")
    warning = require_certified("no-such-arch", allow_uncertified=True)
    assert warning is not None and "never been checked" in warning and "--allow-uncertified" in warning


class _Field:
    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


def test_glm_range_starts_without_stored_indexer_types_follow_llama_cpp() -> None:
    """No per-layer indexer types in the GGUF: llama.cpp gives a short-context model a full indexer on
    every layer (any cut), and a 1M-context one GLM-5.2's built-in sharing, which no cut may cross."""
    from meshnet.artifacts.shard_file import _start_flags

    glm = FAMILIES["glm-dsa"]
    short = {"glm-dsa.context_length": _Field(202752)}
    assert _start_flags(short, "glm-dsa", glm, 4) == [True] * 4
    long = {"glm-dsa.context_length": _Field(1 << 20)}
    assert _start_flags(long, "glm-dsa", glm, 4) == [True, False, False, False]
    stored = {"glm-dsa.attention.indexer.types": _Field([1, 0, 1, 0])}
    assert _start_flags(stored, "glm-dsa", glm, 4) == [True, False, True, False]
    assert _start_flags(stored, "llama", FAMILIES["llama"], 4) is None


def test_a_certified_family_is_refused_on_another_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The certification holds for the llama.cpp it ran on: another release must be certified again."""
    import meshnet.models.families as families

    assert families.installed_llama_cpp() == families.LLAMA_CERTIFIED_ON  # what this repo installs
    monkeypatch.setattr(families, "installed_llama_cpp", lambda: "9.9.9")
    with pytest.raises(
        UncertifiedArchitecture, match=r"certified on llama-cpp-python 0\.3\.36, and this is 9\.9\.9.*make certify"
    ):
        require_certified("llama")
    warning = require_certified("llama", allow_uncertified=True)
    assert warning is not None and "9.9.9" in warning
    assert require_certified("llama", backend="torch") is None  # the PyTorch route does not run llama.cpp


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62), ("exaone4", 64), ("deepseek2", 27)])
def test_a_model_whose_graph_depends_on_its_layer_count_is_not_cut(arch: str, layers: int, tmp_path: Path) -> None:
    """llama.cpp picks a hyperparameter (an attention scale, sliding windows, the lite layout) by the
    file's layer count: a shard of such a model would compute another model, so the writer refuses
    to cut it, saying to serve it whole; nothing is written."""
    import gguf

    from meshnet.artifacts.shard_file import write_shard
    from meshnet.errors import InvalidRequest

    source = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(source), arch)
    writer.add_block_count(layers)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidRequest, match=rf"a {layers}-layer {arch} model cannot be split: .*--layers 0:{layers}"):
        write_shard(source, f"0:{layers // 2}", tmp_path / "s.gguf")
    assert not (tmp_path / "s.gguf").exists()
