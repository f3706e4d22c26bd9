"""Several "hosts" on one machine: Linux network namespaces joined by veth links to one bridge.

``HostNetwork`` builds a hub namespace holding a bridge, one namespace per host (each with its own
address on one /24), and a veth from the root namespace into the bridge, so the test process can
reach every host too. Everything it made is named after one prefix and removed by ``close``,
whatever state the build reached. Needs root and iproute2's ``ip``; ``unavailable`` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the test as root, as CI does)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mhprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10, check=False)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _free_subnet() -> str:
    """A 10.77.N.0/24 that no route of the root namespace covers (N from this process's id)."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=10, check=True).stdout
    for step in range(250):
        prefix = f"10.77.{(os.getpid() + step) % 250 + 1}"
        if f"{prefix}." not in routes:
            return prefix
    raise RuntimeError("no free 10.77.N.0/24 subnet for the test network")


@dataclass
class HostNetwork:
    """Hosts named ``hosts``, host i at ``PREFIX.(i + 2)``; the root namespace at ``PREFIX.254``."""

    hosts: list[str]
    tag: str = field(default_factory=lambda: f"mh{os.getpid() % 100000}")
    prefix: str = ""
    addresses: dict[str, str] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    @property
    def root_link(self) -> str:
        return f"{self.tag}r"  # an interface name: at most 15 characters

    def exec_prefix(self, host: str) -> list[str]:
        """Run a command on ``host``: ``ip netns exec NS`` (which execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def build(self) -> HostNetwork:
        self.prefix = _free_subnet()
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            ns = self.namespace(host)
            address = f"{self.prefix}.{index + 2}"
            self._add_namespace(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{index}", "netns", self.hub)
            self._plug(f"v{index}")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self.addresses[host] = address
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "vroot", "netns", self.hub)
        self._made.append(f"link:{self.root_link}")
        self._plug("vroot")
        _ip("addr", "add", f"{self.prefix}.254/24", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        return self

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(f"netns:{ns}")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _plug(self, port: str) -> None:
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")

    def close(self) -> list[str]:
        """Remove every link and namespace made (newest first); the ones that would not go, with why."""
        failures: list[str] = []
        for item in reversed(self._made):
            kind, name = item.split(":", 1)
            args = ["link", "del", name] if kind == "link" else ["netns", "del", name]
            try:
                _ip(*args)
            except RuntimeError as exc:
                if kind == "netns" or "Cannot find device" not in str(exc):  # a veth goes with its peer's netns
                    failures.append(str(exc))
        self._made.clear()
        return failures

    def leftovers(self) -> list[str]:
        """Namespaces or root links of this network that still exist (for the teardown check)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True).stdout
        found = [line.split()[0] for line in names.splitlines() if line.startswith(f"{self.tag}-")]
        return found + [f"link {self.root_link}" for line in links.splitlines() if f" {self.root_link}@" in line]
