"""End-to-end runs of the local driver on a tiny random model (seconds, CPU)."""
import json
import os

import pyarrow.parquet as pq
import pytest

from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.trainer.driver import train

pytestmark = pytest.mark.slow   # end-to-end runs of the driver (one on Ray)


def small_cfg(tmp_path, model_dir, *extra):
    return build_config(None, [
        f"model.path={model_dir}", f"run.output_dir={tmp_path}", "run.name=e2e", "run.iterations=2",
        "run.checkpoint_every=1", "data.num_train=64", "eval.num=16",
        "data.prompts_per_iter=4", "rollout.n=4", "rollout.max_new_tokens=4", "actor.micro_batch_size=8",
        *extra])


RAY = ["placement.backend=ray", "placement.rollout_replicas=2", "placement.num_cpus=2",
       "placement.cpus_per_replica=0.5", "placement.timeout_s=120"]


@pytest.mark.parametrize("placement", ["local", "ray"])
def test_run_folder_is_complete(tmp_path, tiny_model_dir, placement, request):
    if placement == "ray":
        pytest.importorskip("ray", reason="placement=ray needs ray: pip install 'sealrl[ray]'")
        request.getfixturevalue("shared_ray")
    summary = train(small_cfg(tmp_path, tiny_model_dir, *(RAY if placement == "ray" else [])))
    run = tmp_path / "e2e"
    for name in ("config.yaml", "run.json", "metrics.jsonl", "ledger.jsonl", "trace.json", "summary.json",
                 "model/config.json", "checkpoints/latest", "checkpoints/step_2/COMMITTED"):
        assert (run / name).exists(), name
    saved = json.loads((run / "summary.json").read_text())
    assert saved["iterations"] == 2 == summary["iterations"]
    for key in ("accuracy_before", "accuracy_after", "wall_s"):
        assert key in saved
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    assert lines[0]["groups/committed"] == 4 and lines[0]["groups/dropped"] == 0
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 8 and all(e["status"] == "committed" for e in ledger)
    # every trained response can be traced: version, contract, log-probs, reward, consuming step
    batch = read_iteration(run / "experience" / "iter_000001.parquet")
    assert len(batch) == 16 and len(set(batch.sample_ids)) == 16
    assert {s.policy_version for s in batch.samples} == {batch.provenance("old_log_probs")[1]}
    table = pq.read_table(run / "experience" / "iter_000001.parquet")
    consumed = [json.loads(x) for x in (run / "experience" / "consumed.jsonl").read_text().splitlines()]
    assert [(c["iteration"], c["consumed_step"]) for c in consumed] == [(0, 1), (1, 2)]
    assert consumed[1]["sampled_by"] == batch.samples[0].policy_version
    assert set(table.column("extra.old_log_prob_mode").to_pylist()) == {"recompute"}
    if placement == "ray":   # which replica served each trained sample, and with which version
        served = [json.loads(x) for x in (run / "served.jsonl").read_text().splitlines()]
        by_id = {sid: (row["version"], k) for row in served if row["iteration"] == 1
                 for sid, k in row["replica_of"].items()}
        assert all(by_id[s.sample_id][0] == s.policy_version for s in batch.samples)
        assert {by_id[s.sample_id][1] for s in batch.samples} == {0, 1}
        placed = json.loads((run / "placement.json").read_text())   # what ran where
        assert [(w["role"], w["worker"]) for w in placed["workers"]] == [("rollout", 0), ("rollout", 1)]
        assert all(w["host"] and w["node_id"] and w["sealrl"] == placed["driver"]["sealrl"] for w in placed["workers"])
    else:
        assert not (run / "served.jsonl").exists() and not (run / "placement.json").exists()
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    phases = [e["name"] for e in trace if e["ph"] == "i"]
    spans = {e["name"]: e["args"] for e in trace if e["ph"] == "X"}   # every stage names its worker
    here = f"pid {os.getpid()}"
    assert spans["generate"]["worker"] == ("2 Ray actors (rollout 0..1)" if placement == "ray" else here)
    assert spans["update"]["worker"] == f"pid {os.getpid()}" and spans["update"]["iteration"] in (0, 1)
    assert spans["reward"]["worker"] == f"pid {os.getpid()} (inline scorer)" and spans["generate"]["version"]
    assert phases[:7] == ["EXPORTING", "ROLLOUT_LOADING", "ROLLOUT_READY", "GENERATING",
                          "EXPERIENCE_SEALED", "UPDATING_FROM", "ACTOR_COMMITTED"]


def test_existing_run_is_not_overwritten(tmp_path, tiny_model_dir):
    import pytest

    from sealrl.config import ConfigError
    train(small_cfg(tmp_path, tiny_model_dir, "run.iterations=1"))
    with pytest.raises(ConfigError, match="already has checkpoints"):
        train(small_cfg(tmp_path, tiny_model_dir, "run.iterations=1"))


def test_a_run_folder_in_use_is_refused(tmp_path, tiny_model_dir):
    import pytest

    from sealrl.config import ConfigError
    from sealrl.trainer import setup
    cfg = small_cfg(tmp_path, tiny_model_dir, "run.iterations=1")
    held = setup.lock_run_dir(setup.open_run_dir(cfg))   # another process's run, as far as flock knows
    try:
        with pytest.raises(ConfigError, match="is in use by another process"):
            train(cfg)
    finally:
        held.close()
