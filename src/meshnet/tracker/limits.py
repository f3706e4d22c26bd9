"""Per-member rate limits on the tracker's writes that a flood could turn into harm.

A private swarm's member can send as many requests as its connection carries. Three kinds are
cheap to send and costly to take: registrations (a heartbeat flood washed out a node's failures),
failure reports and repairs (each may lower a node's reliability or suspend it). Each member gets
one token bucket per kind (``Bucket``): ``burst`` requests at once, then ``per_s`` a second. A
request past it is 429 ``rate_limit_exceeded`` with ``Retry-After``; nothing it asked is done.

The limits are far above what an honest member sends: a node registers every 5 s (and once more
when its self-benchmark ends), a gateway reports a failure or asks a repair once per session whose
route broke. The admin (the operator's own tools) is not limited. An open swarm knows no members,
so nothing is limited there (docs/security.md, "Not built yet").

Pure bookkeeping over a clock the caller passes in; not thread-safe (the tracker's event loop only).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from meshnet.errors import RateLimited

__all__ = ["FAILURES", "LIMITS", "REGISTRATIONS", "REPAIRS", "Bucket", "Limit", "RateLimits"]

REGISTRATIONS = "registrations"
FAILURES = "failure reports"
REPAIRS = "repairs"
_MEMBERS_KEPT = 100_000  # buckets remembered; the least recently used go first (a full bucket again)


@dataclass(frozen=True, slots=True)
class Limit:
    burst: float  # requests at once
    per_s: float  # requests a second, sustained


LIMITS = {
    # 4 x a 5 s heartbeat, sustained, and 20 at once: a restart, a benchmark, a retry after a refusal.
    REGISTRATIONS: Limit(burst=20.0, per_s=1.0),
    # A node dying under a busy gateway breaks every session through it at once.
    FAILURES: Limit(burst=30.0, per_s=1.0),
    REPAIRS: Limit(burst=30.0, per_s=1.0),
}


@dataclass(slots=True)
class Bucket:
    """A token bucket: ``take`` spends one token if there is one; tokens refill at ``limit.per_s``."""

    limit: Limit
    tokens: float
    at: float  # when ``tokens`` was last brought up to date

    @classmethod
    def full(cls, limit: Limit, now: float) -> Bucket:
        return cls(limit, limit.burst, now)

    def take(self, now: float) -> float:
        """0 when a token was spent; else the seconds until one will be there (nothing spent)."""
        if now > self.at:
            self.tokens = min(self.limit.burst, self.tokens + (now - self.at) * self.limit.per_s)
            self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.limit.per_s


class RateLimits:
    """One ``Bucket`` per (member, kind)."""

    def __init__(self, limits: dict[str, Limit] | None = None) -> None:
        self.limits = dict(LIMITS if limits is None else limits)
        self._buckets: OrderedDict[tuple[str, str], Bucket] = OrderedDict()

    def check(self, member_id: str | None, kind: str, now: float) -> None:
        """Spend one of ``member_id``'s ``kind`` requests, or raise ``RateLimited`` saying when to retry.
        ``None`` (no member: an open swarm, or the admin) is not limited."""
        if member_id is None:
            return
        key = (member_id, kind)
        bucket = self._buckets.pop(key, None) or Bucket.full(self.limits[kind], now)
        self._buckets[key] = bucket
        while len(self._buckets) > _MEMBERS_KEPT:
            self._buckets.popitem(last=False)
        wait = bucket.take(now)
        if wait > 0:
            limit = bucket.limit
            raise RateLimited(
                f"member {member_id!r} sent more {kind} than this tracker takes from one member ({limit.burst:g} at "
                f"once, then {limit.per_s:g} a second); retry in {math.ceil(wait)} s",
                retry_after_s=max(1, math.ceil(wait)),
            )
