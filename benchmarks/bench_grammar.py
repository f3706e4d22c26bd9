"""Grammar-constrained decoding on a route: structured output vs free text, same swarm, same prompt.

One tracker, three llama.cpp node processes and one gateway (default `--speculative ngram`) on
loopback. The same greedy request runs free, under `response_format: json_object` and under a JSON
schema, in alternating rounds; the grammar is applied at the tail (one-token check per step, the whole
vocabulary masked only when the model's choice is refused). Decode tok/s is (tokens - 1) / (last
token - first token) of the stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from benchmarks.bench_serve import stream_text
from benchmarks.bench_speculative import gateway_swarm
from benchmarks.common import Section, decode_rate, median

CORES = os.cpu_count() or 2
TOKENS = 96
ROUNDS = 3
PROMPT = "Ten facts about the sea, as a JSON object with a list of facts:"
SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 10}},
    "required": ["facts"],
}
MODES = {
    "free text": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}},
}


def run() -> Section:
    threads = max(1, CORES // 3)
    section = Section(
        "Grammar-constrained decoding on a route: structured output ÷ free text",
        f"python benchmarks/run.py --only grammar  (3 llama.cpp nodes, {threads} thread(s) each, loopback; "
        f"gateway --speculative ngram; {TOKENS} greedy tokens, median of {ROUNDS} alternating rounds)",
    )
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        nodes = [["--layers", layers, "--threads", str(threads)] for layers in ("0:10", "10:20", "20:30")]
        gateways, model = gateway_swarm(stack, tmp, nodes, {"ngram": ("--speculative", "ngram")})
        url = gateways["ngram"]
        stream_text(url, model, "warm up", TOKENS)
        rates: dict[str, list[float]] = {}
        texts: dict[str, str] = {}
        for _ in range(ROUNDS):
            for mode, extra in MODES.items():
                text, times, final = stream_text(url, model, PROMPT, TOKENS, extra=extra)
                rates.setdefault(mode, []).append(decode_rate(final["completion_tokens"], times))
                texts[mode] = text
    free = median(rates["free text"])
    section.add("free text: decode", f"{free:.1f} tok/s")
    for mode in ("json_object", "json_schema"):
        rate = median(rates[mode])
        section.add(f"{mode}: decode", f"{rate:.1f} tok/s")
        section.add(f"{mode} ÷ free text", f"{rate / free:.2f}", "≥ 0.8", rate / free >= 0.8)
    starts = all(texts[m].lstrip().startswith("{") for m in ("json_object", "json_schema"))
    section.add("constrained output is JSON from its first token", "yes" if starts else "no", "yes", starts)
    section.notes.append(
        "The free text of the same prompt: "
        + json.dumps(texts["free text"][:80])
        + "...; under the schema: "
        + json.dumps(texts["json_schema"][:80])
        + "..."
    )
    return section
