"""libtorrent in one place: the session settings docs/artifacts.md gives, and v2 torrents over a folder.

Settings (verified with libtorrent 2.1.1): TCP only (uTP is ~15x slower on loopback), no DHT, LSD,
UPnP or NAT-PMP, listening only on the configured interface. Torrents are BitTorrent v2 only:
every file starts on a piece boundary and has its own SHA-256 merkle root, so selecting files
downloads exactly those files, and the root is a content address independent of piece size.

libtorrent is imported lazily: publishing and fetching need it, the rest of Meshnet does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest
from meshnet.httputil import is_wildcard

__all__ = [
    "DEFAULT_PIECE_LENGTH",
    "TorrentFiles",
    "create_torrent",
    "make_session",
    "parse_endpoint",
    "peer_address",
    "read_torrent",
]

DEFAULT_PIECE_LENGTH = 1 << 20  # 1 MiB: small enough for loopback tests, few hashes for big models
_ALERT_QUEUE = 10_000


def parse_endpoint(text: str, field: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"{field} {text!r} must look like HOST:PORT, e.g. 127.0.0.1:6881", param=field)
    return host.strip("[]"), int(port)


def peer_address(listen: str, port: int, advertised_host: str | None) -> str:
    """The ``HOST:PORT`` other hosts dial to fetch from a session listening on ``listen``.

    A session bound to one address is reached there. One bound to every interface
    (``0.0.0.0:6881``, ``[::]:6881``) is reached at the host the node advertises itself at
    (``advertised_host``: its ``--advertise-url``'s host, else its ``--host``); a wildcard there
    too leaves no address to give, which is an ``InvalidRequest`` saying what to pass.
    """
    host, _ = parse_endpoint(listen, "--listen")
    if is_wildcard(host) or not host:
        if advertised_host is None or is_wildcard(advertised_host) or not advertised_host:
            raise InvalidRequest(
                f"--listen {listen} takes BitTorrent peers on every interface, and {host or '*'} is not an address "
                "other hosts can dial; give --listen THIS-HOST'S-ADDRESS:PORT or the node's --advertise-url",
                param="listen",
            )
        host = advertised_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_DISK_QUEUE_BYTES = 16 << 20
_CACHE_BLOCKS = 256  # 16 KiB blocks: 4 MiB


def make_session(listen: str = "127.0.0.1:0", *, verbose_alerts: bool = True) -> Any:
    """A libtorrent session bound to ``listen`` (``HOST:PORT``; port 0 picks a free one)."""
    import libtorrent as lt

    parse_endpoint(listen, "--listen")
    category = lt.alert_category
    mask = category.error | category.status | category.storage if verbose_alerts else category.error
    return lt.session(
        {
            "listen_interfaces": listen,
            "outgoing_interfaces": "",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "enable_incoming_utp": False,
            "enable_outgoing_utp": False,
            "enable_incoming_tcp": True,
            "enable_outgoing_tcp": True,
            "alert_mask": int(mask),
            "alert_queue_size": _ALERT_QUEUE,
            # Several nodes of one test (or one host) share an IP; each is a distinct peer.
            "allow_multiple_connections_per_ip": True,
            "user_agent": "meshnet",
            # A node seeds while it serves, in the memory its weights and KV leave: libtorrent's
            # defaults hold up to 100 MiB of received blocks waiting for the disk and a 32 MiB
            # block cache (a fetched 1.5B tail kept ~30 MiB of heap for them after its fetch).
            "max_queued_disk_bytes": _DISK_QUEUE_BYTES,
            "cache_size": _CACHE_BLOCKS,
        }
    )


@dataclass(frozen=True, slots=True)
class TorrentFiles:
    """A parsed torrent: its ``torrent_info`` and, per file name, the file index and merkle root."""

    info: Any
    name: str
    info_hash_v2: str
    index: dict[str, int]  # file name (inside the torrent's folder) -> libtorrent file index
    roots: dict[str, str]
    sizes: dict[str, int]


def read_torrent(data: bytes) -> TorrentFiles:
    import libtorrent as lt

    try:
        info = lt.torrent_info(data)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"not a readable torrent file: {exc}", param="torrent") from None
    hashes = info.info_hashes()
    if not hashes.has_v2():
        raise InvalidRequest("the torrent is not BitTorrent v2", param="torrent")
    layout = info.layout()
    name = info.name()
    index: dict[str, int] = {}
    roots: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for i in range(layout.num_files()):
        if layout.file_flags(i) & lt.file_flags_t.flag_pad_file:
            continue
        path = layout.file_path(i)
        rel = path.removeprefix(name + "/")
        index[rel] = i
        roots[rel] = str(layout.root(i))
        sizes[rel] = int(layout.file_size(i))
    return TorrentFiles(info, name, str(hashes.v2), index, roots, sizes)


def create_torrent(root: Path, name: str, *, piece_length: int, web_seeds: tuple[str, ...] = ()) -> bytes:
    """A v2-only torrent over every file in ``root / name`` (files are hashed from disk)."""
    import libtorrent as lt

    files = lt.list_files(str(root / name))
    creator = lt.create_torrent(files, piece_length, lt.create_torrent.v2_only)
    creator.set_creator("meshnet")
    creator.set_creation_date(0)  # reproducible: publishing the same files twice gives the same bytes
    for url in web_seeds:
        creator.add_url_seed(url)
    lt.set_piece_hashes(creator, str(root))
    data: bytes = lt.bencode(creator.generate())
    return data


def magnet_of(info: Any) -> str:
    import libtorrent as lt

    link: str = lt.make_magnet_uri(info)
    return link
