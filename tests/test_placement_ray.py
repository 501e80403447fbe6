"""Worker groups: a Ray pool of 2 rollout replicas gives exactly the local rollout's samples
(colocated vs standalone: same experience), the two-phase weight sync refuses a corrupted or
missing tensor, on one replica or all, and activates nothing anywhere, failures and deadlines
name the role and the worker, a replica whose process dies mid-iteration (or that misses its
deadline) is replaced without changing the run, and a resumed Ray run re-syncs verified weights
before it generates. One Ray session for the module (start-up is about 3 s), 2 CPUs; no Ray process may outlive it."""
from __future__ import annotations

import functools
import json
import time

import pytest
import torch

from sealrl.experience import MissingResultsError, SamplingContract
from sealrl.experience.wire import GenerationRequest, VersionNotHeldError
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.placement.dispatch import generate_by_id
from sealrl.placement.workers import LocalWorkerGroup, WorkerError, pools_from_config
from sealrl.roles.rollout import Rollout
from sealrl.sync.manifest import WeightSyncError, build_manifest
from tests.harness import stop_local_ray


def sync_weights(group, state, manifest):
    """The two-phase sync of a replica group (RolloutPool.load: stage and verify everywhere,
    then activate everywhere)."""
    from sealrl.placement.rollout_pool import RolloutPool
    return RolloutPool(group).load(state, manifest)


CONTRACT = SamplingContract(temperature=1.0, max_new_tokens=6, n=3)
PROMPTS = ["07+45=", "12+30=", "99+1=", "3+4=", "50+50=", "8+18="]


