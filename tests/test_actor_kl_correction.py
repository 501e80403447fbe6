"""The actor's loss uses the coefficient the driver's KL controller gives it (the `kl/beta` it
logs), rollout correction changes the update exactly when the rollout and trainer policies
differ, and the actor's ratio and correction metrics equal values computed in the test."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sealrl.algos import AdaptiveKLController
from sealrl.config import build_config
from sealrl.experience import (
    ExperienceBatch,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
    group_id,
    pad_token_rows,
    sample_id,
)
from sealrl.roles.actor import Actor
from sealrl.roles.common import batch_log_probs
from tests.test_placement_dp import HORIZON, RESPONSES, V0, make_batch, make_model, max_diff


def make_actor(*overrides: str) -> Actor:
    cfg = build_config(None, ["actor.micro_batch_size=16", "actor.lr=1e-3", *overrides])
    return Actor(make_model(), cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON)


def weights(actor: Actor) -> dict:
    return {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


# ---- 1. the KL-in-loss coefficient is the controller's beta ----------------------------------

def with_reference(batch: ExperienceBatch) -> ExperienceBatch:
    mask = batch.get("response_mask")
    batch.put("ref_log_probs", (batch.get("old_log_probs") - 0.3).masked_fill(~mask, 0.0), Role.REFERENCE, "ref")
    return batch


def test_the_loss_applies_the_coefficient_it_is_given():
    """One optimizer step over one micro-batch from the same weights: the policy loss and the
    KL term are the same numbers, so pg_loss(c2) - pg_loss(c1) = (c2 - c1) * kl_loss."""
    overrides = ("algorithm.kl_coef=0.05", "algorithm.kl_in=loss")
    low = make_actor(*overrides).update(with_reference(make_batch()), V0, 0, 1, kl_coef=0.05)
    high_actor = make_actor(*overrides)
    high = high_actor.update(with_reference(make_batch()), V0, 0, 1, kl_coef=0.5)
    kl_loss = low["actor/kl_loss"]
    assert kl_loss > 0 and high["actor/kl_loss"] == pytest.approx(kl_loss, rel=1e-6)
    assert high["actor/pg_loss"] - low["actor/pg_loss"] == pytest.approx(0.45 * kl_loss, rel=1e-5)
    none = make_actor(*overrides).update(with_reference(make_batch()), V0, 0, 1, kl_coef=0.0)
    assert "actor/kl_loss" not in none


def test_kl_beta_logged_is_the_coefficient_the_loss_and_the_reward_got(monkeypatch):
    """Through the driver's advantage and update stages with an adaptive controller (target
    0.01, horizon 16, batches of 8 samples, measured KL 0): e = -1 -> -0.2, step -0.2 * 8 / 16
    = -0.1, beta 0.1, 0.09, 0.081."""
    from sealrl.trainer import prepare as prepare_stage
    from sealrl.trainer import update as update_stage
    derived, applied = [], []
    monkeypatch.setattr(prepare_stage, "derive", lambda batch, algo, beta, *a: derived.append(beta) or {})
    monkeypatch.setattr(update_stage, "ref_kl", lambda batch: 0.0)

    class RecordingActor:
        attempt = 0

        def update(self, batch, version, iteration, seed, kl_coef):
            applied.append(kl_coef)
            return {}

    cfg = build_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=16",
                              "run.update_retries=0"])
    run = SimpleNamespace(cfg=cfg, kl_ctl=AdaptiveKLController(0.1, 0.01, 16),
                          roles=SimpleNamespace(actor=RecordingActor(), critic=None),
                          stage=lambda *a: contextlib.nullcontext())
    logged = []
    for it in range(3):   # the advantages (reward-shaping path) before the seal, then the update (loss)
        prepare_stage.advantages(run, list(range(8)), it)
        logged.append(update_stage.update(run, list(range(8)), V0, it)["kl/beta"])
    assert logged == applied == derived
    assert applied == pytest.approx([0.1, 0.09, 0.081])


# ---- 2. rollout correction (recompute mode) -------------------------------------------------

def recompute_batch(delta_first: float, delta_second: float) -> ExperienceBatch:
    """The placement test's 8 samples with no old log-probs yet; rollout log-probs = the
    model's own + delta (delta_first on candidate 0 of each prompt, delta_second on candidate 1),
    so pi_old / pi_rollout = exp(-delta) exactly where the actor recomputes old."""
    metas, adv_rows = [], []
    for k, prompt in enumerate(("p3", "p0", "p2", "p1")):
        g = group_id("run", 0, prompt)
        for c, resp in enumerate(RESPONSES[prompt]):
            metas.append(SampleMeta(sample_id(g, c), g, prompt, (4, 11 + k, 14), resp,
                                    StopReason.EOS if resp[-1] == 2 else StopReason.LENGTH, V0.id, seed=10 * k + c))
            adv_rows.append([(1.0 if c == 0 else -0.7) * (1 + 0.1 * k)] * len(resp))
    batch = ExperienceBatch("run", 0, metas, SamplingContract(max_new_tokens=HORIZON, n=2), [V0])
    w = batch.num_response_tokens
    mask = pad_token_rows([[1] * len(m.response_ids) for m in metas], w, torch.bool)
    batch.put("response_mask", mask, Role.ROLLOUT, V0.id)
    own, _ = batch_log_probs(make_model().eval(), batch, 1.0, 0, 16)
    delta = torch.tensor([delta_first if s.sample_id.endswith("/0") else delta_second for s in metas])
    batch.put("rollout_log_probs", (own + delta[:, None]).masked_fill(~mask, 0.0), Role.ROLLOUT, V0.id)
    batch.put("advantages", pad_token_rows(adv_rows, w, torch.float32), Role.DRIVER, "test")
    return batch


def updated(correction: str, delta_first: float, delta_second: float, *extra: str):
    actor = make_actor(f"algorithm.correction={correction}", "algorithm.correction_threshold=2.0", *extra)
    batch = recompute_batch(delta_first, delta_second)
    actor.compute_old_log_probs(batch, V0)
    return actor.update(batch, V0, 0, 1, kl_coef=0.0), weights(actor)


def test_correction_changes_the_update_only_when_the_policies_differ():
    _, plain = updated("none", 0.5, -1.0)
    _, same = updated("token_is", 0.0, 0.0)     # rollout = old: weights exactly 1
    assert max_diff(same, plain) == 0.0
    # IS caps at 2: weights exp(-0.5) and 2 differ between candidates (a cap of 0.5 would give
    # every token 0.5, a uniform scale that AdamW's first step all but cancels); the rejections
    # at 0.5 keep candidate 0 and reject candidate 1
    for correction, threshold in (("token_is", 2.0), ("seq_is", 2.0), ("token_reject", 0.5), ("seq_reject", 0.5)):
        _, corrected = updated(correction, 0.5, -1.0, f"algorithm.correction_threshold={threshold}")
        assert max_diff(corrected, plain) > 1e-6, correction


def test_correction_metrics_of_the_actor_by_hand():
    # tokens: 16 of candidate-0 samples (1 + 7 + 1 + 7), 16 of candidate-1 samples
    # token_is, cap 2: candidate 0: exp(-0.5) = 0.60653; candidate 1: exp(1) = 2.718 -> 2
    m, _ = updated("token_is", 0.5, -1.0)
    assert m["correction/is_weight_mean"] == pytest.approx((math.exp(-0.5) + 2.0) / 2, rel=1e-5)
    assert m["correction/is_weight_max"] == pytest.approx(2.0, rel=1e-6)
    assert m["correction/is_weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-5)
    assert "correction/rejected_token_frac" not in m
    # token_reject, threshold 0.5 on k3 = e^x - 1 - x, x = old - rollout:
    # candidate 0: x = -0.5 -> 0.1065 kept; candidate 1: x = 1 -> e - 2 = 0.718 rejected
    m, _ = updated("token_reject", 0.5, -1.0, "algorithm.correction_threshold=0.5")
    assert m["correction/rejected_token_frac"] == 0.5          # 16 of 32 tokens
    assert m["correction/rejected_seq_frac"] == 0.5            # 4 of 8 responses
    assert "correction/is_weight_mean" not in m


# ---- 3. ratio quantiles: exact over every micro-batch ---------------------------------------

@pytest.mark.parametrize("loss", ["clip", "gspo"])
def test_ratio_stats_are_over_every_loss_mask_token(loss):
    """8 rows in micro-batches of 3 (the old code weighted each micro-batch's max by its token
    share, which is no max). One optimizer step from the model's weights: the ratios are
    exp(log p - old) of the model's teacher-forced log-probs, computed here with numpy."""
    actor = make_actor("actor.micro_batch_size=3", f"actor.loss={loss}")
    batch = make_batch()   # old = hand-made rows, far from the model: ratios far from 1
    mask = batch.get("response_mask").numpy()
    lp, _ = batch_log_probs(make_model().eval(), batch, 1.0, 0, 16)
    log_ratio = np.where(mask, lp.numpy().astype(np.float64) - batch.get("old_log_probs").numpy(), 0.0)
    if loss == "gspo":   # one ratio per sequence, carried by each of its tokens
        log_ratio = np.repeat(log_ratio.sum(-1, keepdims=True) / mask.sum(-1, keepdims=True), mask.shape[1], 1)
    r = np.exp(np.clip(log_ratio, -20, 20))[mask]
    m = actor.update(batch, V0, 0, 1, kl_coef=0.0)
    assert m["actor/ratio_min"] == pytest.approx(r.min(), rel=1e-4)
    assert m["actor/ratio_max"] == pytest.approx(r.max(), rel=1e-4)
    assert m["actor/ratio_p50"] == pytest.approx(np.percentile(r, 50), rel=1e-4)
    assert m["actor/ratio_p99"] == pytest.approx(np.percentile(r, 99), rel=1e-4)
    assert m["actor/ratio_mean"] == pytest.approx(r.mean(), rel=1e-4)
    assert r.max() / r.min() > 1.5   # the ratios do differ


def test_no_ratio_stats_without_a_ratio():
    m = make_actor("actor.loss=pg").update(make_batch(), V0, 0, 1, kl_coef=0.0)
    assert not [k for k in m if k.startswith("actor/ratio")]
