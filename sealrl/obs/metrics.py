"""Per-iteration metrics: `metrics.jsonl` always (one line per iteration, namespaced keys), plus
the sinks named in `run.loggers`: TensorBoard, Weights & Biases, MLflow. Keys are defined once
in docs/metrics.md.

Every sink writes inside the run folder and needs no network by default: W&B runs offline
(`wandb/`) unless WANDB_MODE says otherwise; MLflow writes a file store (`mlruns/`) unless
MLFLOW_TRACKING_URI names another. Each sink imports its package when it is built, so a run
without it never loads it; a sink asked for but not installed is a one-line error naming the
pip extra."""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

from sealrl.config import UserError


class MetricsLogger:
    def __init__(self, run_dir: Path, loggers: str = "tensorboard"):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        names = [x.strip() for x in loggers.split(",") if x.strip()]
        unknown = [n for n in names if n not in SINKS]
        if unknown:
            raise ValueError(f"run.loggers: unknown logger {unknown[0]!r}; expected a comma list of "
                             f"{' | '.join(SINKS)}")
        self._sinks = []
        try:
            for name in dict.fromkeys(names):
                self._sinks.append(SINKS[name](run_dir))
        except BaseException:
            self.close()  # a sink that cannot start must not leave the others' files open
            raise

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        row = {"iteration": iteration, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        scalars = {k: float(v) for k, v in metrics.items() if _is_number(v)}  # NaN stays NaN here
        for sink in self._sinks:
            sink.log(iteration, scalars)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported here: heavy and optional
        self._w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, iteration: int, scalars: dict[str, float]) -> None:
        for k, v in sorted(scalars.items()):
            self._w.add_scalar(k, v, iteration)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """One W&B run per training process, named after the run folder; offline by default so that
    a run on a machine without network (or without an API key) never blocks. Upload later with
    `wandb sync runs/<name>/wandb/offline-run-*`."""

    def __init__(self, run_dir: Path):
        wandb = _require("wandb", "wandb")
        self._wandb = wandb
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "sealrl"), name=run_dir.name, dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"), config=_run_config(run_dir),
            # console capture would wrap our stderr progress bar; system stats are not ours to log
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, iteration: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=iteration)

    def close(self) -> None:
        self._run.finish()
        # finish() returns before the W&B service process has written the run file (measured:
        # offline file still empty after finish); teardown waits for the service to drain.
        self._wandb.teardown()


class MlflowSink:
    """One MLflow run per training process in experiment "sealrl", file store at
    `runs/<name>/mlruns/` (browse with `mlflow ui --backend-store-uri runs/<name>/mlruns`).
    Uses a client, not the `mlflow.*` globals, so that it never changes a caller's active run."""

    def __init__(self, run_dir: Path):
        _require("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        # MLflow 3 refuses file stores unless opted in; a database store needs the full `mlflow`
        # package (SQLAlchemy, and a pyarrow<26 pin that conflicts with ours).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "sealrl")
        exp = self._client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
        self._run_id = self._client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(mlflow_key(k), str(v)[:500]) for k, v in _flatten(_run_config(run_dir)).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self._client.log_batch(self._run_id, params=params[i:i + 100])

    def log(self, iteration: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_key(k), v, now, iteration) for k, v in sorted(scalars.items())]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, `_ - . / :` and spaces in names: `eval/pass@k` -> `eval/pass_k`."""
    return re.sub(r"[^\w\-./: ]", "_", key)


class MissingPackageError(UserError, RuntimeError):
    """An optional package the config asks for is not installed; the message says what to install."""


def _require(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise MissingPackageError(f"run.loggers={module} needs the {module} package: "
                           f"pip install 'sealrl[{extra}]' ({e})") from None


def _run_config(run_dir: Path) -> dict:
    """The effective config written next to the metrics (empty when the folder has none yet)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _is_number(v) -> bool:
    return hasattr(v, "__float__") and not isinstance(v, (bool, str))


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
