"""glibc's allocator settings for a worker process: keep freed memory for the next step.

A step allocates and frees the same temporaries every time (the sampler's copies of the logits:
6.3 MB each for 32 rows of a 49,152-token vocabulary in float32; prefill activations). glibc
serves such sizes from the heap only after its adaptive thresholds have grown past them, and
gives freed heap memory back to the kernel once the free top of the heap passes twice that
threshold, so every step pays page faults to touch its temporaries again. The thresholds are
fixed instead (blocks of up to 64 MiB from the heap, freed memory kept up to 512 MiB), which made
sampled steps markedly cheaper (docs/worker-backends.md); greedy steps and the forward pass showed
no difference. The weights and the KV pool, larger than 64 MiB, are still mapped on their own.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
HEAP_UP_TO_BYTES = 64 << 20  # allocations below this come from the heap, reused once freed
KEEP_FREED_BYTES = 512 << 20  # freed heap memory kept for reuse, up to this much


def keep_freed_memory() -> bool:
    """Fix glibc's thresholds as the module doc says; False where this is not glibc on Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt thresholds)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = mallopt(M_MMAP_THRESHOLD, HEAP_UP_TO_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1
    if not done:
        log.warning("could not set glibc's allocator thresholds; steps may pay page faults for their temporaries")
    return done
