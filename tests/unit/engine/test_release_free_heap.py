"""The engine hands freed C heap back to the OS when it goes idle (glibc's malloc_trim): without
it, memory freed by steps of varied shapes stays resident and the engine's RSS creeps up."""

from __future__ import annotations

import ctypes
import platform

import pytest

from engine.async_engine import release_free_heap

CHUNK = 64 * 1024  # below glibc's mmap threshold: served from the heap, kept there when freed
COUNT = 3200  # 200 MiB


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_goes_back_to_the_os():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(CHUNK) for _ in range(COUNT)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, CHUNK)  # resident, not just reserved
    for block in blocks[:-1]:  # the last one pins the heap's top: no automatic trim
        libc.free(block)
    try:
        before = resident_bytes()
        release_free_heap()
        after = resident_bytes()
    finally:
        libc.free(blocks[-1])
    assert before - after > COUNT * CHUNK // 2, (before, after)
