"""Model families: which architectures a layer-split route serves correctly — one table, one place.

A route splits a model's blocks between nodes; whatever an architecture's graph does at a seam
(scales the input embeddings, picks attention type or rope by layer index, reads token ids inside
layers, keeps recurrent state) can make the split route compute something other than the whole
model — fluent text, wrong, with no error. So an architecture is served only once its
certification has passed: the whole GGUF in one llama.cpp context and the same GGUF cut into a
route (2 and 3 shards, cuts that fall on no layer pattern, odd prefill chunks, two interleaved
sessions) give bit-identical logits and identical greedy tokens (``tests/backends/
test_certification.py``, on tiny random models converted by llama.cpp's own converter; the table
in docs/models.md). Everything else is refused by ``meshnet shard make``, ``publish``, ``node`` and
``up`` unless the operator passes ``--allow-uncertified``.

Where a family needs handling at a seam, it goes into its ``Family`` record here — never into an
``if arch == ...`` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.errors import InvalidRequest

__all__ = [
    "FAMILIES",
    "KNOWN_ARCHITECTURES",
    "Family",
    "UncertifiedArchitecture",
    "certification",
    "require_certified",
]


@dataclass(frozen=True, slots=True)
class Family:
    """One GGUF architecture (``general.architecture``) and what is known about splitting it.

    ``llama_route`` / ``torch_route``: certified on that backend's layer-split route. ``why`` says
    what the certification found, or what stands in its way.
    """

    arch: str
    llama_route: bool
    torch_route: bool
    why: str


_CERTIFIED = "token- and bit-identical to the whole GGUF at every cut (tests/backends/test_certification.py)"

FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family("llama", True, True, _CERTIFIED + "; the bundled SmolLM2 over the network on both backends"),
        Family("qwen2", True, False, _CERTIFIED),
        Family("qwen3", True, False, _CERTIFIED),
        Family("qwen3moe", True, False, _CERTIFIED),
        Family("olmo2", True, False, _CERTIFIED),
        Family(
            "granite",
            False,
            False,
            "the split route's logits differ from the whole GGUF's in the low bits (max |Δ| 1.9e-4 on the tiny "
            "model with residual and logit multipliers): not yet explained",
        ),
        Family("gemma", False, False, "llama.cpp scales the input by sqrt(n_embd) inside every shard's graph"),
        Family("gemma2", False, False, "llama.cpp scales the input by sqrt(n_embd) inside every shard's graph"),
        Family("gemma3", False, False, "input scaled by sqrt(n_embd) in every shard; sliding-window pattern by layer"),
        Family("phi3", False, False, "not certified yet (the tiny model's conversion is not set up)"),
        Family("qwen2moe", False, False, "not certified yet"),
        Family("mistral3", False, False, "not certified yet"),
        Family("deepseek2", False, False, "not certified yet (MLA KV)"),
        Family("glm4", False, False, "not certified yet"),
        Family("glm4moe", False, False, "not certified yet"),
        Family("smollm3", False, False, "not certified yet (no-rope layers picked by layer index)"),
        Family("exaone", False, False, "not certified yet"),
    )
}
# The architectures a manifest may name: the table above, never a hand-kept list elsewhere.
KNOWN_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


class UncertifiedArchitecture(InvalidRequest):
    code = "uncertified_architecture"


def certification(arch: str, backend: str = "llama") -> tuple[bool, str]:
    """``(certified, why)`` for ``arch`` on ``backend`` ("llama" or "torch")."""
    family = FAMILIES.get(arch)
    if family is None:
        return False, f"architecture {arch!r} has never been checked"
    return (family.llama_route if backend == "llama" else family.torch_route), family.why


def require_certified(arch: str, *, backend: str = "llama", allow_uncertified: bool = False) -> str | None:
    """Raise ``UncertifiedArchitecture`` unless ``arch`` is certified on ``backend``'s route; with
    ``allow_uncertified`` return the warning to show instead (None when certified)."""
    certified, why = certification(arch, backend)
    if certified:
        return None
    message = (
        f"architecture {arch!r} is not certified for a layer-split route on the {backend} backend ({why}); "
        "a split route could produce wrong text without any error. See docs/models.md; pass "
        "--allow-uncertified to run it anyway"
    )
    if not allow_uncertified:
        raise UncertifiedArchitecture(message, param="architecture")
    return message.removesuffix("; pass --allow-uncertified to run it anyway") + " (running it: --allow-uncertified)"