def setup_objects():
    model, tok = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    hashes = tokenizer_hash(tok), model_config_hash(model.config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v0 = build_manifest(state, "run", 0, 0, *hashes)
    torch.manual_seed(1)
    state1 = {k: v + 0.02 * torch.randn_like(v) for k, v in state.items()}
    v1 = build_manifest(state1, "run", 1, 0, *hashes)
    requests = [GenerationRequest(f"run/0/p{i}", tuple(tok(p)["input_ids"]), seed=1000 + i, candidates=(0, 1, 2))
                for i, p in enumerate(PROMPTS)]
    return model, tok, (state, v0), (state1, v1), requests


@pytest.fixture(scope="module")
def objects():
    return setup_objects()


@pytest.fixture(scope="module")
def local_samples(objects):
    model, tok, (state, v0), _, requests = objects
    worker = Rollout(model, tok)
    worker.load(state, v0)
    return worker.generate(requests, CONTRACT, v0.version)


def assert_same_samples(got, want):
    assert [s.sample_id for s in got] == [s.sample_id for s in want]
    for a, b in zip(got, want):
        assert (a.response_ids, a.stop_reason, a.seed, a.policy_version) == \
               (b.response_ids, b.stop_reason, b.seed, b.policy_version), a.sample_id
        assert torch.allclose(torch.tensor(a.rollout_log_probs), torch.tensor(b.rollout_log_probs),
                              atol=1e-5, rtol=0), a.sample_id


# ---- in-process group (always runs) --------------------------------------------------------

def test_local_group_of_two_replicas_gives_the_single_replica_samples(objects, local_samples):
    model, tok, (state, v0), _, requests = objects
    group = LocalWorkerGroup("rollout", [Rollout(model, tok), Rollout(model, tok)])
    assert sync_weights(group, state, v0) == v0.version
    samples, metrics = generate_by_id(group, list(reversed(requests)), CONTRACT, v0.version)
    assert_same_samples(sorted(samples, key=lambda s: s.sample_id), sorted(local_samples, key=lambda s: s.sample_id))
    assert sorted(set(metrics["served_by"].values())) == [0, 1]      # both replicas served
    assert metrics["placement/rollout_accepted"] == 18.0 and metrics["placement/rollout_duplicate"] == 0.0


def test_local_group_failure_names_role_and_worker(objects):
    model, tok, (state, v0), (_, v1), requests = objects
    group = LocalWorkerGroup("rollout", [Rollout(model, tok)])
    sync_weights(group, state, v0)
    with pytest.raises(WorkerError, match="role rollout worker 0: generate: VersionNotHeldError") as e:
        generate_by_id(group, requests, CONTRACT, v1.version)
    assert isinstance(e.value.cause, VersionNotHeldError)


def test_a_replica_that_drops_a_sample_is_reported_by_id(objects):
    model, tok, (state, v0), _, requests = objects

    class Dropping(Rollout):
        def generate(self, reqs, contract, version):
            return super().generate(reqs, contract, version)[1:]

    group = LocalWorkerGroup("rollout", [Dropping(model, tok)])
    sync_weights(group, state, v0)
    with pytest.raises(MissingResultsError, match="run/0/p0/0"):
        generate_by_id(group, requests, CONTRACT, v0.version)


def test_a_pool_serving_mixed_versions_is_refused_by_name(objects):
    from sealrl.placement.dispatch import ReplicaVersionError
    from sealrl.placement.rollout_pool import RolloutPool
    model, tok, (state, v0), (state1, v1), requests = objects
    pool = RolloutPool(LocalWorkerGroup("rollout", [Rollout(model, tok), Rollout(model, tok)]))
    assert pool.load(state, v0) == v0.version == pool.version
    pool.group.workers[0].load(state1, v1)  # one replica moved on alone
    with pytest.raises(ReplicaVersionError, match="different versions"):
        pool.version
    with pytest.raises(WorkerError, match="role rollout worker 1: generate: VersionNotHeldError"):
        pool.generate(requests, CONTRACT, v1.version)


def test_samples_stamped_with_another_version_are_refused(objects):
    import dataclasses
    model, tok, (state, v0), (_, v1), requests = objects

    class Mislabelling(Rollout):
        def generate(self, reqs, contract, version):
            samples = super().generate(reqs, contract, version)
            return [dataclasses.replace(s, policy_version=v1.version) for s in samples]

    group = LocalWorkerGroup("rollout", [Mislabelling(model, tok)])
    sync_weights(group, state, v0)
    with pytest.raises(MissingResultsError, match="no result for 18 key"):
        generate_by_id(group, requests, CONTRACT, v0.version)


def test_pools_config_rejects_unknown_keys_and_a_role_in_two_pools():
    pools = pools_from_config({"train": {"roles": ["actor", "rollout"], "num_workers": 2},
                               "reward": {"roles": ["reward"]}})
    assert pools["rollout"].name == "train" and pools["reward"].num_workers == 1
    with pytest.raises(ValueError, match="unknown keys \\['num_cpu'\\]"):
        pools_from_config({"p": {"roles": ["actor"], "num_cpu": 1}})
    with pytest.raises(ValueError, match="role actor is in pools a and b"):
        pools_from_config({"a": {"roles": ["actor"]}, "b": {"roles": ["actor"]}})


# ---- Ray -----------------------------------------------------------------------------------

def _proc(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, command line) from /proc (Linux); None once the process is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], cmd


def _ray_processes() -> list[int]:
    """Pids of this process's descendants that belong to Ray (gcs_server, raylet, workers,
    agents); not e.g. multiprocessing's resource tracker, which other tests start and keep."""
    import os
    procs = {int(d): _proc(int(d)) for d in os.listdir("/proc") if d.isdigit()}
    procs = {pid: info for pid, info in procs.items() if info}
    mine, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, (ppid, _, _) in procs.items() if ppid in mine} - mine
        mine |= new
        grew = bool(new)
    return sorted(pid for pid in mine - {os.getpid()} if "ray" in procs[pid][2])


def _alive(pid: int) -> bool:
    info = _proc(pid)
    return info is not None and info[1] != "Z"


