"""A private swarm of real processes for integration tests: ``meshnet swarm init``, a tracker with
``--swarm``, nodes and a gateway joined by invites, all on loopback with mutual TLS; every process
is stopped when the context ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.procs import Proc, join, member_client, meshnet_cli, meshnet_process

NODE_ARGS = ["--threads", "1", "--ctx", "256", "--max-sessions", "4", "--max-sessions-per-client", "2"]
NODE_ARGS += ["--max-body-mb", "8"]
HALVES = (("head", "0:15"), ("tail", "15:30"))


def node_urls(tracker: str, admin: Path) -> dict[str, str]:
    with member_client(admin) as client:
        return {n["node_id"]: n["url"] for n in client.get(f"{tracker}/v1/nodes").json()["nodes"]}


def wait_nodes(tracker: str, admin: Path, want: set[str], *, timeout_s: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = node_urls(tracker, admin)
        if set(nodes) >= want:
            return nodes
        time.sleep(0.3)
    raise TimeoutError(f"nodes {want} did not register with {tracker}")


@dataclass
class PrivateSwarm:
    root: Path
    tracker: Proc
    nodes: dict[str, str]
    gateway: Proc | None
    procs: list[Proc] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.root / "swarm"

    @property
    def admin(self) -> Path:
        return self.dir / "admin"

    def member(self, member_id: str) -> Path:
        """The credentials directory of a member joined with :meth:`join` or at start."""
        return self.root / member_id

    def join(self, role: str, member_id: str) -> Path:
        return join(self.dir, role, member_id, self.root / member_id)


def start_tracker(root: Path) -> contextlib.AbstractContextManager[Proc]:
    return meshnet_process(["tracker", "--swarm", str(root / "swarm"), "--port", "0", "--db", f"sqlite:///{root}/t.db"])


def start_node(
    root: Path, member_id: str, layers: str, tracker: str, args: Sequence[str] = NODE_ARGS
) -> contextlib.AbstractContextManager[Proc]:
    node = ["node", "--layers", layers, "--swarm-dir", str(root / member_id), "--tracker", tracker]
    return meshnet_process([*node, "--port", "0", *args])


@contextlib.contextmanager
def private_swarm(
    root: Path, nodes: Sequence[tuple[str, str]] = HALVES, *, gateway: bool = True, trusted: bool = False,
    node_args: Sequence[str] = NODE_ARGS, gateway_args: Sequence[str] = (),
) -> Iterator[PrivateSwarm]:  # fmt: skip
    """A tracker with ``--swarm``, ``nodes`` (member id, layers; of the trusted tier with ``trusted``)
    and, with ``gateway``, a gateway ``gw``."""
    assert meshnet_cli("swarm", "init", str(root / "swarm")).returncode == 0
    with contextlib.ExitStack() as stack:
        tracker = stack.enter_context(start_tracker(root))
        assert tracker.url.startswith("https://127.0.0.1:")
        for member_id, _ in nodes:
            join(root / "swarm", "node", member_id, root / member_id, trusted=trusted)
        procs = [stack.enter_context(start_node(root, mid, layers, tracker.url, node_args)) for mid, layers in nodes]
        urls = wait_nodes(tracker.url, root / "swarm" / "admin", {mid for mid, _ in nodes})
        gw = None
        if gateway:
            join(root / "swarm", "gateway", "gw", root / "gw")
            gw = stack.enter_context(
                meshnet_process(
                    ["gateway", "--swarm-dir", str(root / "gw"), "--tracker", tracker.url, "--port", "0", *gateway_args]
                )
            )
        yield PrivateSwarm(root, tracker, urls, gw, procs)
