"""Options of the actor's teacher-forced passes that change speed, not numbers: the update with
them equals the update without, through the actor's own code (Actor.compute_old_log_probs, the
fused forward, Actor.update with KL in the loss)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sealrl.config import build_config
from sealrl.experience import Role
from sealrl.models import chunked, lean_forward
from sealrl.roles.actor import Actor
from sealrl.roles.common import teacher_forcing
from tests.test_actor_kl_correction import make_actor, recompute_batch, weights
from tests.test_placement_dp import HORIZON, V0, make_model


def update_with(keep: bool, pack: bool) -> tuple[dict, dict, torch.Tensor]:
    actor = make_actor("actor.logit_chunk_tokens=5", "algorithm.kl_coef=0.05", "algorithm.kl_in=loss")
    actor.tf = dataclasses.replace(actor.tf, keep_logits=keep, pack=pack)   # the fast path keeps them
    batch = recompute_batch(0.0, 0.0)
    actor.compute_old_log_probs(batch, V0)
    old = batch.get("old_log_probs")
    batch.put("ref_log_probs", (old - 0.3).masked_fill(~batch.get("response_mask"), 0.0), Role.REFERENCE, "ref")
    metrics = actor.update(batch, V0, 0, 1, kl_coef=0.05)
    return metrics, weights(actor), old


@pytest.mark.parametrize("pack", [False, True])
def test_kept_chunk_logits_update_bit_for_bit(monkeypatch, pack):
    calls = []
    logits = chunked._logits
    monkeypatch.setattr(chunked, "_logits", lambda *a: calls.append(1) or logits(*a))
    m0, w0, old0 = update_with(False, pack)
    recomputed, calls[:] = len(calls), []
    m1, w1, old1 = update_with(True, pack)
    # 8 samples, 32 response tokens, chunks of 5: 7 head matmuls forward, 7 again in the backward
    assert (recomputed, len(calls)) == (14, 7)
    assert torch.equal(old0, old1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert m0["actor/pg_loss"] == m1["actor/pg_loss"] and m0["actor/grad_norm"] == m1["actor/grad_norm"]
    assert m0["actor/kl_loss"] > 0  # the KL term took part


def test_the_update_step_run_as_the_old_log_prob_pass_is_the_separate_one(monkeypatch):
    """The fast path with one optimizer step over several micro-batches: given `fuse`, the
    first step's forward and backward run as the old log-prob pass (old log-probs taken from
    it), and the update only steps. The old log-probs, metrics and weights equal those of a
    separate old log-prob forward followed by the whole update, bit for bit, once both passes
    use one attention kernel (the lean forward picks the math kernel for short rows only with
    gradients on: a rounding difference between a no-grad pass and the update's forward)."""
    monkeypatch.setattr(lean_forward, "MATH_ATTENTION_MAX_LEN", 0)
    out = []
    for fuse in (None, (0, 1, 0.05)):
        cfg = build_config(None, ["actor.micro_batch_size=2", "actor.lr=1e-3", "algorithm.kl_coef=0.05",
                                  "algorithm.kl_in=loss"])
        model = make_model()
        actor = Actor(model, cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON,
                      tf=teacher_forcing(cfg.actor, model, exact=False, group=2), exact=False)
        batch = recompute_batch(0.0, 0.0)
        ref = (batch.get("rollout_log_probs") - 0.1).masked_fill(~batch.get("response_mask"), 0.0)
        batch.put("ref_log_probs", ref, Role.REFERENCE, "ref")
        actor.compute_old_log_probs(batch, V0, fuse)
        metrics = actor.update(batch, V0, 0, 1, kl_coef=0.05)
        assert metrics["actor/first_step_in_old_pass"] == float(fuse is not None)
        out.append((batch.get("old_log_probs"), metrics, weights(actor)))
    (old0, m0, w0), (old1, m1, w1) = out
    assert torch.equal(old0, old1)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ratio_mean"):
        assert m0[k] == m1[k], k
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
