"""Data-parallel layout equivalence on 2 gloo processes: the collectives the roles use
(roles/distributed.py) shard by sorted sample id and sum over ranks, and the roles' own ranks
(placement/train_group.py) give the one-process results with both dp strategies (allreduce,
fsdp2): old log-probs, updates through a rollback and a resume, critic values and updates."""
from __future__ import annotations

import warnings

import pytest
import torch

from sealrl.experience import (
    ExperienceBatch,
    PolicyVersion,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
    group_id,
    pad_token_rows,
    sample_id,
    split_ids,
)
from sealrl.models.tiny import build_tiny_model
from sealrl.roles.distributed import all_reduce_grads, all_reduce_sums, own_rows, rank_seed, shard_batch, world
from tests.helpers_dist import launch

V0 = PolicyVersion("run", 0, 0, "w0", "tok", "cfg")
HORIZON = 8
STRATEGIES = ("fsdp2", "allreduce")
# Sorted ids: p0/* and p1/* (long responses) land on rank 0, p2/* and p3/* (one token) on
# rank 1: shard token counts 28 vs 4, so a per-rank normaliser would weight rank 1 7x more.
RESPONSES = {"p0": ((5, 6, 7, 8, 9, 10, 2), (7, 8, 9, 10, 11, 12, 2)),
             "p1": ((13, 14, 15, 16, 17, 18, 2), (9, 9, 9, 9, 9, 9, 9)),
             "p2": ((2,), (5,)), "p3": ((6,), (2,))}


def make_model():
    model, _ = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return model


def make_batch() -> ExperienceBatch:
    """A hand-made batch with advantages and old log-probs, listed NOT in sorted-id order."""
    metas, adv_rows = [], []
    for k, prompt in enumerate(("p3", "p0", "p2", "p1")):
        g = group_id("run", 0, prompt)
        for c, resp in enumerate(RESPONSES[prompt]):
            metas.append(SampleMeta(sample_id(g, c), g, prompt, (4, 11 + k, 14), resp,
                                    StopReason.EOS if resp[-1] == 2 else StopReason.LENGTH,
                                    V0.id, seed=10 * k + c))
            adv_rows.append([(1.0 if c == 0 else -0.7) * (1 + 0.1 * k)] * len(resp))
    batch = ExperienceBatch("run", 0, metas, SamplingContract(max_new_tokens=HORIZON, n=2), [V0])
    w = batch.num_response_tokens
    rows = [[-1.5 - 0.2 * j for j in range(len(m.response_ids))] for m in metas]  # ratios far from 1
    batch.put("response_mask", pad_token_rows([[1] * len(m.response_ids) for m in metas], w, torch.bool),
              Role.ROLLOUT, V0.id)
    batch.put("rollout_log_probs", pad_token_rows(rows, w, torch.float32), Role.ROLLOUT, V0.id)
    batch.put("old_log_probs", pad_token_rows(rows, w, torch.float32), Role.ROLLOUT, V0.id)
    batch.put("advantages", pad_token_rows(adv_rows, w, torch.float32), Role.DRIVER, "test")
    return batch


def rank_main(rank: int, world_size: int) -> dict:
    """Runs in each spawned gloo process."""
    batch = make_batch()
    shard = shard_batch(batch, rank, world_size)
    out = {"shard_ids": shard.sample_ids, "tokens": int(shard.get("response_mask").sum())}
    minibatch = torch.tensor([6, 1, 3, 0])  # rows of a minibatch, in the shuffled order
    out["own_rows"] = own_rows(batch, minibatch).tolist()
    out["sums"] = all_reduce_sums({"a": 1.0 + rank, "b": 0.5})
    out["union"] = all_reduce_sums({"a": 1.0} if rank == 0 else {"b": 2.0})  # a rank without rows lacks keys
    used, unused, idle = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    if rank == 0:  # `idle` has a gradient on rank 0 only, `unused` on no rank
        (used.sum() + 3 * idle.sum()).backward()
    else:
        used.sum().backward()
    all_reduce_grads([used, unused, idle])
    out["grads_after_reduce"] = (used.grad.tolist(), unused.grad, idle.grad.tolist())
    return out


def all_main(rank: int, world_size: int) -> dict:
    """Every distributed check of this module on one pair of spawned processes (each spawn
    re-imports torch and sealrl: seconds): the collectives, then the roles' ranks with each
    strategy, one after the other in the same process group."""
    return {"collectives": rank_main(rank, world_size),
            **{strategy: role_sequence(strategy, distributed=True) for strategy in STRATEGIES}}


