"""``meshnet swarm init|invite|join|revoke``: make a private swarm, invite members, join one.

``init`` makes the swarm's CA and an admin credential in a directory (the one the tracker then
serves with ``meshnet tracker --swarm DIR``). ``invite`` signs a single-use join token with that
CA and prints it (only the token on stdout, so ``TOKEN=$(meshnet swarm invite ...)`` works).
``join`` runs on the joining host: it makes the member's key there and asks the tracker for its
certificate (``security.join``). Both member-facing flags and the files are described in
docs/security.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from meshnet.errors import MeshnetError

__all__ = ["DEFAULT_SWARM_DIR", "TRACKER_INFO_FILE", "add_swarm_admin_commands", "parse_duration", "run_swarm"]

DEFAULT_SWARM_DIR = Path(".meshnet/swarm")
DEFAULT_MEMBER_DIR = Path(".meshnet/member")
TRACKER_INFO_FILE = "tracker.json"  # the tracker writes its URL here; invites name it by default
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """An argparse type: ``90``, ``90s``, ``30m``, ``24h``, ``7d``, ``2w`` as seconds (positive)."""
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration like 30m, 24h or 7d, got {text!r}")
    return seconds


def add_swarm_admin_commands(sub: Any) -> None:
    swarm = sub.add_parser("swarm", help="private swarms: make one, invite members, join one")
    actions = swarm.add_subparsers(dest="swarm_command", required=True, metavar="ACTION")

    init = actions.add_parser("init", help="create a swarm: its CA and an admin credential")
    init.add_argument(
        "dir", nargs="?", type=Path, default=DEFAULT_SWARM_DIR, help=f"where (default {DEFAULT_SWARM_DIR})"
    )
    init.add_argument("--name", default="meshnet", help="the swarm's name, for people (default meshnet)")

    invite = actions.add_parser("invite", help="mint a single-use join token and print it")
    invite.add_argument(
        "--dir", "--swarm", dest="dir", type=Path, default=DEFAULT_SWARM_DIR,
        help=f"the swarm directory (default {DEFAULT_SWARM_DIR})",
    )  # fmt: skip
    invite.add_argument("--role", required=True, choices=("node", "gateway"), help="what the member will be")
    invite.add_argument("--trusted", action="store_true", help="grant the trusted tier (default untrusted)")
    invite.add_argument(
        "--expires", type=parse_duration, default=86400.0, help="how long the invite is valid (default 24h)"
    )
    invite.add_argument("--id", help="pin the member id the invite admits (default: the joiner chooses)")
    invite.add_argument(
        "--tracker",
        help="the tracker URL the joiner asks, https://HOST:PORT (default: the URL the tracker serving this "
        f"swarm wrote to {TRACKER_INFO_FILE})",
    )

    join = actions.add_parser("join", help="join a swarm with an invite: a key made here, a certificate from it")
    join.add_argument("token", help="the invite (mninv1....)")
    join.add_argument(
        "--dir", type=Path, default=DEFAULT_MEMBER_DIR, help=f"where the credentials go (default {DEFAULT_MEMBER_DIR})"
    )
    join.add_argument("--id", help="this member's id, e.g. the node id (default: the id the invite pins)")
    join.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="a DNS name or IP address other hosts reach this member at (repeatable; loopback and this "
        "host's name are always included)",
    )
    join.add_argument("--tracker", help="the tracker URL (default: the one the invite names)")

    revoke = actions.add_parser("revoke", help="revoke a member's certificate (the tracker and nodes refuse it)")
    revoke.add_argument("id", help="the member id (as in the swarm directory's members.json)")
    revoke.add_argument(
        "--dir", "--swarm", dest="dir", type=Path, default=DEFAULT_SWARM_DIR,
        help=f"the swarm directory (default {DEFAULT_SWARM_DIR})",
    )  # fmt: skip


def run_swarm(args: argparse.Namespace) -> int:
    runner = {"init": _init, "invite": _invite, "join": _join, "revoke": _revoke}[args.swarm_command]
    try:
        return runner(args)
    except MeshnetError as exc:
        print(f"meshnet swarm {args.swarm_command}: {exc.message}", file=sys.stderr)
        return 1 if getattr(exc, "unreachable", False) else 2


def _init(args: argparse.Namespace) -> int:
    from meshnet.security.identity import SwarmCA
    from meshnet.security.join import default_sans
    from meshnet.security.membership import ADMIN_DIR, SwarmAuthority

    ca = SwarmCA.init(args.dir, name=args.name)
    admin = SwarmAuthority(ca).issue_own("admin", "admin", default_sans(), args.dir / ADMIN_DIR)
    print(f"meshnet: swarm {ca.swarm_id} ({ca.name}) created in {args.dir}")
    print(f"  CA certificate   {args.dir / 'ca.pem'} (fingerprint {ca.fingerprint})")
    print(f"  CA key           {args.dir / 'ca.key'} (keep it on the tracker's host only)")
    print(f"  admin credential {admin.directory} (member.pem, member.key, ca.pem)")
    print(f"  next: meshnet tracker --swarm {args.dir}; meshnet swarm invite --dir {args.dir} --role node")
    return 0


def _invite(args: argparse.Namespace) -> int:
    from meshnet.security.identity import SwarmCA
    from meshnet.security.invites import mint_invite

    ca = SwarmCA.load(args.dir)
    tracker = args.tracker or _tracker_url(args.dir)
    if tracker is None:
        print(
            f"meshnet swarm invite: no tracker URL: start `meshnet tracker --swarm {args.dir}` first (it writes "
            f"{args.dir / TRACKER_INFO_FILE}), or give --tracker https://HOST:PORT",
            file=sys.stderr,
        )
        return 2
    token = mint_invite(
        ca, role=args.role, trusted=args.trusted, expires_in_s=args.expires, member_id=args.id, tracker_url=tracker
    )
    who = f" as {args.id!r}" if args.id else ""
    print(f"meshnet: invite to swarm {ca.swarm_id} for one {args.role}{who} via {tracker}", file=sys.stderr)
    print(token, flush=True)
    return 0


def _join(args: argparse.Namespace) -> int:
    from meshnet.security.join import default_sans, join_swarm

    credentials = join_swarm(
        args.token, args.dir, member_id=args.id, sans=default_sans(args.san), tracker_url=args.tracker
    )
    member = credentials.member()
    print(
        f"meshnet: joined swarm {member.swarm_id} as {member.role} {member.member_id!r} "
        f"({'trusted' if member.trusted else 'untrusted'}, valid until {member.expires:%Y-%m-%d}); "
        f"credentials in {credentials.directory}"
    )
    flag = "node --swarm-dir" if member.role == "node" else f"{member.role} --swarm-dir"
    print(f"  next: meshnet {flag} {credentials.directory} ...")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from meshnet.security.revocation import REVOKED_FILE, revoke_member

    serial = revoke_member(args.dir, args.id)
    print(f"meshnet: revoked member {args.id!r} (certificate serial {serial}) in {args.dir / REVOKED_FILE}")
    print("  the tracker refuses it from its next request on; nodes from their next heartbeat")
    return 0


def _tracker_url(directory: Path) -> str | None:
    try:
        url = json.loads((directory / TRACKER_INFO_FILE).read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) else None
