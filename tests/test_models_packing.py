"""Packed sequences and token-budget micro-batches (models/packing.py): the packed layout,
the balanced partition (hand-derived cases), packed == padded for log-probs, entropy, every
loss aggregation mode, every KL estimator and the value loss (<= 1e-6 fp32, GQA and tied
embeddings included), and the actor's and critic's loss and gradients invariant to the partition."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sealrl import algos
from sealrl.config import build_config
from sealrl.models.critic import CriticModel
from sealrl.models.logprobs import response_log_probs
from sealrl.models.packing import (
    AUTO_MICRO_TOKENS,
    TeacherForcing,
    pack_sequences,
    packed_log_probs,
    packed_values,
    partition_by_tokens,
)
from sealrl.models.tiny import build_tiny_model
from sealrl.roles.actor import Actor
from sealrl.roles.common import batch_log_probs, teacher_forcing
from sealrl.roles.critic import Critic
from tests.test_placement_dp import HORIZON, V0, make_batch, make_model

PROMPTS = [[11, 12, 14, 8, 6, 18], [5, 9], [1, 7, 7, 7, 7, 7, 7, 3], [20]]
RESPONSES = [[4, 5, 2], [7], [], [5, 6, 7, 8, 9, 10, 2]]


def qwen2_gqa_tied():
    """A Qwen2 layout with grouped-query attention (4 query heads, 2 KV heads) and tied embeddings."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {"llama": lambda: build_tiny_model(seed=1)[0], "qwen2_gqa_tied": qwen2_gqa_tied}