@pytest.fixture(scope="module")
def launched():
    return launch(all_main, 2, timeout_s=600)


@pytest.fixture(scope="module")
def ranks(launched):
    return [r["collectives"] for r in launched]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a)


def test_shards_are_contiguous_ranges_of_sorted_ids_and_sums_are_global(ranks):
    batch = make_batch()
    ids = sorted(batch.sample_ids)
    rows = [6, 1, 3, 0]  # ids p1/0 p3/1 p0/1 p3/0; sorted: p0/1 p1/0 | p3/0 p3/1
    assert sorted(batch.sample_ids[i] for i in ranks[0]["own_rows"]) == sorted(batch.sample_ids[i] for i in rows)[:2]
    assert ranks[0]["own_rows"] == [6, 3] and ranks[1]["own_rows"] == [1, 0]  # minibatch order kept
    assert ranks[0]["sums"] == ranks[1]["sums"] == {"a": 3.0, "b": 1.0}
    assert ranks[0]["union"] == ranks[1]["union"] == {"a": 1.0, "b": 2.0}
    # summed; a parameter no rank used keeps no gradient (as on one process: AdamW skips it)
    assert ranks[0]["grads_after_reduce"] == ranks[1]["grads_after_reduce"] == ([2.0, 2.0], None, [3.0, 3.0])
    assert ranks[0]["shard_ids"] == ids[:4] and ranks[1]["shard_ids"] == ids[4:]
    assert (ranks[0]["tokens"], ranks[1]["tokens"]) == (28, 4)   # very unequal shards


def test_shard_keeps_provenance_and_width():
    batch = make_batch()
    shard = shard_batch(batch, 1, 2)
    assert shard.provenance("advantages") == batch.provenance("advantages")
    assert shard.num_response_tokens == batch.num_response_tokens
    assert shard.sample_ids == split_ids(batch.sample_ids, 2)[1]


def test_rank_seeds_are_derived_distinct_and_stable():
    seeds = [rank_seed(7, r) for r in range(8)]
    assert seeds == [rank_seed(7, r) for r in range(8)]        # a function of (seed, rank)
    assert len(set(seeds)) == 8 and rank_seed(8, 0) != seeds[0]
    assert all(0 <= s < 2 ** 63 for s in seeds)


# ---- the data-parallel roles' ranks (train_group.ActorRank / CriticRank) on 1 vs 2 processes ----

def role_sequence(strategy: str, distributed: bool) -> dict:
    """Through the ranks' own methods: old log-probs and values of 7 samples (4 vs 3 rows per
    rank, 1-row micro-batches: FSDP2 needs an idle forward on rank 1), a rolled-back update,
    an update (3-row minibatches: 2 vs 1 rows, an idle backward), the full state gathered and
    pushed into NEW ranks (a resume), one more update; a critic update. One process when not
    `distributed` (the reference)."""
    from sealrl.config import build_config
    from sealrl.models.critic import CriticModel
    from sealrl.placement.train_group import ActorRank, CriticRank
    from sealrl.roles.actor import Actor
    from sealrl.roles.critic import Critic
    from sealrl.roles.distributed import full_optimizer_state, full_state
    cfg = build_config(None, ["actor.micro_batch_size=1", "actor.mini_batch_size=3", "actor.lr=1e-3",
                              "actor.adam_eps=1e-6", "critic.lr=1e-3"])
    def make_actor():   # every rank its own model, as every Ray actor unpickles its own
        return Actor(make_model(), cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON)

    def make_critic():
        with torch.random.fork_rng():
            torch.manual_seed(5)   # the value head's init
            return Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, 3, "token-mean", HORIZON,
                          adam_eps=cfg.actor.adam_eps)

    def ready(rank):
        if distributed:
            rank.setup()
        return rank

    batch = make_batch()
    seven = batch.select_ids(sorted(batch.sample_ids)[:7])
    out: dict = {}
    actor = ready(ActorRank(make_actor, 0, strategy))
    out["sharded"] = actor.sharded()
    out["old"] = actor.old_log_probs(seven)
    actor.keep_snapshot()
    actor.update(batch, V0, 0, seed=1, kl_coef=0.0)
    actor.restore_snapshot()
    out["m1"] = actor.update(batch, V0, 0, seed=1, kl_coef=0.0)
    out["w1"], out["w1_hash"] = published(actor)
    model_state, optim_state = full_state(actor.worker.model.state_dict()), full_optimizer_state(actor.worker.optimizer)
    resumed = ready(ActorRank(make_actor, 0, strategy))
    first = world()[0] == 0   # only rank 0 reads the state (sent in lists, as the driver sends it); the
    resumed.load_state([model_state if first else None], [optim_state if first else None],   # others receive
                       {"step": actor.worker.step})                                          # it from rank 0
    out["m2"] = resumed.update(batch, V0, 1, seed=2, kl_coef=0.0)
    (out["w2"], _), out["state"] = published(resumed), resumed.state()
    with warnings.catch_warnings(record=True) as caught:   # FSDP2 must hook the critic's outputs
        warnings.simplefilter("always")
        critic = ready(CriticRank(make_critic, 0, strategy))
        out["values"] = critic.values(seven)
        mask = batch.get("response_mask")
        batch.put("values", (0.1 * batch.get("advantages")).masked_fill(~mask, 0.0), Role.CRITIC, "c")
        batch.put("returns", batch.get("advantages").masked_fill(~mask, 0.0), Role.DRIVER, "test")
        critic.keep_snapshot()
        critic.update(batch)
        critic.restore_snapshot()
        out["cm"] = critic.update(batch)
        out["wc"] = (critic.state(optim=False) or (None,))[0]
    out["critic_warnings"] = [str(w.message) for w in caught if "view" in str(w.message)]
    return out


