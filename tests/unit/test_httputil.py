"""Shared HTTP helpers (meshnet.httputil)."""

from __future__ import annotations

import ssl

from meshnet.httputil import tls_or_default


def test_clients_without_member_tls_share_one_default_context_built_once() -> None:
    first = tls_or_default(None)
    assert tls_or_default(None) is first  # not the CA bundle parsed again for every client
    assert first.verify_mode is ssl.CERT_REQUIRED and first.check_hostname
    member = ssl.create_default_context()
    assert tls_or_default(member) is member
