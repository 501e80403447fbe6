"""Model FLOPs of a pass and the utilisation they make of the device: `perf/<pass>_tflops` and
`perf/<pass>_mfu` (docs/metrics.md).

Useful FLOPs are counted as the field does (Kaplan et al. 2020; PaLM's MFU): 2 x the weights of
the model's matrix multiplies x tokens for a forward, 3 x that for a forward and backward;
attention's own products and anything recomputed are not useful work, and the embedding lookup
is no multiply. The peak is not a datasheet number: it is this process's measured fp32 matmul rate
on the device (a square 1024 matmul, timed once per process), which is what the figures in
shared/MEASURED.md call the matmul limit, so an MFU of 0.5 means half of what this machine's
matmuls reach.
"""
from __future__ import annotations

import time

_PEAK: dict[str, float] = {}


def matmul_weights(model) -> int:
    """Weights of the model's matrix multiplies (every nn.Linear, the LM head included; a head
    tied to the embedding counts once, as the multiply it is)."""
    import torch
    seen, total = set(), 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and w is not None and id(w) not in seen:
            seen.add(id(w))
            total += w.numel()
    return total


def peak_tflops(device: str = "cpu") -> float:
    """fp32 matmul TFLOP/s of this device, measured once per process (~0.1 s on a CPU)."""
    if device not in _PEAK:
        import torch
        n = 1024
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        a @ b   # warm-up: thread pool, kernels
        reps, t = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t < 0.05:
            a @ b
            reps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        _PEAK[device] = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    return _PEAK[device]


def pass_metrics(name: str, flops: float, seconds: float, device: str = "cpu") -> dict[str, float]:
    """perf/<name>_tflops achieved and perf/<name>_mfu against the measured peak."""
    if seconds <= 0 or flops <= 0:
        return {}
    achieved = flops / seconds / 1e12
    return {f"perf/{name}_tflops": achieved, f"perf/{name}_mfu": achieved / peak_tflops(device)}
