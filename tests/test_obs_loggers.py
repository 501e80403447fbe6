"""Metric sinks beyond metrics.jsonl: TensorBoard, W&B (offline) and MLflow (file store), each
writing inside the run folder with no network."""
import importlib.util
import json
import math
import sys

import pytest

from sealrl.obs.metrics import MetricsLogger, mlflow_key, read_metrics

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None
ROWS = [{"reward/mean": 0.25, "eval/pass@k": 0.5, "groups/committed": 4},
        {"reward/mean": 0.5, "kl/ref_kl": float("nan"), "groups/committed": 4},
        {"reward/mean": 0.75, "groups/committed": 3}]


def _log_rows(run_dir, loggers):
    (run_dir / "config.yaml").write_text("run:\n  name: r\n  seed: 7\nactor:\n  lr: 1.0e-05\n")
    logger = MetricsLogger(run_dir, loggers)
    for i, row in enumerate(ROWS):
        logger.log(i, row)
    logger.close()


@pytest.fixture
def offline_env(monkeypatch, tmp_path):
    """No API key, no server, and W&B's own caches inside tmp_path."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def test_jsonl_always_and_nan_visible(tmp_path):
    _log_rows(tmp_path, "")
    rows = read_metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["kl/ref_kl"] == "nan" and rows[2]["groups/committed"] == 3
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_writes_events(tmp_path):
    _log_rows(tmp_path, "tensorboard")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed: pip install 'sealrl[wandb]'")
def test_wandb_offline_writes_run_files(tmp_path, offline_env):
    _log_rows(tmp_path, "wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run inside the run folder"
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    # the run file is a log of protobuf records; history keys and the run name are stored as text
    for key in (b"reward/mean", b"eval/pass@k", b"groups/committed", b"actor"):
        assert key in data, key


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed: pip install 'sealrl[wandb]'")
def test_wandb_mode_from_environment_wins(tmp_path, offline_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _log_rows(tmp_path, "wandb")
    assert not list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed: pip install 'sealrl[mlflow]'")
def test_mlflow_file_store_has_the_metrics(tmp_path, offline_env):
    from mlflow.tracking import MlflowClient
    _log_rows(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("sealrl")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_k")] == [0.5]
    assert math.isnan(client.get_metric_history(run.info.run_id, "kl/ref_kl")[0].value)  # NaN kept, not dropped
    assert run.data.params["actor.lr"] == "1e-05" and run.data.params["run.seed"] == "7"


def test_mlflow_key_keeps_namespaces():
    assert mlflow_key("eval/pass@k") == "eval/pass_k"
    assert mlflow_key("actor/clip_frac_upper") == "actor/clip_frac_upper"


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_package_is_one_line_error_naming_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(RuntimeError, match=rf"pip install 'sealrl\[{name}\]'") as err:
        MetricsLogger(tmp_path, f"tensorboard,{name}")  # the TensorBoard sink is closed again
    assert "\n" not in str(err.value)


def test_unknown_logger_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="neptune"):
        MetricsLogger(tmp_path, "neptune")


def test_light_import():
    """Building a JSONL-only logger loads none of the optional packages."""
    import subprocess
    code = ("import sys, pathlib, tempfile; from sealrl.obs.metrics import MetricsLogger; "
            "MetricsLogger(pathlib.Path(tempfile.mkdtemp()), ''); "
            "print(json.dumps([m for m in ('wandb', 'mlflow', 'torch') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
