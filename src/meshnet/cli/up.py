"""``meshnet up``: a whole local swarm — tracker, N shard nodes, gateway — as child processes.

The bundled model's layers are split evenly between the nodes (by the tracker: the serving nodes
start with ``--layers auto --max-layers K``, K the equal split's largest range, which places equal
nodes on exactly that split; checked before they start, else they are placed by hand), the
machine's cores between their compute threads (llama.cpp threads spin; oversubscribed cores slow
decode by orders of magnitude).
``--core-lease`` instead gives each node every core and a machine-wide lease (``meshnet.cores``):
a node computes only while it holds it, so one computing alone uses the whole machine and two never
spin against each other — slower on a 2-core machine, where the other processes' Python work
keeps a core busy while a node computes (benchmarks/RESULTS.md, route). ``--spares K``
makes K of the nodes spares that hold every layer but the head's, so route repair can replace
any other node that dies. Ctrl-C (or the tracker or gateway dying) stops every process; nothing
is left behind. A node dying does not: the route repairs around it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from meshnet.cli.placement import auto_cap, wait_placed
from meshnet.cli.serve import api_keys_for
from meshnet.layers import LayerRange, split_layers
from meshnet.node.advert import host_hardware
from meshnet.node.context import DEFAULT_MEMORY_SHARE

__all__ = ["run_up", "swarm_layout"]

_READY_TIMEOUT_S = 300.0


def swarm_layout(total: int, nodes: int, spares: int, starts: Sequence[int] | None = None) -> list[LayerRange]:
    """The serving ranges (``nodes - spares`` of them, tiling the model), then the spares' range."""
    if not 0 <= spares < nodes:
        raise ValueError(f"--spares must be within 0..{nodes - 1} (some node must serve), got {spares}")
    ranges = split_layers(total, nodes - spares, starts)
    if not spares:
        return ranges
    if len(ranges) == 1:
        raise ValueError("a spare needs at least 2 serving nodes (it stands in for every node but the head)")
    return ranges + [LayerRange(ranges[0].stop, total, total)] * spares


class _Child:
    def __init__(self, name: str, args: Sequence[str], log: Path) -> None:
        self.name = name
        self.log_path = log
        self.log = log.open("w")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # our Ctrl-C handling decides when children stop
        )

    def url(self) -> str | None:
        for line in self.log_path.read_text().splitlines():
            if "listening on " in line:
                return line.split("listening on ", 1)[1].strip()
        return None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self.log.close()


def _wait_url(child: _Child, deadline: float) -> str:
    while time.monotonic() < deadline:
        url = child.url()
        if url:
            return url
        if child.popen.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.popen.returncode}):\n{child.log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"{child.name} did not start within {_READY_TIMEOUT_S:.0f}s; see {child.log_path}")


def _wait_nodes(
    tracker: str, want: int, children: list[_Child], deadline: float, tls: ssl.SSLContext | None = None
) -> list[dict[str, Any]]:
    while time.monotonic() < deadline:
        for child in children:
            if child.popen.poll() is not None:
                raise RuntimeError(f"{child.name} exited:\n{child.log_path.read_text()[-2000:]}")
        try:
            nodes = httpx.get(f"{tracker}/v1/nodes", timeout=5, verify=tls or True).json()["nodes"]
            if len(nodes) >= want:
                return list(nodes)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"nodes did not register with the tracker within {_READY_TIMEOUT_S:.0f}s")


