"""The BitTorrent address a node advertises: one other hosts can dial, never 0.0.0.0."""

from __future__ import annotations

import pytest

from meshnet.artifacts.torrent import peer_address
from meshnet.errors import InvalidRequest


def test_a_session_bound_to_one_address_is_reached_there() -> None:
    assert peer_address("10.1.0.2:6881", 6881, "node.example") == "10.1.0.2:6881"
    assert peer_address("127.0.0.1:0", 40123, None) == "127.0.0.1:40123"


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:6881", "::0:6881"])
def test_a_wildcard_listen_is_reached_at_the_nodes_advertised_host(listen: str) -> None:
    assert peer_address(listen, 6881, "10.1.0.3") == "10.1.0.3:6881"
    assert peer_address(listen, 6881, "fd00::3") == "[fd00::3]:6881"


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::"])
def test_a_wildcard_everywhere_is_refused_naming_the_flags(host: str | None) -> None:
    with pytest.raises(InvalidRequest, match="--listen THIS-HOST'S-ADDRESS:PORT or the node's --advertise-url"):
        peer_address("0.0.0.0:6881", 6881, host)
