"""A shard node: serves the binary prefill/decode protocol for one layer range (route issue)."""
