"""Data-parallel actor and critic wired into the driver (placement.actor_ranks /
critic_ranks = 2, Ray, gloo): the unchanged driver gives the same updated weights as the
in-process run (<= 1e-6, fp32), through a rollback, a checkpoint and a resume too, with both
placement.dp_strategy values (fsdp2: sharded ranks; allreduce: replicated ranks). Adam's step
divides by sqrt(v) + eps, so fp32 sum-order differences (2 ranks add the gradient in another
order) are compared after 1-2 steps with adam_eps 1e-6 and lr 1e-4, as in
test_reference_iteration.py. One Ray session for the module (start-up costs seconds); the
in-process runs both strategies are compared with run once for the module."""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from sealrl import faults
from sealrl.audit import audit_run
from sealrl.config import StoppedRun, build_config
from sealrl.experience.store import read_iteration
from sealrl.placement import train_group
from sealrl.placement.train_group import ActorGroup, ActorRank, join_rows
from sealrl.placement.workers import LocalWorkerGroup
from sealrl.roles.actor import Actor
from sealrl.trainer.driver import train
from sealrl.trainer.resume.checkpoint import load_checkpoint
from tests.harness import local_ray, small_args
from tests.test_placement_dp import HORIZON, V0, make_batch, make_model, max_diff

ARGS = small_args("run.checkpoint_every=1", "data.num_train=64", "eval.num=8", "data.prompts_per_iter=3",
                  "actor.micro_batch_size=4", "actor.lr=1e-4", "actor.adam_eps=1e-6",
                  "run.seed=10")
# seed 10: on the shipped warm start, iteration 1 has groups with signal (most seeds of 3 prompts
# x 4 give zero-variance groups only, hence no update to compare)
# 12 samples: 3 micro-batches in one process, 2 per rank (6 rows each) on two
DP = ["placement.backend=ray", "placement.rollout_replicas=1", "placement.cpus_per_replica=1",
      "placement.timeout_s=180"]
STRATEGIES = ("fsdp2", "allreduce")
PPO = ["algorithm.name=ppo", "run.iterations=1", "critic.lr=3e-4"]


@pytest.fixture(scope="module")
def ray_session():
    pytest.importorskip("ray", reason="data-parallel roles need ray: pip install 'sealrl[ray]'")
    local_ray()   # the process's shared local Ray (tests/harness.py), left up for the next Ray test


def run(tmp_path, name, *extra):
    train(build_config(None, [*ARGS, f"run.output_dir={tmp_path}", f"run.name={name}", *extra]))
    return tmp_path / name


@pytest.fixture(scope="module")
def local_grpo(tmp_path_factory):
    return run(tmp_path_factory.mktemp("grpo"), "local", "algorithm.name=grpo", "run.iterations=2")


@pytest.fixture(scope="module")
def local_ppo(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ppo"), "local", *PPO)


def assert_same_weights(a, b, part, step, tol=1e-6):
    """The weights parts of two checkpoints (one file, or streamed from ranks in shards)."""
    (wa,), (wb,) = (load_checkpoint(r / "checkpoints" / f"step_{step}", [part])[0].values() for r in (a, b))
    assert wa.keys() == wb.keys()
    diffs = {n: float((wa[n] - wb[n]).abs().max()) for n in wa}
    assert max(diffs.values()) <= tol, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]


def assert_same_optimizer(a, b, part, step):
    """The optimizer parts of two checkpoints (one-file or streamed in shards), tensor by tensor
    within 1e-5 of the tensor's largest entry: the ranks sum gradients in another order (the
    grad-norm checks use the same relative bound), and an entry whose gradient cancels to near 0
    carries that rounding at its tensor's scale, not its own."""
    (ta,), (tb,) = (load_checkpoint(r / "checkpoints" / f"step_{step}", [part])[0].values() for r in (a, b))
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert float((ta[k] - tb[k]).abs().max()) <= 1e-5 * float(tb[k].abs().max()), k


