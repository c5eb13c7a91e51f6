"""A process's own memory, as the process itself reads it (the soak's samples).

A soak (``load_test --soak``) asks whether memory keeps growing under load.
Each process reports its own numbers — a worker in its ``info()``, the
coordinator in its ``metrics()``, the Serve replica in ``/v1/saguaro/metrics``
— so nothing is guessed from outside from a pid that may belong to a
restarted actor by then.

Four readings tell allocator caching from a leak: the resident set (what
the OS charges the process) and its anonymous part (``rss_anon_bytes``: less
the file-backed pages — shared libraries, mapped files — that the kernel drops
and reads back as other processes need memory); glibc's own account of its heap (``mallinfo2``):
bytes handed out and not yet freed (``heap_in_use_bytes``: a native leak or
a growing native cache shows here — torch's CPU tensors and oneDNN's caches
are malloc'd) and bytes freed but kept in the arenas (``heap_free_bytes``:
caching and fragmentation grow this, and ``malloc_trim`` gives it back); and
the blocks Python's own allocator has handed out (``python_blocks``: small
Python objects live in pymalloc's mmapped arenas, which glibc does not
count — a Python-object leak shows here). On a libc without ``mallinfo2``
(musl, macOS) the heap fields are None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from functools import cache
from typing import Any

MEMORY_FIELDS = ("rss_bytes", "rss_anon_bytes", "heap_in_use_bytes", "heap_free_bytes", "python_blocks")  # what memory() reads, besides the pid
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33, struct mallinfo2: every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@cache
def _libc() -> Any:
    """glibc with ``mallinfo2``/``malloc_trim``, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil  # Ray's own dependency

        return int(psutil.Process().memory_info().rss)


def rss_anon_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon`` of
    ``/proc/self/status``, Linux 4.5+), or None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory() -> dict[str, Any]:
    """``pid``, ``rss_bytes`` and ``rss_anon_bytes``, glibc's heap:
    ``heap_in_use_bytes`` (allocated, small and mmapped chunks) and
    ``heap_free_bytes`` (freed, held by the arenas), and ``python_blocks``
    (pymalloc's blocks in use)."""
    out: dict[str, Any] = {"pid": os.getpid(), "rss_bytes": rss_bytes(), "rss_anon_bytes": rss_anon_bytes(), "heap_in_use_bytes": None, "heap_free_bytes": None}
    out["python_blocks"] = sys.getallocatedblocks()
    libc = _libc()
    if libc is not None:
        m = libc.mallinfo2()
        out["heap_in_use_bytes"] = int(m.uordblks + m.hblkhd)
        out["heap_free_bytes"] = int(m.fordblks)
    return out


def give_back() -> bool:
    """Free what only reference cycles still hold (a closed model's modules
    refer to each other), then :func:`trim`: what an engine or a test module
    that is done with its models calls."""
    gc.collect()
    return trim()


def trim() -> bool:
    """Give the arenas' free memory back to the OS (``malloc_trim(0)``); False
    when nothing was returned or the libc has no such call."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
