"""A Ray cluster as its users describe it (issue 27): the placement keys (strategy, CPUs per
rank, GPUs per replica, custom resources per replica and per rank) are checked at load and
reach the Ray pools; on Ray's multi-node test cluster on this machine (a head and two nodes,
each with its own CPUs and a custom resource), a run attached through RAY_ADDRESS alone puts
the ranks, the replicas and the reward scorers on the nodes their resources name, as
placement.json records (the scorers reading a relative reward file given on the driver and
gone by then), and a request no node can hold ends at start with one line naming it."""
from __future__ import annotations

import json

import pytest
import torch

from sealrl.config import ConfigError, build_config
from sealrl.experience.store import read_iteration
from sealrl.models import precision
from sealrl.trainer import setup

RAY = ["placement.backend=ray"]


@pytest.mark.parametrize("bad", ["rollout_node", "rollout_node=0", "=1", "rollout_node=x", "CPU=2"])
def test_custom_resources_are_checked_at_load_naming_the_key(bad):
    with pytest.raises(ConfigError, match="placement.replica_resources must be") as err:
        build_config(None, [*RAY, f"placement.replica_resources={bad}"])
    assert err.value.key == "placement.replica_resources"


def test_placement_keys_reach_the_pools():
    p = build_config(None, [*RAY, "placement.rollout_replicas=2", "placement.cpus_per_replica=2",
                            "placement.gpus_per_replica=0.5", "placement.replica_resources=rollout_node=1,ssd=0.5",
                            "placement.strategy=spread"]).placement
    spec = setup.rollout_pool_spec(p)
    assert (spec.num_workers, spec.num_cpus_per_worker, spec.num_gpus_per_worker) == (2, 2.0, 0.5)
    assert dict(spec.resources) == {"rollout_node": 1.0, "ssd": 0.5} and spec.strategy == "SPREAD"
    colocated = build_config(None, [*RAY, "placement.rollout_pool=colocated", "placement.rollout_replicas=2",
                                    "placement.actor_ranks=2", "placement.replica_resources=a=1",
                                    "placement.rank_resources=a=1,b=2"]).placement
    assert dict(setup.rollout_pool_spec(colocated).resources) == {"a": 2.0, "b": 2.0}   # the bundle holds both