def _layout(args: argparse.Namespace) -> tuple[Path, list[LayerRange], int | None] | None:
    """The GGUF, the nodes' layer ranges and the ``--max-layers`` that makes equal ``--layers auto``
    nodes end on them (``cli.placement.auto_cap``; None: placed by hand), or None (the reason
    printed) when they cannot be had."""
    from meshnet.artifacts.shard_file import range_starts
    from meshnet.backends.llama_vocab import LlamaVocab
    from meshnet.cli.serve import check_certified, resolve_gguf
    from meshnet.errors import MeshnetError

    if (args.speculative == "draft") != (args.draft_gguf is not None):
        print("meshnet up: --speculative draft and --draft-gguf PATH go together", file=sys.stderr)
        return None
    if args.draft_min > args.draft_tokens:
        print(
            f"meshnet up: --draft-min {args.draft_min} is more than --draft-tokens {args.draft_tokens}", file=sys.stderr
        )
        return None
    if not 0.0 <= args.audit_rate <= 1.0:
        print(f"meshnet up: --audit-rate is a fraction of sessions in [0, 1], got {args.audit_rate}", file=sys.stderr)
        return None
    if args.gpu_layers:  # every node would exit 2 with it: say it once, before any process starts
        from meshnet.backends.gpu import offload_error

        problem = offload_error(args.gpu_layers) if args.backend == "llama" else "--gpu-layers needs --backend llama"
        if problem is not None:
            print(f"meshnet up: {problem}", file=sys.stderr)
            return None
    gguf = resolve_gguf(args.gguf, "up")
    if not check_certified(gguf, "up", allow=args.allow_uncertified, backend=args.backend):
        return None
    try:
        vocab = LlamaVocab(gguf)
        total = vocab.info.n_layers
        vocab.close()
        starts = range_starts(gguf)
        ranges = swarm_layout(total, args.nodes, args.spares, starts)
        return gguf, ranges, auto_cap(ranges[: args.nodes - args.spares], starts)
    except MeshnetError as exc:
        print(f"meshnet up: {exc.message}", file=sys.stderr)
    except ValueError as exc:
        print(f"meshnet up: {exc}", file=sys.stderr)
    return None


def _placed(args: argparse.Namespace, i: int, layers: LayerRange, cap: int | None, wait: Any) -> tuple[list[str], str]:
    """Node ``i``'s placement flags and its label: a serving node asks the tracker (``--layers auto``)
    when ``cap`` makes that the equal split; spares (and every node without a cap) are placed by
    hand, spares only once the serving nodes hold their ranges (``wait``), so they cannot sway them."""
    spare = i >= args.nodes - args.spares
    if spare and cap is not None and i == args.nodes - args.spares:
        wait({f"node-{j}" for j in range(i)})
    placed = ["--layers", "auto", "--max-layers", str(cap)] if cap and not spare else ["--layers", str(layers)]
    return placed, f"{placed[1]}{' spare' if spare else ''}"


