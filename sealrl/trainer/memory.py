"""Keep the memory a pass frees in malloc's heap, for the next pass to reuse.

Every iteration frees and then needs again about the same memory: an update's activations, the
reference forward's logit chunks, a weight sync's copies. With glibc's defaults much of it goes
back to the OS as it is freed: blocks of 32 MiB or more (a 1024-token chunk of a 49k-vocabulary
logits tensor is 200 MB) are mmapped and unmapped again at free(), and a free top of the heap
above the trim threshold is handed back. Every page the next pass touches again is then faulted
in and zeroed, about 1 s per GB on the 2-core VM this was measured on: on SmolLM2-135M the fused
old-log-prob forward took 15.7 s against the reference forward's 5.6 s, and one iteration 46 s
against 32 s with the memory held (docs/benchmarks.md, "Session 8").

`hold_freed_memory()` tells malloc to allocate every block from the heap and never to trim its
top, so freed memory stays resident and is reused. The resident set stays near the run's peak
between passes. The peak may settle up to about one pass's allocations higher while the heap
finds its layout (a block cannot always reuse the hole of an equal one); measured, it stays
close (SmolLM2, 6 iterations: 9.66 GB held against 9.25-9.59 GB trimmed after every update and
sync). It changes no number. It is process-wide and stays in force after the run
(`run.hold_freed_memory=false` leaves malloc as it is in the driver's process); a no-op where
the C library has no mallopt (musl, macOS).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4   # glibc's mallopt parameters (malloc.h)
NEVER_TRIM = 2**31 - 1                  # mallopt takes an int: the largest trim threshold


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def hold_freed_memory() -> bool:
    """No mmapped blocks, no trimming of the heap's top (glibc's mallopt); False where the C
    library has no mallopt or refuses either setting."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    no_mmap = bool(mallopt(M_MMAP_MAX, 0))
    no_trim = bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))   # set even when the first was refused
    return no_mmap and no_trim
