"""The load-time self-check of ``struct ggml_tensor``'s layout (backends/ggml_layout.py) on the real
libggml llama-cpp-python ships: the offsets the eval callback reads hold, and wrong ones are refused."""

from __future__ import annotations

import llama_cpp
import pytest

from meshnet.backends.ggml_layout import NAME_OFFSET, NE_OFFSET, check_tensor_layout
from meshnet.errors import EngineError

pytestmark = pytest.mark.real


def test_the_offsets_hold_for_the_llama_cpp_installed() -> None:
    check_tensor_layout(llama_cpp)


@pytest.mark.parametrize(
    ("ne_offset", "name_offset", "says"),
    [(NE_OFFSET + 8, NAME_OFFSET, "ne[] read at 24"), (NE_OFFSET, NAME_OFFSET + 8, "name is at 256, not 264")],
)
def test_a_wrong_offset_is_refused_with_what_to_do(ne_offset: int, name_offset: int, says: str) -> None:
    with pytest.raises(EngineError, match="struct ggml_tensor") as refused:
        check_tensor_layout(llama_cpp, ne_offset=ne_offset, name_offset=name_offset)
    assert says in str(refused.value) and "llama-cpp-python==0.3.36" in str(refused.value)
