"""jobkit/memory.py: freed heap memory goes back to the OS (glibc), so a long run's RSS is what a job holds."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from jobkit.memory import _malloc_trim, release_free_memory


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(_malloc_trim() is None, reason="no glibc malloc_trim on this platform")
def test_memory_freed_in_the_middle_of_the_heap_is_returned():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(1600):  # 64 KiB each (below glibc's mmap threshold: from the heap), 100 MiB in all, touched
        p = libc.malloc(64 * 1024)
        ctypes.memset(p, 1, 64 * 1024)
        blocks.append(p)
    keep = blocks[-1]  # held: the freed ones lie below it, where glibc's own trimming of the heap's top never reaches
    for p in blocks[:-1]:
        libc.free(p)
    before = rss_mib()
    assert release_free_memory() is True
    after = rss_mib()
    libc.free(keep)
    assert before - after > 50, (before, after)  # most of the 100 MiB freed went back