def test_packed_layout():
    packed = pack_sequences([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert packed.input_ids.tolist() == [[1, 2, 3, 5, 6, 4, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert packed.starts == (0, 5)
    # position 2 (token 3) predicts 5, 3 predicts 6; position 5 (token 4) predicts 7, 6 -> 8, 7 -> 9
    assert packed.predicting_index().tolist() == [2, 3, 5, 6, 7]
    assert packed.predicting_index(extra=1).tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert packed.to_padded(torch.tensor([1.0, 2, 3, 4, 5])).tolist() == [[1, 2, 0], [3, 4, 5]]


def test_partition_by_tokens_hand_cases():
    # total 30, budget 15 -> 2 parts; longest first to the lighter part: 10|7, 5->b1 (12), 5->b0 (15), 3->b1 (15)
    assert partition_by_tokens([10, 3, 7, 5, 5], 15) == [[0, 4], [1, 2, 3]]
    # 3 x 6 under 9: two parts would hold 12 -> three parts
    assert partition_by_tokens([6, 6, 6], 9) == [[0], [1], [2]]
    # a sequence over the budget gets a part of its own, never split
    assert partition_by_tokens([20, 1], 5) == [[0], [1]]
    assert partition_by_tokens([4, 4, 4, 4], 100) == [[0, 1, 2, 3]]
    assert partition_by_tokens([], 8) == []
    with pytest.raises(ValueError, match="budget"):
        partition_by_tokens([1], 0)


def test_count_micro_batches_are_consecutive():
    assert TeacherForcing(micro_batch_size=2).micro_batches([5, 5, 5, 5, 5]) == [[0, 1], [2, 3], [4]]


def test_auto_micro_batches_are_the_fewest_equal_runs_of_whole_groups_within_the_budget():
    auto = TeacherForcing(micro_batch_size=0, group=8)
    assert auto.micro_batches([10] * 128) == [list(range(128))]   # the embedded model's step: one pass
    # vs_trl's mid step: 8,960 tokens > 8,192, so two runs of 8 groups (not 14 groups and 2)
    assert auto.micro_batches([70] * 128) == [list(range(64)), list(range(64, 128))]
    # 11,200 tokens: two runs of 3 groups would put 8,800 in the first, so three runs of 2
    long = [500] * 16 + [100] * 32
    assert [len(p) for p in auto.micro_batches(long)] == [16, 16, 16]
    assert max(sum(long[i] for i in p) for p in auto.micro_batches(long)) <= AUTO_MICRO_TOKENS
    assert auto.micro_batches([9000] * 16) == [list(range(8)), list(range(8, 16))]   # a group over budget: alone
    assert auto.micro_batches([]) == [] and TeacherForcing(micro_batch_size=0).micro_batches([3, 3]) == [[0, 1]]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunk", [0, 3])
def test_packed_equals_padded(name, chunk):
    model = MODELS[name]()
    with torch.no_grad():
        lp0, ent0, mask0 = response_log_probs(model, PROMPTS, RESPONSES, 0.7, with_entropy=True)
        lp1, ent1, mask1 = packed_log_probs(model, PROMPTS, RESPONSES, 0.7, with_entropy=True, chunk=chunk)
    assert torch.equal(mask0, mask1)
    assert (lp0 - lp1).abs().max() <= 1e-6 and (ent0 - ent1).abs().max() <= 1e-6
    assert (lp1[mask1 == 0] == 0).all() and (ent1[mask1 == 0] == 0).all()


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_every_loss_mode_and_kl_estimator_packed_equals_padded(mode):
    model = qwen2_gqa_tied()
    g = torch.Generator().manual_seed(0)
    lp0, _, mask = response_log_probs(model, PROMPTS, RESPONSES, 1.0)
    lp1, _, _ = packed_log_probs(model, PROMPTS, RESPONSES, 1.0)
    old = (lp0.detach() + 0.3 * torch.randn(lp0.shape, generator=g)) * mask
    ref = (lp0.detach() - 0.2 * torch.randn(lp0.shape, generator=g)) * mask
    adv = torch.randn(lp0.shape, generator=g) * mask
    norm = algos.make_normaliser(mask.bool(), mode, horizon=8)
    for lp in (lp0, lp1):
        losses = [algos.ppo_clip_loss(lp, old, adv, mask.bool(), norm, clip_low=0.2, clip_high=0.2)[0]]
        losses += [algos.aggregate(algos.kl_penalty(lp, ref, k), mask.bool(), norm) for k in algos.KL_ESTIMATORS]
        if lp is lp0:
            padded = torch.stack(losses)
        else:
            packed = torch.stack(losses)
    assert (padded - packed).abs().max() <= 1e-6, (padded, packed)


def test_values_and_value_loss_packed_equal_padded():
    model = qwen2_gqa_tied()
    torch.manual_seed(1)
    critic = CriticModel.from_causal_lm(model).eval()
    v0, last0, mask0 = critic.values(PROMPTS, RESPONSES)
    v1, last1, mask1 = packed_values(critic, PROMPTS, RESPONSES)
    assert torch.equal(mask0, mask1)
    assert (v0 - v1).abs().max() <= 1e-6 and (last0 - last1).abs().max() <= 1e-6
    returns = torch.linspace(-1, 1, v0.numel()).view(v0.shape) * mask0
    norm = algos.make_normaliser(mask0.bool(), "token-mean")
    l0 = algos.value_loss(v0, v0.detach() + 0.05, returns, mask0.bool(), norm, clip_eps=0.1)[0]
    l1 = algos.value_loss(v1, v0.detach() + 0.05, returns, mask0.bool(), norm, clip_eps=0.1)[0]
    assert abs(float(l0.detach() - l1.detach())) <= 1e-6


# ---- the roles: partition invariance --------------------------------------------------------

def _actor(*overrides, fast: bool = False):
    """An actor on the HF reference path (run.exact's), or with `fast` on the run's fast path."""
    cfg = build_config(None, ["actor.micro_batch_size=16", "actor.lr=1e-3", "actor.entropy_coef=0.01", *overrides])
    model = make_model()
    return Actor(model, cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON,
                 tf=teacher_forcing(cfg.actor, model, exact=not fast), exact=not fast)


def _update_grads(actor):
    """(metrics, gradients) of one update; the optimizer step itself is skipped."""
    grads = []
    actor.optimizer.step = lambda: grads.append([p.grad.clone() for p in actor.model.parameters()])
    batch = make_batch()
    mask = batch.get("response_mask")
    batch.put("ref_log_probs", (batch.get("old_log_probs") - 0.3).masked_fill(~mask, 0.0), "reference", "ref")
    metrics = actor.update(batch, V0, 0, 1, kl_coef=0.1)
    return metrics, grads[0]


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_actor_loss_and_gradients_are_invariant_to_the_partition(mode):
    kl = ("algorithm.kl_coef=0.1", "algorithm.kl_in=loss", f"actor.loss_agg={mode}")
    m0, g0 = _update_grads(_actor(*kl))
    for extra, fast in ((["actor.max_tokens_per_micro_batch=12"], False),
                        (["actor.max_tokens_per_micro_batch=25", "actor.logit_chunk_tokens=5"], True)):
        m1, g1 = _update_grads(_actor(*kl, *extra, fast=fast))
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (extra, k)
        for a, b in zip(g0, g1):
            assert (a - b).abs().max() <= 1e-6 * max(1.0, float(a.abs().max())), extra


def test_old_log_probs_and_reference_passes_keep_the_batch_order():
    model, batch = make_model(), make_batch()
    lp0, _ = batch_log_probs(model, batch, 1.0, 0, 16)
    lp1, _ = batch_log_probs(model, batch, 1.0, 0, 16, tf=TeacherForcing(max_tokens=14, pack=True, chunk=4))
    assert len(TeacherForcing(max_tokens=14).micro_batches([len(s.prompt_ids) + len(s.response_ids)
                                                            for s in batch.samples])) > 2
    assert (lp0 - lp1).abs().max() <= 1e-6


def test_critic_values_and_update_are_invariant_to_the_partition():
    cfg = build_config(None, ["algorithm.name=ppo"])
    out = []
    for tf in (None, TeacherForcing(max_tokens=14, pack=True)):
        torch.manual_seed(0)
        critic = Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, 16, "token-mean", HORIZON, tf=tf)
        batch = make_batch()
        critic.compute(batch)
        returns = batch.get("advantages") + batch.get("values")
        batch.put("returns", returns, "driver", "test")
        grads = []
        critic.optimizer.step = lambda c=critic: grads.append([p.grad.clone() for p in c.model.parameters()])
        out.append((batch.get("values"), batch.get("last_values"), critic.update(batch), grads[0]))
    (v0, l0, m0, g0), (v1, l1, m1, g1) = out
    assert (v0 - v1).abs().max() <= 1e-6 and (l0 - l1).abs().max() <= 1e-6
    assert m1["critic/value_loss"] == pytest.approx(m0["critic/value_loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(g0, g1):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, float(a.abs().max()))


def test_critic_minibatch_epochs_are_invariant_to_the_micro_batch_split():
    """critic.ppo_epochs / mini_batch_size / micro_batch_size of its own: 2 epochs of minibatches
    of 4 take 4 optimizer steps, and the weights after them do not depend on the micro-batch size.
    Adam's eps is raised to 1e-3 so that a gradient element of rounding size (the micro-batch split
    reorders fp32 sums) moves its weight by at most lr * gap / eps ~ 1e-8, far below the bound."""
    cfg = build_config(None, ["algorithm.name=ppo", "critic.lr=1e-3"])
    weights, losses = [], []
    for micro in (1, 3, 8):
        torch.manual_seed(0)
        critic = Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, micro, "token-mean", HORIZON,
                        tf=TeacherForcing(micro_batch_size=micro), epochs=2, mini_batch_size=4, adam_eps=1e-3)
        batch = make_batch()
        critic.compute(batch)
        batch.put("returns", batch.get("advantages") + batch.get("values"), "driver", "test")
        losses.append(critic.update(batch, seed=5)["critic/value_loss"])
        assert critic.step == 4
        weights.append([p.detach().clone() for p in critic.model.parameters()])
    for other, loss in zip(weights[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for a, b in zip(weights[0], other):
            assert (a - b).abs().max() <= 1e-6
    torch.manual_seed(0)   # and the minibatches are real: one full-batch step gives other weights
    one = Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, 8, "token-mean", HORIZON, adam_eps=1e-3)
    batch = make_batch()
    one.compute(batch)
    batch.put("returns", batch.get("advantages") + batch.get("values"), "driver", "test")
    one.update(batch, seed=5)
    assert one.step == 1 and max(float((a - p).abs().max()) for a, p in zip(weights[0], one.model.parameters())) > 1e-4