@pytest.fixture(scope="module")
def ray_pool(objects):
    """One local Ray (2 CPUs, no dashboard) and a standalone rollout pool of 2 replicas."""
    try:
        import ray
    except ImportError as e:  # only this skips: every other failure of a Ray test is a failure
        pytest.skip(f"ray cannot be imported ({e}); install it with pip install 'sealrl[ray]'")
    from sealrl.placement.workers import RayPool, RayWorkerGroup, init_ray
    model, tok = objects[0], objects[1]
    stop_local_ray()   # this module's own Ray: its processes are checked gone after it stops
    init_ray(num_cpus=2)
    try:
        # actor and rollout colocated: worker k of each on bundle k, half a CPU each
        pools = pools_from_config({"train": {"roles": ["actor", "rollout"], "num_workers": 2,
                                             "num_cpus_per_worker": 0.5}})  # 1 CPU left for config-built pools
        pool = RayPool(pools["rollout"])
        group = RayWorkerGroup("rollout", functools.partial(Rollout, model, tok), pool, timeout_s=120)
        group.pool = pool
        yield group
        group.close()
        pool.close()
    finally:
        procs = _ray_processes()  # gcs_server, raylet, workers: all started under this process
        ray.shutdown()
    assert procs, "expected Ray's processes under this one before shutdown"
    deadline = time.monotonic() + 60   # generous: a busy machine reaps slowly; gone processes end the wait
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(pid, (_proc(pid) or (0, "", ""))[2][:80]) for pid in procs if _alive(pid)]
    assert not left, f"Ray processes left after shutdown: {left}"


@pytest.mark.slow
def test_ray_rollout_pool_gives_the_local_experience(objects, local_samples, ray_pool):
    _, _, (state, v0), _, requests = objects
    assert sync_weights(ray_pool, state, v0) == v0.version
    samples, metrics = generate_by_id(ray_pool, requests, CONTRACT, v0.version)
    assert_same_samples(samples, local_samples)  # same ids, tokens, seeds, versions
    assert sorted(set(metrics["served_by"].values())) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_ray_weight_sync_refuses_a_bad_tensor_and_activates_nothing(objects, ray_pool, damage):
    _, _, (state, v0), (state1, v1), requests = objects
    sync_weights(ray_pool, state, v0)
    name = "model.layers.1.mlp.down_proj.weight"
    bad = dict(state1)
    if damage == "corrupt":
        bad[name] = state1[name].clone()
        bad[name][0, 0] += 1e-3
    else:
        del bad[name]
    with pytest.raises(WorkerError, match=f"role rollout worker [01]: stage: WeightSyncError.*{name}") as e:
        sync_weights(ray_pool, bad, v1)
    assert type(e.value.cause) is WeightSyncError and e.value.cause.tensor == name   # the real type crossed
    assert ray_pool.attr("version") == [v0.version, v0.version]   # nothing activated anywhere
    with pytest.raises(WorkerError, match="VersionNotHeldError"):
        generate_by_id(ray_pool, requests[:2], CONTRACT, v1.version)
    assert sync_weights(ray_pool, state1, v1) == v1.version        # the intact v1 loads
    assert ray_pool.attr("version") == [v1.version, v1.version]


@pytest.mark.slow
def test_ray_deadline_names_role_and_workers(objects, ray_pool):
    _, _, (state, v0), _, requests = objects
    sync_weights(ray_pool, state, v0)
    with pytest.raises(WorkerError, match="role rollout worker 0: generate: no result within 0.001s"):
        ray_pool.call("generate", requests, CONTRACT, v0.version, timeout_s=0.001)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model_dir):
    """The uninterrupted local run (2 iterations) every Ray run below must reproduce."""
    from sealrl.trainer.driver import train
    from tests.test_driver_e2e import small_cfg
    root = tmp_path_factory.mktemp("local")
    return train(small_cfg(root, tiny_model_dir)), root / "e2e"


