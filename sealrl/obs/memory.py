"""Peak memory of one stretch of this process (a stage): resident set on Linux, CUDA's allocator
when a GPU is in use.

The kernel keeps the process's peak resident set (VmHWM in /proc/self/status) and resets it to
the current one when "5" is written to /proc/self/clear_refs, so a stage's peak is read as: reset
at its start, VmHWM at its end. It is the whole process's peak over that stretch: stages that
overlap in time (the generation lane of an asynchronous run) share it, and roles in other
processes (Ray ranks and replicas, scorer processes) are not in it. Elsewhere than Linux nothing is
measured (None), never a made-up 0.
"""
from __future__ import annotations

import re

_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


def reset_peak() -> None:
    """Start a new peak: the resident set's (Linux) and CUDA's allocator's (when initialised)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()


def peak() -> dict[str, float]:
    """{"rss_gb": peak resident set since reset_peak, "cuda_gb": CUDA's peak allocated}, each only
    where it is measured."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            found = _HWM.search(f.read())
        if found:
            out["rss_gb"] = int(found.group(1)) * 1024 / 2 ** 30
    except OSError:
        pass
    cuda = _cuda()
    if cuda is not None:
        out["cuda_gb"] = cuda.max_memory_allocated() / 2 ** 30
    return out


def _cuda():
    import sys
    torch = sys.modules.get("torch")   # never imported here: only when the run already uses it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda
    return None