def experience(run_dir, it):
    return read_iteration(run_dir / "experience" / f"iter_{it:06d}.parquet")


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fsdp2_ranks_are_shipped_a_weightless_template_not_the_model():
    """With fsdp2 (no LoRA) what every rank receives is a template of the model, its weights on
    the meta device (the full state goes to the object store once and only rank 0 reads it:
    roles/distributed.fill_from_rank0, run end to end by the fsdp2 tests below). Pickled as Ray
    ships an actor's arguments, it is a few percent of the weights it stands for; the worker it
    makes is the role over whatever model it is given, with its own optimizer."""
    cloudpickle = pytest.importorskip("ray.cloudpickle", reason="data-parallel roles need ray")
    from sealrl.models.synthetic import build_mid
    from sealrl.placement.train_ray import sharded_from_rank0
    from sealrl.roles.distributed import fsdp2_available
    if not fsdp2_available():
        pytest.skip("FSDP2 is not in this torch: every rank receives the model")
    cfg = build_config(None, [])
    model = build_mid(0)[0]
    make = functools.partial(Actor, model, cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())   # a tied pair once
    make_worker, template = sharded_from_rank0(make, "fsdp2")
    shipped = len(cloudpickle.dumps((make_worker, template)))
    assert shipped < 0.05 * weight_bytes, (shipped, weight_bytes)
    assert len(cloudpickle.dumps(make)) > weight_bytes   # what each rank received before
    assert all(p.is_meta for p in template.parameters()) and all(p.requires_grad for p in template.parameters())
    actor = make_worker(model)
    assert actor.model is model and actor.optimizer.param_groups[0]["params"][0] is next(model.parameters())
    assert sharded_from_rank0(make, "allreduce") is None   # every rank holds the whole model anyway


def test_join_rows_places_each_rank_s_rows_by_sample_id():
    batch = make_batch()
    ids = sorted(batch.sample_ids)
    rows = {sid: torch.full((batch.num_response_tokens,), float(i)) for i, sid in enumerate(batch.sample_ids)}
    parts = [(ids[4:], torch.stack([rows[s] for s in ids[4:]])), (ids[:4], torch.stack([rows[s] for s in ids[:4]]))]
    joined = join_rows(batch, parts)
    assert joined[:, 0].tolist() == [float(i) for i in range(len(batch))]   # batch positions, not rank order
    with pytest.raises(RuntimeError, match="missing"):
        join_rows(batch, parts[:1])


