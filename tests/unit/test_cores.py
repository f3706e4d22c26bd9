"""The core lease (meshnet.cores): co-located processes compute one at a time; a dead holder frees it."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshnet.cores import CoreLease

HOLD = """
import sys, time
from pathlib import Path
from meshnet.cores import CoreLease
lease = CoreLease(Path(sys.argv[1]))
spans = []
for _ in range(int(sys.argv[2])):
    with lease:
        began = time.monotonic()
        time.sleep(float(sys.argv[3]))
        spans.append((began, time.monotonic()))
    time.sleep(0.01)
print(repr(spans), flush=True)
"""


def _holder(path: Path, times: int, hold_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(times), str(hold_s)], stdout=subprocess.PIPE, text=True
    )


def test_processes_sharing_a_lease_never_compute_at_the_same_time(tmp_path: Path) -> None:
    path = tmp_path / "cores.lock"
    procs = [_holder(path, 5, 0.05) for _ in range(3)]
    spans = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        spans += eval(out)
    spans.sort()
    assert len(spans) == 15
    for (_, end), (begin, _) in itertools.pairwise(spans):
        assert begin >= end, "two holders overlapped"


def test_a_holder_killed_with_sigkill_frees_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "cores.lock"
    holder = _holder(path, 1, 60.0)
    lease = CoreLease(path)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until the child holds it
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                time.sleep(0.05)
            except BlockingIOError:
                break
            finally:
                os.close(fd)
        else:
            pytest.fail("the child never took the lease")
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=10)
        began = time.monotonic()
        with lease:
            assert time.monotonic() - began < 5
        assert lease.taken == 1
    finally:
        holder.kill()
        holder.communicate(timeout=10)
        lease.close()


def test_a_lease_file_that_cannot_be_opened_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot open the core lease file"):
        CoreLease(tmp_path / "missing-dir" / "cores.lock")
