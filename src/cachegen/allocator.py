"""Let the C allocator keep freed memory for the next KV cache instead of returning it to the OS.

Why: a load writes a freshly allocated cache (:meth:`cachegen.kv.KVCache.allocate`), one tensor
of a few MB per layer and K/V. glibc serves blocks that big with ``mmap`` and unmaps them when
they are freed, so every load touches new pages, and the kernel's zero-filling of them cost
more than decoding the chunks: sixteen 8-bit chunks of a 4K SmolLM2 context decode into a cache
already touched in 33 ms and into a fresh one in 78-88 ms (``tools/profile_raw_decode.py``,
quoted in the README). With blocks of up
to 32 MB taken from the heap and the heap's top never trimmed, the next cache reuses the pages
of the last. The process's resident memory then stays at its peak between requests, as with
jemalloc or tcmalloc: what a server wants, not what every library user wants, so the CLI's
commands (``serve``, ``demo``, ``bench``) call :func:`keep_freed_memory` and an embedding
application may. ``CACHEGEN_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: never trim less than 2 GiB off the heap's top
ENV = "CACHEGEN_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Tune glibc's ``malloc`` as the module docstring says; True when it took effect (False on
    another platform or C library, or when ``CACHEGEN_KEEP_FREED_MEMORY=0``)."""
    if os.environ.get(ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; musl has none
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("malloc keeps freed memory: %s", ok)
    return ok
