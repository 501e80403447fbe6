"""The decoupled PPO objective (algos/decoupled.py): values and gradients derived by hand, equal
to the synchronous PPO loss when behaviour = proximal, and what the actor computes on stale
experience with algorithm.correction=token_is."""
import math

import torch

from sealrl.algos.decoupled import decoupled_ppo_loss
from sealrl.algos.losses import make_normaliser, ppo_clip_loss
from sealrl.roles.common import batch_log_probs
from tests.test_actor_kl_correction import make_actor, recompute_batch
from tests.test_placement_dp import V0

MASK = torch.tensor([[True, True, False]])
PROX = torch.tensor([[math.log(0.5), math.log(0.4), 0.0]])
BEHAV = PROX - torch.tensor([[0.5, 1.0, 0.0]])        # pi_prox / pi_behav = e^0.5, e^1 (capped at 2)
ADV = torch.tensor([[1.0, -2.0, 0.0]])


def _log_prob(r1: float, r2: float) -> torch.Tensor:
    return (PROX + torch.tensor([[math.log(r1), math.log(r2), 0.0]])).requires_grad_(True)


def test_values_and_gradients_by_hand():
    """Token 1: r = 1.1, A = 1 (inside the clip range): l = -1.1 w1, dl/dlogp = -1.1 w1.
    Token 2: r = 0.9, A = -2: l = 2 * 0.9 * w2, dl/dlogp = 1.8 w2, w2 = min(e, 2) = 2.
    token-mean over the 2 valid tokens."""
    lp = _log_prob(1.1, 0.9)
    loss, m = decoupled_ppo_loss(lp, PROX, BEHAV, ADV, MASK, make_normaliser(MASK, "token-mean"), cap=2.0)
    w1 = math.exp(0.5)
    assert abs(float(loss.detach()) - (-1.1 * w1 + 1.8 * 2.0) / 2) < 1e-6
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.1 * w1 / 2, 1.8 * 2.0 / 2, 0.0]]), atol=1e-6)
    assert abs(float(m["is_weight_mean"]) - (w1 + 2.0) / 2) < 1e-6 and float(m["is_weight_max"]) == 2.0


def test_the_clip_is_around_the_proximal_policy_not_the_behaviour_one():
    """r = 1.5 > 1.2 with A > 0: the clipped term -1.2 w1 binds and no gradient flows, although
    pi / pi_behav = 1.5 e^0.5 is what the behaviour policy would have clipped at instead."""
    lp = _log_prob(1.5, 0.9)
    loss, m = decoupled_ppo_loss(lp, PROX, BEHAV, ADV, MASK, make_normaliser(MASK, "token-mean"), cap=2.0)
    assert abs(float(loss.detach()) - (-1.2 * math.exp(0.5) + 1.8 * 2.0) / 2) < 1e-6
    loss.backward()
    assert float(lp.grad[0, 0]) == 0.0 and float(m["clip_frac_upper"]) == 0.5


def test_at_staleness_zero_it_is_the_synchronous_loss():
    """behaviour = proximal: every weight is exactly 1, value and gradient bitwise PPO's."""
    torch.manual_seed(0)
    old = -torch.rand(4, 6) * 3
    adv = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.2
    norm = make_normaliser(mask, "seq-mean-token-mean")
    a = (old + 0.3 * torch.randn(4, 6)).requires_grad_(True)
    b = a.detach().clone().requires_grad_(True)
    ours, _ = decoupled_ppo_loss(a, old, old, adv, mask, norm)
    sync, _ = ppo_clip_loss(b, old, adv, mask, norm)
    ours.backward()
    sync.backward()
    assert torch.equal(ours.detach(), sync.detach()) and torch.equal(a.grad, b.grad)


def test_the_actor_on_stale_experience_computes_the_decoupled_loss():
    """Rollout log-probs from a stale behaviour policy (own + delta), old log-probs recomputed
    by the actor (the proximal policy), one optimizer step: the actor's pg_loss is the decoupled
    loss of its log-probs before the step."""
    actor = make_actor("algorithm.correction=token_is", "algorithm.correction_threshold=2.0")
    batch = recompute_batch(0.4, -0.9)
    actor.compute_old_log_probs(batch, V0)
    lp, _ = batch_log_probs(actor.model.eval(), batch, 1.0, 0, 16)
    mask = batch.get("response_mask")
    expected, _ = decoupled_ppo_loss(lp, batch.get("old_log_probs"), batch.get("rollout_log_probs"),
                                     batch.get("advantages"), mask, make_normaliser(mask, "token-mean", 8), cap=2.0)
    metrics = actor.update(batch, V0, 0, 1, kl_coef=0.0)
    assert abs(metrics["actor/pg_loss"] - float(expected)) < 1e-6
