"""glibc malloc settings for processes that move multi-megabyte messages every step.

By default glibc serves each allocation over its mmap threshold with a fresh mmap and
gives it back on free, and trims the heap top when a large block is freed: every step's
message buffers (gRPC's and ours) then come as new pages, and the first touch of each page
faults. On loopback that fault-and-zero cost is larger than the copy itself, so keeping freed
blocks in the heap, where the next step reuses warm pages, raises the throughput of a
multi-megabyte exchange.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tfps.malloc")

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for it on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def keep_large_buffers(one_arena: bool = False) -> bool:
    """Apply the settings to this process (glibc only); False where they cannot be set.

    With `one_arena`, every thread allocates from the main heap: each thread's own arena would
    keep the largest working set that thread ever had (nothing is trimmed), which costs a PS,
    whose request threads run one at a time under the GIL anyway, a few MiB for no speed."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): keep its defaults
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
            *([(M_ARENA_MAX, 1)] if one_arena else []),
        )
    )
    if not ok:
        log.warning("mallopt refused a setting; large buffers keep glibc's defaults")
    return ok