def assert_same_run(run_dir, summary, local_run):
    """Same experience (ids, tokens, log-probs) in every iteration, every group committed
    once, and the same trained weights (the policy version names the weights' hash)."""
    from sealrl.experience.store import read_iteration
    local, local_dir = local_run
    for it in (0, 1):
        a = read_iteration(local_dir / "experience" / f"iter_{it:06d}.parquet")
        b = read_iteration(run_dir / "experience" / f"iter_{it:06d}.parquet")
        assert a.sample_ids == b.sample_ids and len(set(b.sample_ids)) == len(b.sample_ids) == 16
        assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
        assert torch.allclose(a.get("rollout_log_probs"), b.get("rollout_log_probs"), atol=1e-5, rtol=0)
    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 8 and all(e["status"] == "committed" for e in ledger)
    assert summary["policy_version"] == local["policy_version"]   # same weights hash after training
    assert summary["accuracy_after"] == local["accuracy_after"]


@pytest.mark.slow
def test_driver_with_a_ray_rollout_pool_gives_the_local_run(tmp_path, tiny_model_dir, ray_pool, local_run,
                                                             monkeypatch):
    """The unchanged driver loop, its rollout role swapped for a RolloutPool over the 2 Ray
    replicas (colocated with the actor's bundles): the same experience, the same weights."""
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.trainer import setup
    from sealrl.trainer.driver import train
    from tests.test_driver_e2e import small_cfg
    build_roles, pools = setup.build_roles, []

    def with_ray_rollout(cfg, run_id):
        roles = build_roles(cfg, run_id)
        roles.rollout = RolloutPool(ray_pool, timeout_s=120)
        pools.append(roles.rollout)
        return roles

    monkeypatch.setattr(setup, "build_roles", with_ray_rollout)
    remote = train(small_cfg(tmp_path / "ray", tiny_model_dir))
    assert pools and {e["version"] for e in pools[0].served} >= {local_run[0]["policy_version"]}
    assert set().union(*(e["replica_of"].values() for e in pools[0].served)) == {0, 1}
    assert pools[0].join_counts["placement/rollout_duplicate"] == 0.0
    assert_same_run(tmp_path / "ray" / "e2e", remote, local_run)


@pytest.mark.slow
def test_a_corrupted_or_interrupted_transfer_on_one_replica_activates_nothing_anywhere(objects, ray_pool, tmp_path):
    """Two drills on one pool of 2 replicas (each new Ray actor imports torch: seconds). v1's
    transfer is corrupted on one replica: its own verification refuses it, the verified
    replica does not switch either, and an intact transfer goes through. Then a replica dies
    while staging v2: it is replaced by a replica that loads the version the others still serve
    (verified), so the pool is never mixed, and the sync is tried again and goes through."""
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.placement.workers import RayWorkerGroup
    from tests.helpers_replicas import CorruptedThenDiesMidStage
    model, tok, (state, v0), (state1, v1), _ = objects
    noise = torch.Generator().manual_seed(2)
    state2 = {k: v + 0.02 * torch.randn(v.shape, generator=noise, dtype=v.dtype) for k, v in state1.items()}
    v2 = build_manifest(state2, "run", 2, 0, tokenizer_hash(tok), model_config_hash(model.config))
    name = "model.layers.0.self_attn.q_proj.weight"
    factory = functools.partial(CorruptedThenDiesMidStage, model, tok, str(tmp_path / "marker"), name, 1,
                                str(tmp_path / "died"), 2)
    pool = RolloutPool(RayWorkerGroup("rollout", factory, ray_pool.pool, timeout_s=120), timeout_s=120)
    try:
        assert pool.load(state, v0) == v0.version
        with pytest.raises(WorkerError, match=f"role rollout worker [01]: stage: WeightSyncError: .*{name}") as e:
            pool.load(state1, v1)
        assert type(e.value.cause) is WeightSyncError and e.value.cause.tensor == name
        assert pool.group.attr("version") == [v0.version] * 2       # the verified replica did not switch
        assert pool.group.attr("staged_version") == [None, None]    # and dropped its staged copy
        assert pool.load(state1, v1) == v1.version == pool.version   # an intact transfer goes through
        assert pool.load(state2, v2) == v2.version == pool.version   # a replica died staging it
        assert (tmp_path / "died").exists() and pool.group.restarts == 1
        replaced = [h for h in pool.history if h[0].startswith("replace")]
        assert replaced == [(replaced[0][0], v1.version.id)] and pool.history[-1] == ("load", v2.version.id)
        assert pool.group.attr("staged_version") == [None, None]
    finally:
        pool.close()