def published(rank) -> tuple[dict | None, str]:
    """ActorRank.publish outside Ray: (rank 0's full weights, else None; the hash of its weights
    that the rank reports)."""
    out = rank.publish(0, "fp32", None)
    return (None, out) if isinstance(out, str) else (out[0], out[2])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_role_ranks_on_two_processes_give_the_one_process_results(launched, strategy):
    from sealrl.placement.train_group import join_rows
    one = role_sequence(strategy, distributed=False)
    r0, r1 = (r[strategy] for r in launched)
    assert r0["sharded"] == r1["sharded"] == (strategy == "fsdp2") and not one["sharded"]
    assert r0["critic_warnings"] == r1["critic_warnings"] == []   # no view output that drops FSDP2's backward hook
    assert r1["w1"] is None and r1["state"] is None and r1["wc"] is None   # rank 0 ships, the others only gather
    assert r1["w1_hash"] == r0["w1_hash"]                                 # ... and report the hash of theirs
    seven = make_batch().select_ids(sorted(make_batch().sample_ids)[:7])
    assert [len(r0["old"][0]), len(r1["old"][0])] == [4, 3]
    assert torch.allclose(join_rows(seven, [r0["old"], r1["old"]]), one["old"][1], atol=1e-6, rtol=0)
    for k in (1, 2):
        assert max_diff(r0[f"w{k}"], one[f"w{k}"]) <= 1e-6
        assert r0[f"m{k}"][1] == one[f"m{k}"][1]                        # step counters
        assert r0[f"m{k}"][0]["actor/pg_loss"] == pytest.approx(one[f"m{k}"][0]["actor/pg_loss"], abs=1e-6)
        assert r0[f"m{k}"][0]["actor/grad_norm"] == pytest.approx(one[f"m{k}"][0]["actor/grad_norm"], rel=1e-5)
        for stat in ("min", "p50", "p99", "max"):   # gathered over the ranks, not summed: exact
            key = f"actor/ratio_{stat}"
            assert r0[f"m{k}"][0][key] == r1[f"m{k}"][0][key] == pytest.approx(one[f"m{k}"][0][key], rel=1e-5)
    assert max_diff(r0["w1"], one["w1"]) + max_diff(r0["w2"], r0["w1"]) > 0   # the updates move the weights
    model_state, optim_state = r0["state"]
    assert max_diff(model_state, one["state"][0]) <= 1e-6
    for i, s in one["state"][1]["state"].items():                        # full Adam moments gathered
        assert max_diff({k: v for k, v in optim_state["state"][i].items()}, s) <= 1e-6
    for part in (1, 2):   # values and last values, joined by id
        joined = join_rows(seven, [(r0["values"][0], r0["values"][part]), (r1["values"][0], r1["values"][part])])
        assert torch.allclose(joined, one["values"][part], atol=1e-6, rtol=0)
    # Adam's first steps move a weight by ~lr * g / (|g| + eps): the ranks' reordered fp32 sums
    # (gap ~1e-10 on these gradients) move it by at most lr * gap / eps = 1e-3 * 1e-10 / 1e-6 = 1e-7
    assert max_diff(r0["wc"], one["wc"]) <= 1e-6
    assert r0["cm"][0]["critic/value_loss"] == pytest.approx(one["cm"][0]["critic/value_loss"], abs=1e-6)
