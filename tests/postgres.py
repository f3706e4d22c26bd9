"""A real PostgreSQL server for the tracker's tests: a throwaway cluster on a loopback port.

``MESHNET_TEST_POSTGRES_URL`` points the tests at a server you run yourself. Otherwise Debian's
``postgresql`` binaries start a fresh cluster (as the ``postgres`` user when running as root:
the server refuses root). Without either the PostgreSQL tests skip — unless
``MESHNET_REQUIRE_POSTGRES=1`` (CI sets it), where a missing server is a failure.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["postgres_server"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _unavailable(reason: str) -> None:
    if os.environ.get("MESHNET_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"PostgreSQL is required here (MESHNET_REQUIRE_POSTGRES=1) but {reason}")
    pytest.skip(f"no PostgreSQL server: {reason}")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yield a SQLAlchemy URL of an empty database; the cluster is removed afterwards."""
    given = os.environ.get("MESHNET_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    bindir = _bin_dir()
    if bindir is None:
        _unavailable("initdb was not found (install Debian's postgresql package)")
        return
    as_root = os.geteuid() == 0
    run_as = ["runuser", "-u", "postgres", "--"] if as_root else []
    root = Path(tempfile.mkdtemp(prefix="meshnet-pg-"))
    data, log = root / "data", root / "server.log"
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    port = _free_port()

    def run(*args: str, timeout: float = 60) -> None:
        subprocess.run([*run_as, *args], check=True, capture_output=True, timeout=timeout)

    def stop() -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "-t", "30", "stop")
        shutil.rmtree(root, ignore_errors=True)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(log), "-w", "-t", "30", "start")
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "meshnet_test")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        stop()
        detail = getattr(exc, "stderr", b"") or b""
        _unavailable(f"starting a cluster failed: {exc} {detail.decode(errors='replace')[-500:]}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/meshnet_test"
    finally:
        stop()
