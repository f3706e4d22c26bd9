"""The wire: header names, dtypes and (with the route issue) the binary prefill/decode frames.

Imports no backend. The contract is written down in docs/protocol.md.
"""
