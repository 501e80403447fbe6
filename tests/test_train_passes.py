"""Options of the actor's teacher-forced passes that change speed, not numbers: the update with
them equals the update without, through the actor's own code (Actor.compute_old_log_probs, the
fused forward, Actor.update with KL in the loss)."""
from __future__ import annotations

import pytest
import torch

from sealrl.experience import Role
from sealrl.models import chunked
from tests.test_actor_kl_correction import make_actor, recompute_batch, weights
from tests.test_placement_dp import V0


def update_with(*overrides: str) -> tuple[dict, dict, torch.Tensor]:
    actor = make_actor("actor.logit_chunk_tokens=5", "algorithm.kl_coef=0.05", "algorithm.kl_in=loss", *overrides)
    batch = recompute_batch(0.0, 0.0)
    actor.compute_old_log_probs(batch, V0)
    old = batch.get("old_log_probs")
    batch.put("ref_log_probs", (old - 0.3).masked_fill(~batch.get("response_mask"), 0.0), Role.REFERENCE, "ref")
    metrics = actor.update(batch, V0, 0, 1, kl_coef=0.05)
    return metrics, weights(actor), old


@pytest.mark.parametrize("layout", [(), ("actor.pack_sequences=true",)])
def test_kept_chunk_logits_update_bit_for_bit(monkeypatch, layout):
    calls = []
    logits = chunked._logits
    monkeypatch.setattr(chunked, "_logits", lambda *a: calls.append(1) or logits(*a))
    m0, w0, old0 = update_with(*layout)
    recomputed, calls[:] = len(calls), []
    m1, w1, old1 = update_with("actor.logit_chunk_keep=true", *layout)
    # 8 samples, 32 response tokens, chunks of 5: 7 head matmuls forward, 7 again in the backward
    assert (recomputed, len(calls)) == (14, 7)
    assert torch.equal(old0, old1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert m0["actor/pg_loss"] == m1["actor/pg_loss"] and m0["actor/grad_norm"] == m1["actor/grad_norm"]
    assert m0["actor/kl_loss"] > 0  # the KL term took part