def test_actor_group_of_one_in_process_rank_is_the_plain_actor(tmp_path, monkeypatch):
    """The facade's plumbing without Ray: update, pull to the mirror, export, rollback, and the
    push a checkpoint restore makes, against a plain Actor (bitwise: one rank). Between reads the
    driver's mirror holds no weights (meta device, no optimizer); the weights and the Hugging
    Face folder stream from the ranks a bucket at a time."""
    from sealrl.models.hf import load_causal_lm
    from sealrl.models.tiny import build_char_tokenizer
    cfg = build_config(None, ["actor.micro_batch_size=3", "actor.lr=1e-3"])
    model = make_model()

    def make():   # each worker its own copy, as each Ray actor would unpickle one
        return Actor(copy.deepcopy(model), cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON)

    plain = make()
    group = ActorGroup(LocalWorkerGroup("actor", [ActorRank(make, 0)]), make())
    want = plain.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    assert group.update(make_batch(), V0, 0, seed=1, kl_coef=0.0) == want and group.step == plain.step == 1
    assert all(p.is_meta for p in group.local.model.parameters()) and group.local.optimizer is None
    weights = lambda m: {k: v.clone() for k, v in m.state_dict().items()}  # noqa: E731
    monkeypatch.setattr(train_group, "CHECKPOINT_BUCKET_BYTES", 1 << 10)   # a tensor or two per bucket
    chunks, meta = group.streamed("model")
    streamed = {k: v for chunk in chunks for k, v in chunk.items()}
    assert meta is None and max_diff(streamed, weights(plain.model)) == 0.0
    group.save_pretrained(build_char_tokenizer(), tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 3
    loaded, _ = load_causal_lm(tmp_path / "hf")
    assert max_diff(weights(loaded), weights(plain.model)) == 0.0 and group.local.model.parameters().__next__().is_meta
    assert max_diff(weights(group.model), weights(plain.model)) == 0.0            # pulled from rank 0
    assert group.optimizer.state_dict()["state"].keys() == plain.optimizer.state_dict()["state"].keys()
    state, manifest = group.publish("fp32", None)      # outside Ray: rank 0's tensors themselves
    want_state, want_manifest = plain.publish("fp32", None)
    assert manifest == want_manifest and max_diff(state, want_state) == 0.0
    snap, before = group.snapshot(), weights(group.model)
    group.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    assert group.step == 2 and max_diff(weights(group.model), before) > 0
    group.restore(snap)
    assert group.step == 1 and max_diff(weights(group.model), before) == 0.0        # every rank rolled back
    group.model.load_state_dict(make_model().state_dict())                          # a checkpoint restore ...
    group.set_counters(step=0)                                                      # ... then its counters
    rank = group.replicas.group.workers[0].worker
    assert rank.step == 0 and max_diff(weights(rank.model), weights(make_model())) == 0.0
    group.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    assert all(p.is_meta for p in group.local.model.parameters())                    # emptied again


@pytest.mark.slow
def test_a_token_budget_on_two_fsdp2_ranks_gives_the_one_process_update(tmp_path, ray_session):
    """actor.max_tokens_per_micro_batch with 2 FSDP2 ranks: each rank partitions its own rows by
    the budget, so the ranks may run different numbers of passes; the one with fewer adds idle
    ones (counted by the same partition), every collective is joined, and the weights are the
    one-process run's. (It crashed the first data-parallel update before.)"""
    from sealrl.experience import split_ids
    from sealrl.models.packing import partition_by_tokens
    # 3 prompts x 5 = 15 samples of 10 tokens, 8 and 7 per rank: a budget of 15 runs each sample
    # on its own, so rank 1 runs one idle pass per step
    budget = ["algorithm.name=grpo", "run.iterations=2", "rollout.n=5", "actor.max_tokens_per_micro_batch=15"]
    local = run(tmp_path, "local", *budget)
    dp = run(tmp_path, "dp", *budget, "placement.actor_ranks=2", "placement.dp_strategy=fsdp2", *DP)
    batch = experience(dp, 0)
    length = {s.sample_id: len(s.prompt_ids) + len(s.response_ids) for s in batch.samples}
    passes = [len(partition_by_tokens([length[i] for i in part], 15)) for part in split_ids(batch.sample_ids, 2)]
    assert passes[0] != passes[1], passes   # the idle passes ran
    assert_same_weights(local, dp, "actor_model", 2)
    # the final Hugging Face folder, streamed from the FSDP2 ranks in shards, loads as the local one
    from sealrl.models.hf import load_causal_lm
    (ma, _), (mb, _) = load_causal_lm(local / "model"), load_causal_lm(dp / "model")
    assert (dp / "model" / "model.safetensors.index.json").is_file()
    assert max_diff(ma.state_dict(), mb.state_dict()) <= 1e-6
    w1 = load_file(str(local / "checkpoints" / "step_1" / "actor_model.safetensors"))
    w2 = load_file(str(local / "checkpoints" / "step_2" / "actor_model.safetensors"))
    assert max(float((w1[n] - w2[n]).abs().max()) for n in w1) > 1e-5   # an update that moved the weights
    assert audit_run(dp).ok


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grpo_two_actor_ranks_give_the_one_process_update_through_a_resume(tmp_path, ray_session, monkeypatch,
                                                                           local_grpo, strategy):
    local, dp_args = local_grpo, ["placement.actor_ranks=2", f"placement.dp_strategy={strategy}", *DP]
    # iteration 0: every rank restores its snapshot, then retries; iteration 1: rank 1 is lost
    # (its process killed, as with its node), which stops the run with one line, recorded
    monkeypatch.setenv("SEALRL_FAULTS", "update@0:raise,update@1:kill_rank")
    monkeypatch.setattr(faults, "_fired", set())                   # entries fire once per process
    with pytest.raises(StoppedRun, match=r"^actor rank 1 on host \S+ \(Ray node [0-9a-f]{12}\) was lost during "
                                         r"update \(the worker's process died: [^\n]*\); the run stops here") as stop:
        run(tmp_path, "dp", "algorithm.name=grpo", "run.iterations=2", *dp_args)
    monkeypatch.delenv("SEALRL_FAULTS")
    dp = tmp_path / "dp"
    failure = json.loads((dp / "failures.jsonl").read_text())
    assert (failure["role"], failure["worker"], failure["stage"]) == ("actor", 1, "update")
    assert failure["message"] == str(stop.value) and failure["node_id"]
    assert audit_run(dp).ok   # what was committed before the loss is whole
    assert metrics(dp)[0]["update/attempts"] == 2
    assert_same_weights(local, dp, "actor_model", 1)
    # resumed: restore_position pushes the checkpoint to both ranks; the second update matches.
    # Its checkpoint gathers Adam's state from the ranks 64 KiB at a time, written as it comes
    monkeypatch.setattr(train_group, "CHECKPOINT_BUCKET_BYTES", 64 << 10)
    run(tmp_path, "dp", "algorithm.name=grpo", "run.iterations=2", "run.resume=auto", *dp_args)
    assert_same_weights(local, dp, "actor_model", 2)
    assert len(list((dp / "checkpoints" / "step_2").glob("actor_optim-*.safetensors"))) > 3
    assert_same_optimizer(local, dp, "actor_optim", 2)
    a, b = experience(local, 1), experience(dp, 1)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]  # same experience
    # joined by id: the runs' weights differ by up to 1e-6 each (above), which moves a log-prob by
    # sums over fan-ins of 128 and 512 in 4 layers: 1.0e-5 was seen (fsdp2, on a Xeon), so the
    # bound is 1e-4; a row joined to another response's id is off by 1e-2 or more
    assert torch.allclose(a.get("old_log_probs"), b.get("old_log_probs"), atol=1e-4, rtol=0)
    for ma, mb in zip(metrics(local), metrics(dp)):
        assert "perf/actor_collectives_s" not in ma   # one process: no collective
        assert 0 < mb["perf/actor_collectives_s"] < mb["time/update_s"]   # the ranks' sums, all-reduces
        assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], abs=1e-6)
        assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
        assert ma["actor/entropy"] == pytest.approx(mb["actor/entropy"], abs=1e-5)
    w0 = load_file(str(local / "checkpoints" / "step_1" / "actor_model.safetensors"))
    w2 = load_file(str(local / "checkpoints" / "step_2" / "actor_model.safetensors"))
    assert max(float((w0[n] - w2[n]).abs().max()) for n in w0) > 1e-5   # the updates are not trivially 0