def _threads(args: argparse.Namespace, cores: int) -> tuple[bool, int]:
    """Whether the nodes share the cores through a lease, and each node's threads."""
    lease = bool(args.core_lease)
    return lease, args.threads or (cores if lease else max(1, cores // args.nodes))


def _gpu_layers(args: argparse.Namespace) -> str:
    """``--gpu-layers`` as each node gets it: every node offloads its own range's layers alike, auditors
    too (an auditor re-executes bit for bit only in the numerics class of the node it checks)."""
    from meshnet.backends.gpu import gpu_layers_flag

    return gpu_layers_flag(args.gpu_layers)


def _sharing(lease: bool, threads: int) -> str:
    how = "sharing the cores, one compute at a time" if lease else "the cores split between them"
    return f"{threads} thread{'s' if threads != 1 else ''} each, {how}"


def run_up(args: argparse.Namespace) -> int:
    api_keys_for(args, "up")  # the gateway's rules, checked before any process starts
    layout = _layout(args)
    if layout is None:
        return 2
    gguf, ranges, cap = layout
    cores = os.cpu_count() or 1
    lease, threads = _threads(args, cores)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="meshnet-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    children: list[_Child] = []
    deadline = time.monotonic() + _READY_TIMEOUT_S
    stop = False

    def on_signal(signum: int, _: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"meshnet: starting a local swarm of {args.nodes} {args.backend} nodes (logs in {workdir})", flush=True)
        swarm = _PrivateSwarm(workdir / "swarm") if args.tls else None
        tracker_args = ["tracker", "--port", "0", "--db", f"sqlite:///{workdir}/tracker.db"]
        tracker_args += ["--swarm", str(swarm.directory)] if swarm else []
        tracker = _Child("tracker", tracker_args, workdir / "tracker.log")
        children.append(tracker)
        tracker_url = _wait_url(tracker, deadline)
        for i, layers in enumerate(ranges):
            placed, label = _placed(
                args, i, layers, cap, lambda ids: wait_placed(tracker_url, ids, deadline, swarm and swarm.admin_tls())
            )
            node_args = [
                "node", "--gguf", str(gguf), *placed, "--port", "0", "--tracker", tracker_url,
                "--backend", args.backend, "--threads", str(threads), "--wire-dtype", args.wire_dtype,
                "--gpu-layers", _gpu_layers(args), "--node-id", f"node-{i}", *_context_args(args),
                "--max-sessions", str(args.max_sessions), "--decode-batch", str(args.decode_batch),
                # its own gateway is the swarm's one client: every slot is its (the default keeps one free)
                "--max-sessions-per-client", str(args.max_sessions),
                *(["--core-lease", str(workdir / "cores.lock")] if lease else []),
                *(["--allow-uncertified"] if args.allow_uncertified else []),
                *(swarm.member_args("node", f"node-{i}", tracker_url) if swarm else []),
            ]  # fmt: skip
            children.append(_Child(f"node-{i} ({label})", node_args, workdir / f"node-{i}.log"))
        print(
            f"meshnet: tracker {tracker_url}; loading {args.nodes} nodes ({_sharing(lease, threads)}) ...", flush=True
        )
        nodes = _wait_nodes(tracker_url, args.nodes, children[1:], deadline, swarm.admin_tls() if swarm else None)
        _start_auditors(args, gguf, children, nodes, threads=threads, lease=lease, workdir=workdir, swarm=swarm,
                        tracker_url=tracker_url, deadline=deadline)  # fmt: skip
        gateway = _gateway(args, gguf, tracker_url, lease=lease, workdir=workdir, swarm=swarm)
        children.append(gateway)
        gateway_url = _wait_url(gateway, deadline)
        _banner(gateway_url, tracker_url, nodes, swarm.directory if swarm else None)
        vital, reported = {tracker, gateway}, set()
        while not stop:
            for child in children:
                if child.popen.poll() is None or child in reported:
                    continue
                if child in vital:
                    print(f"meshnet: {child.name} exited unexpectedly; stopping the swarm. Its log:", file=sys.stderr)
                    print(child.log_path.read_text()[-2000:], file=sys.stderr)
                    return 1
                reported.add(child)
                print(
                    f"meshnet: {child.name} exited ({child.popen.returncode}); routes repair around it "
                    f"where another node covers its layers (log: {child.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"meshnet up: {exc}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            child.stop()
        print("meshnet: swarm stopped", flush=True)


def _gateway(
    args: argparse.Namespace, gguf: Path, tracker_url: str, *, lease: bool, workdir: Path, swarm: _PrivateSwarm | None
) -> _Child:
    """The swarm's gateway process."""
    gateway_args = [
        "gateway", "--gguf", str(gguf), "--tracker", tracker_url, "--port", str(args.port),
        "--host", args.host, *(["--ctx", str(args.ctx)] if args.ctx else []),
        "--max-concurrency", str(args.max_sessions),
        "--speculative", args.speculative, "--draft-tokens", str(args.draft_tokens), "--draft-min", str(args.draft_min),
        "--pipeline-rounds", str(args.pipeline_rounds),
        *(["--draft-gguf", str(args.draft_gguf)] if args.draft_gguf else []),
        *(["--core-lease", str(workdir / "cores.lock")] if lease and args.draft_gguf else []),
        "--decode-channel", args.decode_channel, "--relay", args.relay, "--audit-rate", str(args.audit_rate),
        *(["--chat-template-file", str(args.chat_template_file)] if args.chat_template_file else []),
        *(["--api-keys", str(args.api_keys)] if args.api_keys else []),
        *(["--no-auth"] if args.no_auth else []),
        *(arg for host in args.allowed_host for arg in ("--allowed-host", host)),
        *(swarm.member_args("gateway", "gateway", tracker_url) if swarm else []),
    ]  # fmt: skip
    return _Child("gateway", gateway_args, workdir / "gateway.log")


def _start_auditors(
    args: argparse.Namespace, gguf: Path, children: list[_Child], nodes: list[dict[str, Any]], *, threads: int,
    lease: bool, workdir: Path, swarm: _PrivateSwarm | None, tracker_url: str, deadline: float,
) -> None:  # fmt: skip
    """``--audit-rate``: one auditor node (trusted, never routed; node.audit) per layer range the
    routes use, added to ``children`` (so they are stopped with the rest) and waited for."""
    if args.audit_rate <= 0:
        return
    ranges = sorted({n["layers"] for n in nodes})
    print(f"meshnet: {len(ranges)} auditor node(s) for --audit-rate {args.audit_rate} ...", flush=True)
    for i, layers in enumerate(ranges):
        auditor_args = [
            "node", "--gguf", str(gguf), "--layers", layers, "--port", "0", "--tracker", tracker_url,
            "--backend", args.backend, "--threads", str(threads), "--node-id", f"auditor-{i}", "--auditor",
            "--gpu-layers", _gpu_layers(args),
            *_context_args(args), "--max-sessions", "1",
            *(["--core-lease", str(workdir / "cores.lock")] if lease else []),
            *(["--allow-uncertified"] if args.allow_uncertified else []),
            *(swarm.member_args("node", f"auditor-{i}", tracker_url) if swarm else []),
        ]  # fmt: skip
        children.append(_Child(f"auditor-{i} ({layers})", auditor_args, workdir / f"auditor-{i}.log"))
    _wait_nodes(tracker_url, len(nodes) + len(ranges), children[1:], deadline, swarm.admin_tls() if swarm else None)


class _PrivateSwarm:
    """``meshnet up`` (``--tls``, the default): a swarm CA under the workdir, each member joined with
    its own invite. A workdir used before keeps its swarm: the CA, and every member's credentials."""

    def __init__(self, directory: Path) -> None:
        from meshnet.security.identity import SwarmCA
        from meshnet.security.join import default_sans
        from meshnet.security.membership import ADMIN_DIR, SwarmAuthority
        from meshnet.security.tls import Credentials

        self.directory = directory
        existing = Credentials.at(directory / ADMIN_DIR).exists()
        self.ca = SwarmCA.load(directory) if existing else SwarmCA.init(directory, name="meshnet up")
        self.admin = SwarmAuthority(self.ca).issue_own("admin", "admin", default_sans(), directory / ADMIN_DIR)

    def member_args(self, role: str, member_id: str, tracker_url: str) -> list[str]:
        """Join ``member_id`` (its key made here, in its own directory), or reuse the credentials it
        joined with before, and name them."""
        from meshnet.errors import MeshnetError
        from meshnet.security.invites import mint_invite
        from meshnet.security.join import join_swarm
        from meshnet.security.tls import Credentials

        credentials = Credentials.at(self.directory / "members" / member_id)
        with contextlib.suppress(MeshnetError):
            if credentials.exists() and credentials.ticket_key() and credentials.member().role == role:
                return ["--swarm-dir", str(credentials.directory)]
        shutil.rmtree(credentials.directory, ignore_errors=True)  # unusable leftovers of an earlier run
        # the local swarm's nodes run on the operator's own machine: trusted
        token = mint_invite(
            self.ca, role=role, trusted=role == "node", member_id=member_id, tracker_url=tracker_url, expires_in_s=600
        )
        credentials = join_swarm(token, credentials.directory)
        return ["--swarm-dir", str(credentials.directory)]

    def admin_tls(self) -> ssl.SSLContext:
        return self.admin.client_context()


def _banner(gateway: str, tracker: str, nodes: list[dict[str, Any]], swarm: Path | None) -> None:
    lines = [
        "",
        "  Meshnet local swarm is up",
        f"  dashboard    {gateway}/         (layers, nodes, live generations, a chat box)",
        f"  OpenAI API   {gateway}/v1      (try: meshnet chat --url {gateway})",
        f"  swarm view   {gateway}/v1/swarm",
        f"  tracker      {tracker}",
    ]
    lines += [
        f"  {n['node_id']:<12} {n['url']:<28} layers {n['layers']}" for n in sorted(nodes, key=lambda n: n["node_id"])
    ]
    if swarm is not None:
        lines.append(f"  private swarm {swarm} (mutual TLS; admin credential {swarm / 'admin'})")
        lines.append(f"  add a member  meshnet swarm invite --dir {swarm} --role node|gateway")
    else:
        lines.append("  open swarm   plain HTTP (--no-tls): any process here can reach its tracker and nodes")
    lines += ["  Ctrl-C stops every process.", ""]
    print("\n".join(lines), flush=True)
    print(f"meshnet: listening on {gateway}", flush=True)


def _context_args(args: argparse.Namespace) -> list[str]:
    """A node's context flags: ``--ctx`` as given; without it each node takes the model's trained
    context, lowered to its share of the memory available now (the nodes of one machine share it)."""
    if args.ctx:
        return ["--ctx", str(args.ctx)]
    available = host_hardware().get("ram_available_bytes")
    if available is None:
        return []
    share = DEFAULT_MEMORY_SHARE * available / max(1, args.nodes) / 2**20
    return ["--kv-budget-mb", f"{share:.0f}"]
