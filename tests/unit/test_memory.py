"""meshnet.memory: a node caps its malloc arenas and keeps large blocks off its heaps."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Threads each malloc and keep a block (ctypes drops the GIL around the call, so they overlap),
# then malloc_info lists the heaps: one per arena in use.
_ARENAS = """
import ctypes, ctypes.util, sys, tempfile, threading
from meshnet.memory import limit_heap_arenas
if sys.argv[1] == "limit":
    assert limit_heap_arenas(1)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
kept, gate = [], threading.Barrier(6)
def work():
    gate.wait()
    kept.append(libc.malloc(1 << 16))
    gate.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as out:
    f = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    print(open(out.name).read().count("<heap nr="))
"""


def _heaps(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.split()[-1])


def test_threads_share_the_capped_arenas() -> None:
    assert _heaps("default") > 1  # glibc's default: a thread that finds the main arena busy gets its own
    assert _heaps("limit") == 1


# A large block freed raises glibc's mmap threshold to its size; blocks of that size then come from
# the heap (mallinfo2's ``arena``) instead of mappings of their own (``hblkhd``), and their freed room
# stays with the process. With the threshold fixed, they stay mapped.
_THRESHOLD = """
import ctypes, ctypes.util, sys
from meshnet.memory import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
libc.free(libc.malloc(4 << 20))
kept = [libc.malloc(1 << 20) for _ in range(8)]
info = libc.mallinfo2()
print(info.hblkhd >> 20)
"""


def _mapped_mib(mode: str) -> int:
    command = [sys.executable, "-c", _THRESHOLD, mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.split()[-1])


def test_large_blocks_stay_off_the_heap_with_the_threshold_fixed() -> None:
    assert _mapped_mib("default") == 0  # after a 4 MiB free, 1 MiB blocks come from the heap
    assert _mapped_mib("fixed") >= 8
