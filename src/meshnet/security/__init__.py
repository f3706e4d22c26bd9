"""Private swarms: who may join a swarm, and how its members know each other.

A private swarm is a certificate authority (``identity.SwarmCA``). Its members (nodes, gateways,
trackers, admins) each hold a certificate it issued that names their swarm, role and trust, so
membership is checked where it matters, in each TLS handshake, rather than by asking a server.
New members join with a single-use invite the CA signed (``invites``), and talk mutual TLS with
contexts that trust the swarm CA alone (``tls``).

Nothing here holds state beyond files and the invite ledger the tracker keeps; the CLI, the
tracker, the nodes and the gateway build on these pieces.
"""

from __future__ import annotations

from meshnet.security.identity import (
    ROLES,
    Member,
    MemberRequest,
    SwarmCA,
    fingerprint,
    make_csr,
    member_of,
    new_member_key,
)
from meshnet.security.invites import Invite, InviteLedger, admit, mint_invite, peek_invite, read_invite
from meshnet.security.tls import Credentials, client_context, peer_member, save_member, server_context

__all__ = [
    "ROLES",
    "Credentials",
    "Invite",
    "InviteLedger",
    "Member",
    "MemberRequest",
    "SwarmCA",
    "admit",
    "client_context",
    "fingerprint",
    "make_csr",
    "member_of",
    "mint_invite",
    "new_member_key",
    "peek_invite",
    "peer_member",
    "read_invite",
    "save_member",
    "server_context",
]