@pytest.mark.slow
def test_lora_on_two_fsdp2_ranks_and_two_replicas_gives_the_one_process_adapter(tmp_path, ray_session):
    """LoRA with the default fsdp2 strategy: the ranks shard base and adapter alike, export
    gathers only the adapter (checked against every rank's), the replicas merge it into their
    pinned base; after two updates the adapter is the one-process run's within 1 vs 2 ranks'
    bound (1e-6), and so is the experience both sampled."""
    lora = ["algorithm.name=grpo", "run.iterations=2", "actor.lora.rank=4", "actor.lora.alpha=8"]
    local = run(tmp_path, "local", *lora)
    dp = run(tmp_path, "dp", *lora, "placement.actor_ranks=2", "placement.backend=ray", "placement.rollout_replicas=2",
             "placement.cpus_per_replica=0.5", "placement.timeout_s=180")
    assert_same_weights(local, dp, "actor_model", 2)
    w1 = load_file(str(local / "checkpoints" / "step_1" / "actor_model.safetensors"))
    assert all(".lora_" in n for n in w1)   # the checkpoint holds the adapter only
    w2 = load_file(str(local / "checkpoints" / "step_2" / "actor_model.safetensors"))
    assert max(float((w1[n] - w2[n]).abs().max()) for n in w1) > 1e-5   # the second update moved it
    for it in range(2):
        assert [s.response_ids for s in experience(local, it).samples] == \
               [s.response_ids for s in experience(dp, it).samples]
    m1, d1 = metrics(local)[1], metrics(dp)[1]
    assert m1["actor/grad_norm"] == pytest.approx(d1["actor/grad_norm"], rel=1e-5)   # summed, not doubled