@pytest.mark.slow
def test_colocated_and_standalone_rollout_pools_give_identical_experience(objects, local_samples, ray_pool):
    """placement.rollout_pool from the config: replicas on their own bundles, or sharing the
    trainer's bundles; the same seeds give the same samples (and the local ones)."""
    from sealrl.config import build_config
    from sealrl.trainer import setup
    model, tok, (state, v0), _, requests = objects
    got = {}
    for kind, roles in (("standalone", ("rollout",)), ("colocated", ("actor", "rollout"))):
        cfg = build_config(None, ["placement.backend=ray", f"placement.rollout_pool={kind}",
                                  "placement.rollout_replicas=2", "placement.cpus_per_replica=0.5",
                                  "placement.timeout_s=120"])
        assert setup.rollout_pool_spec(cfg.placement).roles == roles
        closers: list = []
        try:
            pool = setup.ray_rollout_pool(cfg, model, tok, closers)
            assert pool.load(state, v0) == v0.version
            got[kind] = pool.generate(requests, CONTRACT, v0.version)
            assert set(pool.served[0]["replica_of"].values()) == {0, 1}
        finally:
            for close in reversed(closers):
                close()
    assert_same_samples(got["colocated"], got["standalone"])
    assert_same_samples(got["standalone"], local_samples)


@pytest.mark.slow
def test_a_replica_past_its_deadline_is_replaced_and_its_shard_resent(objects, local_samples, ray_pool, tmp_path):
    """A replica that hangs in generate misses the pool's deadline: it is killed (its late
    answer can never be joined), a fresh replica loads the active version, verified, and the
    shard is sent again; the samples are the local ones, none twice."""
    from sealrl.placement.rollout_pool import RolloutPool
    from tests.helpers_replicas import HangsMidGenerate, PatientRestarts
    model, tok, (state, v0), _, requests = objects
    # The deadline under test is the pool's (5 s): it bounds a generate call on a warm replica
    # (tens of ms), and the hung replica sleeps 3600 s. Starting the replacement actor (a new
    # process importing torch) is not what this test times: it gets a generous 120 s.
    factory = functools.partial(HangsMidGenerate, model, tok, str(tmp_path / "hung"), 3600.0)
    pool = RolloutPool(PatientRestarts("rollout", factory, ray_pool.pool, timeout_s=120), timeout_s=5)
    try:
        pool.load(state, v0)
        samples = pool.generate(requests, CONTRACT, v0.version)
        assert_same_samples(samples, local_samples)
        assert pool.group.restarts == 1 and [e for e, _ in pool.history][-1].startswith("replace")
        assert pool.history[-1][1] == v0.version.id and pool.version == v0.version
        assert pool.join_counts["placement/rollout_resent_shards"] == 1.0
        assert pool.join_counts["placement/rollout_duplicate"] == 0.0
    finally:
        pool.close()


