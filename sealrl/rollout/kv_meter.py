"""What the native engine's KV cache takes: the bytes of KV tensors alive in this process at
their peak, and how full the reserved columns were (docs/metrics.md, `memory/rollout_kv_*`).

The lean backend (rollout/lean.py) keeps keys and values in one preallocated tensor per batch
of rows, T_max columns wide (prompt + rollout.max_new_tokens), filled from the left as decoding
goes; fan-out, compaction and continuous batching make new ones. Every KVCache reports its
tensor when made (`allocated`; the bytes come off when the tensor is freed) and every forward
through it (`forward`: the columns filled after it, out of those reserved). `take()` returns
what was seen since the last take and starts anew: the peak of the live bytes, and `use`, the
filled share of the reserved bytes summed over forwards (1.0: no column was reserved before
it was needed). The Hugging Face fallback backend (DynamicCache) grows as it goes and is not
metered: its takes are empty.

One meter per process (`METER`): generate calls in a process run one at a time (the pipeline's
lock, one call per replica), so a take after a generate call is that call's.
"""
from __future__ import annotations

import threading
import weakref

from torch import Tensor


class KVMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0            # bytes of KV tensors alive now
        self.peak = 0            # the most alive at once since the last take
        self.filled = 0.0        # filled bytes, summed over forwards since the last take
        self.reserved = 0.0      # reserved bytes, summed over the same forwards

    def allocated(self, kv: Tensor) -> None:
        """A new KV tensor: counted until it is freed."""
        n = kv.nbytes
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)
        weakref.finalize(kv, self._freed, n)

    def _freed(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def forward(self, kv: Tensor, length: int) -> None:
        """A forward wrote keys up to column `length` of the T_max reserved in `kv`."""
        with self._lock:
            self.filled += kv.nbytes * length / kv.shape[0]
            self.reserved += kv.nbytes

    def take(self) -> dict[str, float]:
        """{"kv_peak_gb", "kv_use"} since the last take ({} if no KV tensor was made or used)."""
        with self._lock:
            out = {} if not self.reserved else {"kv_peak_gb": self.peak / 2**30, "kv_use": self.filled / self.reserved}
            self.peak, self.filled, self.reserved = self.live, 0.0, 0.0
        return out


METER = KVMeter()