@pytest.mark.slow
def test_ppo_ranks_colocated_with_the_rollout_replicas_give_the_one_process_update(tmp_path, ray_session, local_ppo,
                                                                                    monkeypatch):
    """The default strategy (fsdp2) end to end, with placement.rollout_pool=colocated: 2 actor
    ranks and 2 rollout replicas in one Ray pool (rank k and replica k on bundle k, each asks
    half of it), the 2 critic ranks on a pool of their own; the updates are the one-process
    ones. The pools are inspected inside the run, as the driver builds them (one set of Ray
    actors). allreduce differs only inside the ranks, where test_placement_dp runs both
    strategies (and the GRPO test above runs both end to end, standalone)."""
    from sealrl.trainer import setup
    colocated = ["placement.actor_ranks=2", "placement.rollout_replicas=2", "placement.rollout_pool=colocated",
                 "placement.backend=ray", "placement.cpus_per_replica=1", "placement.timeout_s=180"]
    build_roles, seen = setup.build_roles, []

    def inspected(cfg, run_id):
        roles = build_roles(cfg, run_id)
        pool = roles.actor.replicas.group._pool
        seen.append({"shared": pool is roles.rollout.group._pool, "roles": pool.spec.roles,
                     "num_workers": pool.spec.num_workers, "sharded": roles.actor.replicas.call("sharded"),
                     "critic": (roles.critic.replicas.group._pool.spec.roles,
                                roles.critic.replicas.group._pool is not pool)})
        return roles

    monkeypatch.setattr(setup, "build_roles", inspected)
    local = local_ppo
    dp = run(tmp_path, "dp", *PPO, "placement.critic_ranks=2", *colocated)
    # one pool for the actor and the rollout; placement.dp_strategy=fsdp2 by default
    assert seen == [{"shared": True, "roles": ("actor", "rollout"), "num_workers": 2, "sharded": [True, True],
                     "critic": (("critic",), True)}]
    assert_same_weights(local, dp, "actor_model", 1)
    assert_same_weights(local, dp, "critic_model", 1)
    a, b = experience(local, 0), experience(dp, 0)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]  # same experience
    assert torch.allclose(a.get("values"), b.get("values"), atol=1e-5, rtol=0)   # sharded values, joined by id
    (ma,), (mb,) = metrics(local), metrics(dp)
    assert ma["critic/value_loss"] == pytest.approx(mb["critic/value_loss"], abs=1e-6)
    assert ma["critic/grad_norm"] == pytest.approx(mb["critic/grad_norm"], rel=1e-5)
    # Adam's first step barely sees a gradient's scale: a rank that trained on every row (a
    # doubled gradient) could pass the weights check; the summed loss and norm would not.
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], abs=1e-6)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
    with pytest.raises(ValueError, match="placement.actor_ranks"):
        build_config(None, [*colocated, "placement.rollout_replicas=3"])


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_layout_and_back(tmp_path, ray_session, local_grpo, capsys):
    """Written with 1 rank in this process, resumed with 2 FSDP2 ranks on Ray (and the reverse):
    the full tensors are cut for the new layout, and the weights after the next update are the
    uninterrupted one-process run's within the same bound as 1 vs 2 ranks (1e-6)."""
    dp_args = ["placement.actor_ranks=2", "placement.dp_strategy=fsdp2", *DP]
    up = run(tmp_path, "up", "algorithm.name=grpo", "run.iterations=1")
    run(tmp_path, "up", "algorithm.name=grpo", "run.iterations=2", "run.resume=auto", *dp_args)
    assert "written with {'actor_ranks': 1" in capsys.readouterr().err
    assert_same_weights(local_grpo, up, "actor_model", 2)
    down = run(tmp_path, "down", "algorithm.name=grpo", "run.iterations=1", *dp_args)
    run(tmp_path, "down", "algorithm.name=grpo", "run.iterations=2", "run.resume=auto")
    assert_same_weights(local_grpo, down, "actor_model", 2)
    for folder in (up, down):
        report = audit_run(folder)
        assert report.ok, report.summary()
