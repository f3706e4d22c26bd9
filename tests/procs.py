"""Start and stop real Meshnet processes for tests: bounded waits, nothing left running."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

MESHNET = [sys.executable, "-m", "meshnet.cli.main"]
_LISTENING = re.compile(r"listening on (https?://\S+)")
SEEDING = re.compile(r"seeding (\d+) files on (\S+:\d+)")


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)


def _pump(stream: object, sink: queue.Queue[str | None], lines: list[str]) -> None:
    assert hasattr(stream, "readline")
    for line in iter(stream.readline, ""):
        lines.append(line)
        sink.put(line)
    sink.put(None)


def stop(popen: subprocess.Popen[str], timeout_s: float = 15.0) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGINT)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout_s)


@contextlib.contextmanager
def local_swarm(workdir: Path, *extra: str) -> Iterator[Proc]:
    """``meshnet up``: tracker + 3 llama.cpp nodes + gateway on a free port (``extra``: more flags)."""
    with meshnet_process(["up", "--port", "0", "--nodes", "3", "--workdir", str(workdir), *extra],
                         ready_timeout_s=300) as proc:  # fmt: skip
        yield proc


def tracker_url(swarm: Proc) -> str:
    """The tracker a ``meshnet up`` started, from the line it printed (to add a gateway beside its own)."""
    match = re.search(r"meshnet: tracker (https?://\S+?);", swarm.output())
    assert match, f"meshnet up printed no tracker URL:\n{swarm.output()}"
    return match.group(1)


def swarm_dir(swarm: Proc) -> Path:
    """The private swarm directory a ``meshnet up`` made (its CA, its admin's and members' credentials)."""
    match = re.search(r"private swarm (\S+) \(mutual TLS", swarm.output())
    assert match, f"meshnet up ran no private swarm:\n{swarm.output()}"
    return Path(match.group(1))


def member_client(credentials: Path, timeout_s: float = 30) -> httpx.Client:
    """An HTTP client holding the member credentials in ``credentials`` (a private swarm's TLS)."""
    from meshnet.security.tls import Credentials

    return httpx.Client(verify=Credentials.at(credentials).client_context(), timeout=timeout_s)


def admin_client(swarm: Proc, timeout_s: float = 30.0) -> httpx.Client:
    """An HTTP client holding the swarm admin's credential: what reads a private swarm's tracker and nodes."""
    return member_client(swarm_dir(swarm) / "admin", timeout_s)


# ``meshnet ARGS`` that prints its own peak RSS at its end: VmHWM of the process itself (``ru_maxrss``
# would carry the forking parent's peak across exec).
_PEAK_MAIN = "import sys; from meshnet.cli.main import main; rc = main(sys.argv[1:]); " + (
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
    "print('peak_rss_kib', hwm); sys.exit(rc)"
)


def meshnet_peak_rss(args: Sequence[str], *, timeout_s: float = 600) -> int:
    """Run ``meshnet ARGS`` to its end in a process of its own; its peak resident memory in bytes.
    A failed command is an ``AssertionError`` carrying its stderr."""
    done = subprocess.run([sys.executable, "-c", _PEAK_MAIN, *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.rsplit("peak_rss_kib", 1)[1].split()[0]) * 1024


def peak_rss(pid: int) -> int:
    """A running process's peak resident memory so far, in bytes (the kernel's high-water mark,
    VmHWM: a large buffer freed right after use still shows)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def up_nodes(swarm: Proc) -> dict[str, psutil.Process]:
    """The node processes of a ``meshnet up``, by the layer range each serves (``"START:STOP"``). Its
    nodes are placed by the tracker (``--layers auto``), so the ranges come from the tracker's node
    list, matched to a process by the port it listens on, not from the command line."""
    nodes = [c for c in psutil.Process(swarm.popen.pid).children(recursive=True) if " node " in " ".join(c.cmdline())]
    with admin_client(swarm) as admin:
        listed = admin.get(f"{tracker_url(swarm)}/v1/nodes").raise_for_status().json()["nodes"]
    by_port = {urllib.parse.urlsplit(n["url"]).port: str(n["layers"]) for n in listed}
    found = {}
    for node in nodes:
        ports = {c.laddr.port for c in node.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        if layers := next((by_port[p] for p in ports if p in by_port), None):
            found[layers] = node
    return found


def start_together(stack: contextlib.ExitStack, starting: Mapping[str, Any]) -> dict[str, Proc]:
    """Enter the processes' context managers (``meshnet_process``) at the same moment, each waiting
    for its own to listen; every one that started is stopped with ``stack``, also when another failed."""
    with concurrent.futures.ThreadPoolExecutor(len(starting)) as pool:
        futures = {k: pool.submit(cm.__enter__) for k, cm in starting.items()}
        concurrent.futures.wait(futures.values())
    started = {}
    for k, future in futures.items():
        if future.exception() is None:
            started[k] = future.result()
            stack.push(starting[k].__exit__)
    for future in futures.values():
        future.result()  # re-raises the first failure, after every started one is on the stack
    return started


def meshnet_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run one ``meshnet`` command to its end (bounded); its output and exit status."""
    return subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def join(swarm: Path, role: str, member_id: str, into: Path, *, trusted: bool = False) -> Path:
    """Invite ``member_id`` as ``role`` (of the trusted tier with ``trusted``) into the swarm at
    ``swarm`` and join it into ``into`` (its credentials directory)."""
    tier = ["--trusted"] if trusted else []
    invite = meshnet_cli("swarm", "invite", "--dir", str(swarm), "--role", role, "--id", member_id, *tier)
    assert invite.returncode == 0, invite.stderr
    joined = meshnet_cli("swarm", "join", invite.stdout.strip(), "--dir", str(into))
    assert joined.returncode == 0, joined.stderr
    return into


def join_member(swarm: Proc, role: str, member_id: str) -> Path:
    """Invite and join one more member of a ``meshnet up`` swarm (e.g. a second gateway); its credentials."""
    directory = swarm_dir(swarm)
    return join(directory, role, member_id, directory / "members" / member_id)


@contextlib.contextmanager
def meshnet_process(
    args: Sequence[str], *, ready_timeout_s: float = 180.0, prefix: Sequence[str] = (),
    command: Sequence[str] = MESHNET,
) -> Iterator[Proc]:  # fmt: skip
    """Run ``meshnet ARGS`` until it prints ``listening on URL``; always stop it afterwards.
    ``prefix`` runs it under a command that execs it, e.g. ``ip netns exec NS``; ``command`` runs
    another program than ``meshnet`` (tests.liar_node)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen(
        [*prefix, *command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines: list[str] = []
    sink: queue.Queue[str | None] = queue.Queue()
    pump = threading.Thread(target=_pump, args=(popen.stdout, sink, lines), daemon=True)
    pump.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        url = None
        while url is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"meshnet {' '.join(args)} not ready in {ready_timeout_s}s:\n{''.join(lines)}")
            try:
                line = sink.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                popen.wait(10)
                raise RuntimeError(f"meshnet exited with {popen.returncode}:\n{''.join(lines)}")
            if match := _LISTENING.search(line):
                url = match.group(1)
        yield Proc(popen, url, lines)
    finally:
        stop(popen)
        pump.join(10)
        assert popen.stdout is not None
        popen.stdout.close()


@contextlib.contextmanager
def seeder(
    args: Sequence[str], *, ready_timeout_s: float = 120, prefix: Sequence[str] = ()
) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """Run ``meshnet ARGS`` (``fetch ... --seed``) until it prints ``seeding N files on HOST:PORT``;
    yields (process, HOST:PORT, its output lines) and always stops it. ``prefix``: as for meshnet_process."""
    popen = subprocess.Popen([*prefix, *MESHNET, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    sink: queue.Queue[str | None] = queue.Queue()
    thread = threading.Thread(target=_pump, args=(popen.stdout, sink, lines), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            line = sink.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"meshnet {args} exited:\n{''.join(lines)}")
            if match := SEEDING.search(line):
                yield popen, match.group(2), lines
                return
    finally:
        stop(popen)
        thread.join(10)
        assert popen.stdout is not None
        popen.stdout.close()
