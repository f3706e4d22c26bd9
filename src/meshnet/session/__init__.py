"""Per-session KV/state ownership on a shard.

A session's KV lives on the node that computed it and is owned by one store there, with byte
accounting, idle TTL, eviction and one named error when full (the shard-backends issue). The
single-node server keeps its one context's KV inside the llama.cpp engine for now.
"""
