"""Live progress on stderr: iterations, reward, accuracy, KL and seconds per iteration."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=start, desc="train", unit="it", file=sys.stderr,
                             dynamic_ncols=True, leave=True)

    def update(self, iteration: int, m: dict) -> None:
        if self._bar is None:
            return
        post = {"reward": f"{m.get('reward/mean', 0.0):.3f}", "acc": f"{m.get('reward/accuracy', 0.0):.3f}",
                "len": f"{m.get('rollout/response_len_mean', 0.0):.1f}"}
        if "eval/accuracy" in m:
            post["eval"] = f"{m['eval/accuracy']:.3f}"
        if "kl/ref_kl" in m:
            post["kl"] = f"{m['kl/ref_kl']:.4f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