def test_gpu_replicas_take_cuda_whatever_the_driver_sees(monkeypatch):
    """With placement.gpus_per_replica the replicas' bundles hold GPUs: rollout.device=cuda is
    resolved inside each replica, so a driver without a GPU (a CPU head node) accepts it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = build_config(None, [*RAY, "rollout.device=cuda", "placement.gpus_per_replica=1"])
    devices = precision.role_devices(cfg)
    assert devices["rollout"].type == "cuda" and devices["actor"].type == "cpu"
    assert setup.rollout_pool_spec(cfg.placement).num_gpus_per_worker == 1.0
    auto = build_config(None, [*RAY, "placement.gpus_per_replica=1"])
    assert precision.role_devices(auto)["rollout"].type == "cuda"   # auto: the replica's GPU


@pytest.mark.slow
def test_roles_land_on_the_nodes_their_resources_name(tmp_path, monkeypatch, capsys):
    ray = pytest.importorskip("ray", reason="placement=ray needs ray: pip install 'sealrl[ray]'")
    from ray.cluster_utils import Cluster

    from sealrl.placement import remote_reward
    from sealrl.placement.workers import PlacementError
    from sealrl.trainer.driver import train
    # the reward role goes with the ranks (rank_resources) and its scorers read a relative reward
    # file given on the driver, which is gone by the time the reward actor starts
    (tmp_path / "my_reward.py").write_text("def score(response, ground_truth):\n"
                                           "    return float(response.strip() == str(ground_truth))\n")
    monkeypatch.chdir(tmp_path)
    built = remote_reward.ray_reward

    def without_the_file(*a, **k):
        (tmp_path / "my_reward.py").unlink(missing_ok=True)
        return built(*a, **k)

    monkeypatch.setattr(remote_reward, "ray_reward", without_the_file)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=3, resources={"rank_node": 3})
        cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)   # as Ray Jobs and KubeRay attach
        args = [*RAY, "placement.num_cpus=2", "run.iterations=1", "data.num_train=32", "eval.num=4",
                "data.prompts_per_iter=2", "rollout.n=4", "rollout.max_new_tokens=4", "run.checkpoint_every=0",
                f"run.output_dir={tmp_path}", "placement.actor_ranks=2", "placement.dp_strategy=allreduce",
                "placement.rank_resources=rank_node=1", "placement.rollout_replicas=2",
                "placement.replica_resources=rollout_node=1", "placement.timeout_s=120",
                "placement.scorers=ray", "reward.num_scorers=1", "reward.fn=my_reward.py:score"]
        # three replicas' worth of rollout_node: no node has it, so no wait, one line naming it
        with pytest.raises(PlacementError, match=r"'rollout' \(rollout\): 3 x \{'CPU': 1.0, 'rollout_node': 1.0\}"
                                                 r".* cannot be placed; the cluster has CPU 6 in all, .* "
                                                 r"rollout_node 2 in all"):
            train(build_config(None, [*args, "run.name=toomany", "placement.rollout_replicas=3"]))
        train(build_config(None, [*args, "run.name=placed"]))
        assert f"attaching to the Ray cluster at RAY_ADDRESS={cluster.address}" in capsys.readouterr().err
        ray.init(address=cluster.address)   # the run shut its connection down
        node_of = {res: n["NodeID"] for n in ray.nodes() if n["Alive"] for res in ("rank_node", "rollout_node")
                   if res in n["Resources"]}
        record = json.loads((tmp_path / "placed" / "placement.json").read_text())
        where = {(w["role"], w["worker"]): w["node_id"] for w in record["workers"]}
        assert where == {("actor", 0): node_of["rank_node"], ("actor", 1): node_of["rank_node"],
                         ("rollout", 0): node_of["rollout_node"], ("rollout", 1): node_of["rollout_node"],
                         ("reward", 0): node_of["rank_node"]}
        assert not (tmp_path / "my_reward.py").exists()
        records = read_iteration(tmp_path / "placed" / "experience" / "iter_000000.parquet").get("reward_records")
        assert {r.status.value for r in records} == {"ok"}   # scored there from the file's text
        assert record["driver"]["node_id"] not in (node_of["rank_node"], node_of["rollout_node"])
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_a_rollout_node_lost_mid_run_is_replaced_on_a_spare_node(tmp_path):
    """The node that runs the replica is killed after iteration 1 (no graceful stop); a spare
    node has room. The replacement first lands on the dead node's bundle (Ray has not yet marked
    it dead) and dies; it is started again until Ray moves the bundle, then brought to the
    active version, and the run goes on: same weights as the run on one process, audited clean,
    and placement.json says where the replica runs now."""
    import threading
    import time

    ray = pytest.importorskip("ray", reason="placement=ray needs ray: pip install 'sealrl[ray]'")
    from ray.cluster_utils import Cluster

    from sealrl.audit import audit_run
    from sealrl.trainer.driver import train
    args = ["run.iterations=6", "data.num_train=32", "eval.num=4", "data.prompts_per_iter=2", "rollout.n=4",
            "rollout.max_new_tokens=4", "run.checkpoint_every=0", f"run.output_dir={tmp_path}"]
    local = train(build_config(None, [*args, "run.name=local"]))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": {
        "health_check_period_ms": 500, "health_check_failure_threshold": 4}})   # a dead node is noticed in ~2 s
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in range(2)]
        run_dir, killed = tmp_path / "ray", []

        def kill_the_replica_node():   # once iteration 1 is logged: the node the replica runs on
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not killed:
                metrics = run_dir / "metrics.jsonl"
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    where = json.loads((run_dir / "placement.json").read_text())["workers"][0]["node_id"]
                    node = next(n for n in nodes if n.node_id == where)
                    cluster.remove_node(node, allow_graceful=False)
                    killed.append(where)
                time.sleep(0.05)

        killer = threading.Thread(target=kill_the_replica_node, daemon=True)
        killer.start()
        summary = train(build_config(None, [*args, *RAY, f"placement.address={cluster.address}", "run.name=ray",
                                            "placement.replica_resources=rollout_node=1", "placement.timeout_s=60"]))
        killer.join()
        assert killed and summary["iterations"] == 6
        assert summary["weights_hash"] == local["weights_hash"]   # the loss changed no number
        assert audit_run(run_dir).ok
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert sum(r.get("rollout/replica_replacements", 0) for r in rows) >= 1
        now = json.loads((run_dir / "placement.json").read_text())["workers"][0]["node_id"]
        assert now != killed[0] and now in {n.node_id for n in nodes}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_a_lost_head_ends_the_run_in_one_line_and_resume_is_exact(tmp_path):
    """The head node (its GCS) is killed after iteration 1 of a CLI run attached to it: the run
    ends with status 2 and one line naming the head (in failures.jsonl too), within the grace
    rather than Ray's own 60 s abort; resumed without Ray, it ends with the weights of the run
    that never left this process, audited clean."""
    import os
    import subprocess
    import sys
    import time

    pytest.importorskip("ray", reason="placement=ray needs ray: pip install 'sealrl[ray]'")
    from ray.cluster_utils import Cluster

    from sealrl.audit import audit_run
    from sealrl.trainer.driver import train
    # one thread in every process (the driver here, the subprocess's driver, the replica): the
    # runs then compare bitwise on any CPU, whose kernels may split a reduction by thread count
    args = ["run.iterations=30", "data.num_train=32", "eval.num=4", "data.prompts_per_iter=2", "rollout.n=4",
            "rollout.max_new_tokens=4", "run.checkpoint_every=1", "run.threads=1", f"run.output_dir={tmp_path}"]
    local = train(build_config(None, [*args, "run.name=local"]))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    run_dir, address = tmp_path / "ray", cluster.address
    try:
        cluster.add_node(num_cpus=1)
        empty = tmp_path / "empty.yaml"
        empty.write_text("{}\n")
        proc = subprocess.Popen([sys.executable, "-m", "sealrl.cli", "train", str(empty), *args, *RAY,
                                 f"placement.address={address}", "placement.head_grace_s=3", "run.name=ray"],
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, RAY_ADDRESS=""))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        # the head's GCS: on one machine the driver's own raylet is the head's, whose loss would
        # end the driver at once; a driver on its own node keeps its raylet and loses the GCS
        cluster.head_node.kill_gcs_server(check_alive=False)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        try:
            cluster.shutdown()
        except Exception:  # noqa: BLE001 - the head is gone already
            pass
    assert proc.returncode == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"sealrl: error: the Ray head at {address} is lost"), err[-2000:]
    assert took < 30   # the 3 s grace and the probes, not Ray's 60 s
    failure = json.loads((run_dir / "failures.jsonl").read_text().splitlines()[-1])
    assert failure["role"] == "ray_head" and failure["message"] == last
    resumed = train(build_config(None, [*args, "run.name=ray", "run.resume=auto"]))   # placement.backend=local
    assert resumed["weights_hash"] == local["weights_hash"] and audit_run(run_dir).ok


def test_the_reference_off_the_driver_is_checked_at_load():
    from sealrl.config import check_config
    with pytest.raises(ConfigError, match="placement.reference must be driver unless placement.backend=ray"):
        build_config(None, ["placement.reference=ray"])
    # with LoRA the Ray actor holds its own copy of base and adapter, used with the adapter off
    check_config(build_config(None, [*RAY, "placement.reference=ray", "actor.lora.rank=4"]))
    check_config(build_config(None, [*RAY, "placement.reference=ray", "algorithm.kl_coef=0.05"]))


def test_the_scorers_off_the_driver_are_checked_at_load():
    from sealrl.config import check_config
    with pytest.raises(ConfigError, match="placement.scorers must be driver unless placement.backend=ray"):
        build_config(None, ["placement.scorers=ray"])
    with pytest.raises(ConfigError, match="placement.scorers must be driver or ray"):
        build_config(None, [*RAY, "placement.scorers=node"])
    with pytest.raises(ConfigError, match="reward.stream is not built for placement.scorers=ray"):
        check_config(build_config(None, [*RAY, "placement.scorers=ray", "reward.stream=true", "reward.num_scorers=1"]))
    check_config(build_config(None, [*RAY, "placement.scorers=ray", "reward.num_scorers=2"]))
