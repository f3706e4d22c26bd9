"""The TLS flags of ``meshnet node``, ``meshnet tracker`` and ``meshnet gateway``.

A node or gateway runs as a swarm member with ``--swarm-dir DIR`` (what ``meshnet swarm join``
wrote) or ``--cert/--key/--ca``; a tracker runs a swarm with ``--swarm DIR`` (what ``meshnet swarm
init`` wrote). Without them a server speaks plain HTTP, which is refused on any address but
loopback unless ``--insecure`` says the network is trusted.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509

from meshnet.cli.serve import usage_error
from meshnet.errors import MeshnetError
from meshnet.httputil import is_loopback, is_wildcard

if TYPE_CHECKING:
    from meshnet.security.join import MemberTLS
    from meshnet.security.membership import SwarmAuthority

__all__ = [
    "TrackerTLS",
    "add_member_tls",
    "add_tracker_tls",
    "check_covers",
    "check_plain_bind",
    "member_tls_for",
    "tracker_tls_for",
]


def add_member_tls(parser: argparse.ArgumentParser, *, insecure: bool = True) -> None:
    group = parser.add_argument_group("private swarm (mutual TLS)")
    group.add_argument(
        "--swarm-dir", type=Path, help="this member's credentials (ca.pem, member.pem, member.key: meshnet swarm join)"
    )
    group.add_argument("--cert", type=Path, help="this member's certificate (with --key and --ca)")
    group.add_argument("--key", type=Path, help="this member's private key")
    group.add_argument("--ca", type=Path, help="the swarm's CA certificate")
    if insecure:
        group.add_argument(
            "--insecure",
            action="store_true",
            help="serve plain HTTP on a non-loopback address (only on a network whose every host you trust)",
        )


def add_tracker_tls(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("private swarm (mutual TLS)")
    group.add_argument("--swarm", type=Path, help="run this swarm (meshnet swarm init DIR): TLS, members only")
    group.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="with --swarm: a DNS name or IP address members reach the tracker at (repeatable; loopback, this "
        "host's name and --host are always included)",
    )
    group.add_argument(
        "--advertise-url",
        help="with --swarm: the URL members reach the tracker at, written for `meshnet swarm invite` "
        "(default https://HOST:PORT)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain HTTP on a non-loopback address (only on a network whose every host you trust)",
    )


def check_plain_bind(host: str, insecure: bool, who: str, how: str) -> None:
    """Plain HTTP only on loopback, unless ``--insecure``: exit 2 saying what to do instead."""
    if not is_loopback(host) and not insecure:
        usage_error(
            f"meshnet {who}: --host {host} would serve plain HTTP to the network, where anyone who can reach "
            f"the port can use it; {how}, or add --insecure if every host on this network is trusted"
        )


def member_tls_for(args: argparse.Namespace, who: str, role: str) -> MemberTLS | None:
    """The member TLS the flags name (exit 2 with the reason for a bad one), ``None`` without them."""
    from meshnet.security.join import MemberTLS

    files = (args.cert, args.key, args.ca)
    if args.swarm_dir is not None and any(files):
        usage_error(f"meshnet {who}: give --swarm-dir or --cert/--key/--ca, not both")
    if any(files) and not all(files):
        usage_error(f"meshnet {who}: --cert, --key and --ca go together")
    if args.swarm_dir is None and not any(files):
        return None
    try:
        tls = MemberTLS.from_directory(args.swarm_dir) if args.swarm_dir else MemberTLS.load(*files)
        tls.check_role(role, f"meshnet {who}")
    except MeshnetError as exc:
        usage_error(f"meshnet {who}: {exc.message}")
    return tls


def check_covers(tls: MemberTLS, host: str, who: str) -> None:
    """Peers check the host name they dial against the certificate: refuse to advertise one it lacks."""
    cert = x509.load_pem_x509_certificate(tls.cert_path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    names = {name.lower() for name in san.get_values_for_type(x509.DNSName)}
    addresses = set(san.get_values_for_type(x509.IPAddress))
    try:
        covered = ipaddress.ip_address(host) in addresses
    except ValueError:
        covered = host.lower() in names
    if not covered:
        listed = ", ".join(sorted(names | {str(a) for a in addresses})) or "none"
        usage_error(
            f"meshnet {who}: peers reach this member at {host}, which its certificate {tls.cert_path} does not "
            f"list (it lists {listed}); join again with --san {host}, or advertise one of those"
        )


@dataclass(frozen=True)
class TrackerTLS:
    authority: SwarmAuthority
    server: ssl.SSLContext
    client: ssl.SSLContext
    url: str


def tracker_tls_for(args: argparse.Namespace, host: str, port: int) -> TrackerTLS | None:
    """With ``--swarm``: the swarm, and the tracker's own credentials (issued afresh at each start,
    for its names), else ``None`` (exit 2 for a bad swarm directory or plain HTTP off loopback)."""
    if args.swarm is None:
        check_plain_bind(host, args.insecure, "tracker", "run a private swarm with --swarm DIR")
        return None
    from meshnet.cli.swarm_admin import TRACKER_INFO_FILE
    from meshnet.fsutil import write_atomic
    from meshnet.httputil import service_url
    from meshnet.security.join import default_sans
    from meshnet.security.membership import TRACKER_DIR, SwarmAuthority

    url = f"https://{host}:{port}"
    try:
        advertised = service_url(args.advertise_url) if args.advertise_url else None
    except ValueError as exc:
        usage_error(f"meshnet tracker: --advertise-url {exc}")
    if advertised is None and not is_wildcard(host):
        advertised = url
    names = [h for h in (host, _host_of(advertised)) if h and not is_wildcard(h)]
    try:
        authority = SwarmAuthority.load(args.swarm)
        credentials = authority.issue_own(
            "tracker", "tracker", default_sans([*names, *args.san]), args.swarm / TRACKER_DIR
        )
        tls = TrackerTLS(
            authority, credentials.server_context(require_client_cert=False), credentials.client_context(), url
        )
    except MeshnetError as exc:
        usage_error(f"meshnet tracker: --swarm {args.swarm}: {exc.message}")
    if advertised is not None:
        write_atomic(args.swarm / TRACKER_INFO_FILE, json.dumps({"url": advertised}).encode())
    return tls


def _host_of(url: str | None) -> str | None:
    if url is None:
        return None
    from urllib.parse import urlsplit

    return urlsplit(url).hostname
