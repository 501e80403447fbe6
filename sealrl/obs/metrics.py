"""Per-iteration metrics: `metrics.jsonl` always (one line per iteration, namespaced keys),
TensorBoard when available. Keys are defined once in docs/metrics.md."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, loggers: str = "tensorboard"):
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        if "tensorboard" in loggers.split(","):
            from torch.utils.tensorboard import SummaryWriter  # imported here: heavy and optional
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        row = {"iteration": iteration, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    self._tb.add_scalar(k, v, iteration)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _clean(v):
    """JSON has no NaN/inf: write them as strings so they are visible, never dropped."""
    v = float(v) if hasattr(v, "__float__") and not isinstance(v, (int, bool)) else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, upto_iteration: int) -> None:
    """On resume, drop lines of iterations after the checkpoint (they will be redone)."""
    rows = [r for r in read_metrics(run_dir) if r["iteration"] < upto_iteration]
    path = Path(run_dir) / "metrics.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
