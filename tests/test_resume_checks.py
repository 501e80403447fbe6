"""What a resume checks, what the run leaves behind by default, and the reproducibility record:
periodic checkpoints without asking, the reference model and reward function checked like the
model and data, the resumable keys declared by the config itself, and the rollout backend and
installed packages recorded."""
import dataclasses
import importlib.metadata
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from sealrl.config import EMBEDDED_MODEL, RunConfig, build_config, resumable_keys
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.placement.dispatch import ReplicaVersionError
from sealrl.placement.rollout_pool import RolloutPool
from sealrl.placement.workers import LocalWorkerGroup
from sealrl.rewards.verifiers import ArithmeticExactMatch
from sealrl.roles.rollout import Rollout
from sealrl.rollout.engine import RolloutEngine
from sealrl.sync.manifest import build_manifest
from sealrl.trainer import setup
from sealrl.trainer.driver import train
from sealrl.trainer.resume import position
from sealrl.trainer.resume.checkpoint import CheckpointError, verify_checkpoint
from tests.harness import small_args

TINY = small_args("run.name=t", "run.threads=1", "run.loggers=", "data.num_train=16", "eval.num=2",
                  "data.prompts_per_iter=2", "rollout.n=2", "rollout.max_new_tokens=2", "actor.micro_batch_size=4",
                  "actor.lr=1e-4", "run.seed=0")


def test_a_run_without_checkpoint_keys_checkpoints_periodically(tmp_path):
    every = RunConfig().checkpoint_every
    assert every > 0
    cfg = build_config(None, TINY + [f"run.iterations={every + 1}", f"run.output_dir={tmp_path}"])
    train(cfg)
    root = tmp_path / "t" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{every}", f"step_{every + 1}"]
    for folder in root.glob("step_*"):
        verify_checkpoint(folder)   # committed: marker present, every checksum right
    assert (root / "latest").read_text() == f"step_{every + 1}"


def test_resumable_keys_are_the_ones_the_config_declares():
    cfg = build_config()
    declared = {(sec.name, f.name) for sec in dataclasses.fields(cfg)
                for f in dataclasses.fields(getattr(cfg, sec.name)) if f.metadata.get("resumable")}
    assert position.RESUMABLE_KEYS == resumable_keys() == declared
    assert {("run", "iterations"), ("run", "checkpoint_every"), ("run", "loggers"), ("eval", "num"),
            ("reward", "num_scorers"), ("run", "stage_timeout_s")} <= declared
    assert not {("actor", "lr"), ("run", "seed"), ("run", "threads"), ("rollout", "n")} & declared


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One iteration with a reference model, from a copy of the warm start (so it can change)."""
    root = tmp_path_factory.mktemp("base")
    model = root / "model"
    shutil.copytree(EMBEDDED_MODEL, model)
    args = TINY + [f"model.path={model}", "algorithm.kl_coef=0.05", "run.iterations=1"]
    train(build_config(None, args + [f"run.output_dir={root / 'out'}"]))
    return root, args


def _copy(base_run, tmp_path) -> list[str]:
    root, args = base_run
    shutil.copytree(root / "out", tmp_path / "out")
    return args + [f"run.output_dir={tmp_path / 'out'}", "run.resume=auto", "run.iterations=2"]


def test_resumable_change_is_accepted_and_others_refused(base_run, tmp_path):
    args = _copy(base_run, tmp_path)
    with pytest.raises(CheckpointError, match=r"rollout.temperature: 1.0 -> 0.5"):
        train(build_config(None, args + ["rollout.temperature=0.5"]))
    summary = train(build_config(None, args + ["eval.num=1", "run.loggers=tensorboard",
                                               "run.checkpoint_every=7"]))
    assert summary["iterations"] == 2 and summary["completed"]


def test_changed_reward_function_is_refused(base_run, tmp_path, monkeypatch):
    args = _copy(base_run, tmp_path)
    monkeypatch.setattr(setup, "build_reward_fn", lambda cfg: ArithmeticExactMatch(version="2", eos_text="<e>"))
    with pytest.raises(CheckpointError) as e:
        train(build_config(None, args))
    assert "reward_fn.version: '1' -> '2'" in str(e.value)
    assert "reward_fn.config.eos_text:" in str(e.value) and "-> '<e>'" in str(e.value)


def test_changed_reference_model_is_refused(base_run, tmp_path):
    args = _copy(base_run, tmp_path)
    model = Path(base_run[0]) / "model" / "model.safetensors"
    saved = model.read_bytes()
    try:   # the model folder was overwritten: same path, config and tokenizer, other weights
        weights = load_file(str(model))
        name = sorted(weights)[0]
        weights[name] = weights[name] + 1e-3
        save_file(weights, str(model), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=r"reference_version.weights_hash: '\w+' -> '\w+'"):
            train(build_config(None, args))
    finally:
        model.write_bytes(saved)


def test_rollout_backend_and_packages_are_recorded(base_run):
    run = base_run[0] / "out" / "t"
    table = pq.read_table(run / "experience" / "iter_000000.parquet").to_pydict()
    assert set(table["extra.rollout_backend"]) == {"LeanBackend"}
    assert set(table["extra.rollout_dtype"]) == {"float32"}
    packages = json.loads((run / "run.json").read_text())["packages"]
    for name in ("torch", "transformers", "safetensors", "pyarrow"):
        assert packages[name] == importlib.metadata.version(name)
    assert len(packages) == len({d.metadata["Name"] for d in importlib.metadata.distributions()
                                 if d.metadata["Name"]})


def test_a_replica_pool_reports_the_backend_its_replicas_agree_on():
    model, tok = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest = build_manifest(state, "run", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    pool = RolloutPool(LocalWorkerGroup("rollout", [Rollout(model, tok), Rollout(model, tok)]))
    pool.load(state, manifest)
    assert pool.backend == ("LeanBackend", "float32")
    hf = Rollout(model, tok)
    hf.engine = RolloutEngine(model, tok, prefer_lean=False)
    mixed = RolloutPool(LocalWorkerGroup("rollout", [Rollout(model, tok), hf]))
    mixed.load(state, manifest)
    with pytest.raises(ReplicaVersionError, match="different backends"):
        mixed.backend
