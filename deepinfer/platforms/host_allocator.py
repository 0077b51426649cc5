"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

A CPU step allocates and frees the same buffers every time: the compiled regions' intermediates, the
logits ([rows, vocabulary] fp32: 16.5 MB at 32 rows of the 129,280-token vocabulary), the expert
weights a decode step gathers. glibc serves a block above its mmap threshold with a fresh mapping and
unmaps it on free, and returns free memory at the top of the heap above its trim threshold; either
way the next step's buffer starts as untouched pages, and the kernel faults in and zeroes each 4 KiB
page on first write. Raising both thresholds keeps those pages in the process: blocks up to
MMAP_THRESHOLD come from the heap and up to TRIM_THRESHOLD of free heap stays mapped. Measured on the
tiny V4 (fp32, one thread, compiled decode, 32 rows; README "Compiled CPU decode step"): ~850 minor
page faults a step with glibc's defaults, under 50 with these thresholds; the decode step went from
37-40 to 35-37 ms and the 32 x 64-token prompt step from 311-331 to 283-300 ms (three rounds,
alternated). At one row nothing faulted either way.

Process-wide and glibc-only (musl and other C libraries are left alone); the cpu platform applies it
when a rank starts (platforms/cpu.py), DEEPINFER_CPU_KEEP_FREED_MEMORY=0 turns it off."""
import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Larger blocks (weights, the KV cache) still get their own mapping. glibc caps its own dynamic
# threshold at 32 MiB; setting it explicitly also stops the dynamic rule, so the trim threshold is set
# with it (at twice the mmap threshold, the ratio glibc's dynamic rule keeps).
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_applied = False


def glibc_version() -> str | None:
    """'2.36' etc. where this process runs on glibc, else None (the standard library's answer)."""
    lib, version = platform.libc_ver()
    return version if lib == "glibc" else None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). True when they are set."""
    global _applied
    if _applied:
        return True
    if glibc_version() is None:
        logger.info("host allocator: not glibc; freed memory handling left to the C library")
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("host allocator: mallopt refused the thresholds; freed memory handling unchanged")
        return False
    _applied = True
    logger.info("host allocator: glibc keeps freed blocks up to %d MiB and %d MiB of free heap for reuse",
                MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