@pytest.mark.slow
def test_a_rollout_replica_killed_mid_iteration_is_replaced_and_the_run_is_unchanged(
        objects, tmp_path, tiny_model_dir, ray_pool, local_run, monkeypatch):
    """Issue 6: a replica's process exits while iteration 1's generate is in flight. The pool
    replaces it (fresh actor, the active version loaded and verified) and re-sends its shard
    with the same seeds; the iteration completes with no sample duplicated or missing, every
    group intact, and the run's experience and weights equal the uninterrupted run's."""
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.placement.workers import RayWorkerGroup
    from sealrl.trainer import setup
    from sealrl.trainer.driver import train
    from tests.helpers_replicas import DiesMidGenerate
    from tests.test_driver_e2e import small_cfg
    model, tok = objects[0], objects[1]
    build_roles, pools = setup.build_roles, []

    def with_dying_replica(cfg, run_id):
        roles = build_roles(cfg, run_id)
        factory = functools.partial(DiesMidGenerate, model, tok, str(tmp_path / "died"), "e2e/1/")
        roles.rollout = RolloutPool(RayWorkerGroup("rollout", factory, ray_pool.pool, timeout_s=120), timeout_s=120)
        roles.closers.append(roles.rollout.close)
        pools.append(roles.rollout)
        return roles

    monkeypatch.setattr(setup, "build_roles", with_dying_replica)
    remote = train(small_cfg(tmp_path / "ray", tiny_model_dir))
    pool = pools[0]
    assert (tmp_path / "died").exists() and pool.group.restarts == 1
    events = [e for e, _ in pool.history]
    k = next(e for e in events if e.startswith("replace"))
    at = events.index(k)
    assert events[at - 1] == "generate" and pool.history[at][1] == pool.history[at - 1][1]  # same version
    assert pool.join_counts["placement/rollout_resent_shards"] == 1.0
    assert pool.join_counts["placement/rollout_duplicate"] == pool.join_counts["placement/rollout_late"] == 0.0
    metrics = [json.loads(x) for x in (tmp_path / "ray" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [m["groups/regenerated_samples"] for m in metrics] == [0, 0]   # recovered inside the pool
    assert sum(m["rollout/replica_replacements"] for m in metrics) == 1
    assert sum(m["rollout/replica_recovery_s"] for m in metrics) > 0
    assert_same_run(tmp_path / "ray" / "e2e", remote, local_run)


@pytest.mark.slow
def test_resume_in_ray_placement_resyncs_verified_weights_before_generating(tmp_path, tiny_model_dir, ray_pool,
                                                                             local_run, monkeypatch):
    """Stopped after iteration 1 and resumed with placement.backend=ray: the new replicas load
    the restored actor's weights (staged, every checksum verified, activated) before the first
    generation, and the resumed run ends with the uninterrupted run's weights."""
    from sealrl.experience.store import read_iteration
    from sealrl.trainer import setup
    from sealrl.trainer.driver import train
    from tests.test_driver_e2e import small_cfg
    make, pools = setup.ray_rollout_pool, []
    monkeypatch.setattr(setup, "ray_rollout_pool", lambda *a: pools.append(make(*a)) or pools[-1])
    ray_cfg = ["placement.backend=ray", "placement.rollout_replicas=2", "placement.cpus_per_replica=0.5",
               "placement.timeout_s=120"]
    train(small_cfg(tmp_path, tiny_model_dir, "run.iterations=1", *ray_cfg))
    resumed = train(small_cfg(tmp_path, tiny_model_dir, "run.resume=auto", *ray_cfg))
    restored = read_iteration(local_run[1] / "experience" / "iter_000001.parquet").samples[0].policy_version
    assert pools[1].history[:2] == [("load", restored), ("generate", restored)]
    assert_same_run(tmp_path / "e2e", resumed, local_run)


@pytest.mark.slow
def test_a_replica_lost_while_idle_is_replaced_at_the_next_load_and_the_load_goes_on(objects, ray_pool):
    """The replica dies between two iterations (idle: most of its time). The next weight sync
    finds it lost while staging, replaces it (back to the served version, verified), stages
    again on every replica and activates: the run goes on, nothing raised."""
    import ray

    from sealrl.placement.rollout_pool import RolloutPool
    _, _, (state, v0), (state1, v1), requests = objects
    pool = RolloutPool(ray_pool, timeout_s=120)
    pool.load(state, v0)
    restarts = ray_pool.restarts
    ray.kill(ray_pool.actors[0], no_restart=True)
    assert pool.load(state1, v1) == v1.version
    assert ray_pool.restarts == restarts + 1 and len(pool.take_recoveries()) == 1
    assert pool.version == v1.version
    assert {s.policy_version for s in pool.generate(requests, CONTRACT, v1.version)} == {v1.version}
