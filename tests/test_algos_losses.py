"""Golden values for sealrl.algos.losses, derived by hand in the comments."""
import math

import pytest
import torch
from torch.testing import assert_close

from sealrl.algos import (
    POLICY_LOSSES,
    LossNormaliser,
    aggregate,
    entropy_from_logits,
    gspo_loss,
    make_normaliser,
    policy_gradient_loss,
    ppo_clip_loss,
    value_loss,
)

t = torch.tensor
NAN = float("nan")

# ---- aggregation -------------------------------------------------------------------------

MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
LOSS = t([[1.0, 2.0, 3.0, NAN], [4.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])  # NaN at padding


def test_make_normaliser_counts():
    n = make_normaliser(MASK, "token-mean")
    # 3 + 1 valid tokens; rows 0 and 1 are non-empty; horizon defaults to the width 4
    assert (n.num_tokens, n.num_seqs, n.horizon) == (4, 2, 4.0)
    assert make_normaliser(MASK, "seq-mean-token-sum-norm", horizon=8).horizon == 8.0


@pytest.mark.parametrize("mode, want", [
    ("token-mean", 2.5),                   # (1+2+3+4) / 4 tokens
    ("seq-mean-token-mean", 3.0),          # (6/3 + 4/1) / 2 seqs
    ("seq-mean-token-sum", 5.0),           # (6 + 4) / 2 seqs
    ("seq-mean-token-sum-norm", 0.625),    # (6 + 4) / (2 seqs * horizon 8)
])
def test_aggregate_golden(mode, want):
    norm = make_normaliser(MASK, mode, horizon=8)
    assert_close(aggregate(LOSS, MASK, norm), t(want))


def test_aggregate_micro_batch_shares_sum_to_full():
    norm = make_normaliser(MASK, "token-mean")
    # share of row 0 = 6/4, share of rows 1-2 = 4/4; the sum is the full 2.5
    assert_close(aggregate(LOSS[:1], MASK[:1], norm), t(1.5))
    assert_close(aggregate(LOSS[1:], MASK[1:], norm), t(1.0))
    norm = make_normaliser(MASK, "seq-mean-token-mean")
    # row 0: (6/3)/2 = 1, row 1: (4/1)/2 = 2
    assert_close(aggregate(LOSS[:1], MASK[:1], norm), t(1.0))
    assert_close(aggregate(LOSS[1:], MASK[1:], norm), t(2.0))


def test_all_masked_batch_gives_zero():
    mask = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                 "seq-mean-token-sum-norm"):
        assert_close(aggregate(torch.ones(2, 3), mask, make_normaliser(mask, mode)), t(0.0))


def test_normaliser_validation():
    with pytest.raises(ValueError, match="mode"):
        LossNormaliser(mode="token-sum", num_tokens=1, num_seqs=1, horizon=1.0)
    with pytest.raises(ValueError, match="horizon"):
        LossNormaliser(mode="token-mean", num_tokens=1, num_seqs=1, horizon=0.0)


# ---- PPO ---------------------------------------------------------------------------------

def _ppo_batch():
    # old = 0, so log_prob is the log-ratio. Tokens: (log ratio, A)
    #   t0 (0.5, +1)   t1 (-0.5, -1)   t2 (0.1, +2)   |   t3 (0.5, -1)   pad   pad
    # padding holds garbage that would overflow exp() and poison a product with 0
    log_prob = t([[0.5, -0.5, 0.1], [0.5, 1e4, 1e4]], requires_grad=True)
    old = t([[0.0, 0.0, 0.0], [0.0, -1e4, -1e4]])
    adv = t([[1.0, -1.0, 2.0], [-1.0, 1e6, 1e6]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    return log_prob, old, adv, mask


def test_ppo_golden_value_gradient_metrics():
    log_prob, old, adv, mask = _ppo_batch()
    loss, metrics = ppo_clip_loss(log_prob, old, adv, mask, make_normaliser(mask, "token-mean"))
    e5, e1 = math.exp(0.5), math.exp(0.1)
    # t0: r = e^0.5 = 1.6487 > 1.2, A > 0 -> clipped, l = -1.2            (no gradient)
    # t1: r = e^-0.5 = 0.6065 < 0.8, A < 0 -> max(0.6065, 0.8) = 0.8     (no gradient)
    # t2: r = e^0.1 = 1.1052 inside, l = -2 * 1.1052 = -2.2103
    # t3: r = 1.6487, A < 0 -> max(1.6487, 1.2) = 1.6487 (pessimistic: unclipped)
    # token-mean over 4 tokens: (-1.2 + 0.8 - 2.2103 + 1.6487) / 4 = -0.2404
    assert_close(loss, t((-1.2 + 0.8 - 2 * e1 + e5) / 4))
    loss.backward()
    # d l / d log_prob = -A r / 4 on unclipped tokens: t2: -2 e^0.1 / 4, t3: +e^0.5 / 4
    assert_close(log_prob.grad, t([[0.0, 0.0, -2 * e1 / 4], [e5 / 4, 0.0, 0.0]]))
    assert_close(metrics["clip_frac_upper"], t(0.25))   # t0
    assert_close(metrics["clip_frac_lower"], t(0.25))   # t1
    assert_close(metrics["clip_frac_dual"], t(0.0))
    ratios = [e5, math.exp(-0.5), e1, e5]
    assert_close(metrics["ratio_mean"], t(sum(ratios) / 4))
    assert_close(metrics["ratio_max"], t(e5))
    # approx_kl = mean(r - 1 - log r) = (0.14872 + 0.10653 + 0.00517 + 0.14872) / 4
    assert_close(metrics["approx_kl"], t(sum(r - 1 - math.log(r) for r in ratios) / 4))
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_ppo_clip_higher():
    mask = t([[1, 1, 1]])
    log_prob = t([[0.2, 0.5, -0.5]])
    adv = t([[1.0, 1.0, -1.0]])
    norm = make_normaliser(mask, "seq-mean-token-sum")  # plain sum for 1 sequence
    # clip_high 0.28: t0 r = e^0.2 = 1.2214 < 1.28 -> -1.2214 (with 0.2 it would be -1.2)
    #                 t1 r = e^0.5 = 1.6487 > 1.28 -> -1.28
    #                 t2 r = e^-0.5 = 0.6065 < 0.8, A < 0 -> 0.8 (clip_low unchanged)
    loss, m = ppo_clip_loss(log_prob, torch.zeros(1, 3), adv, mask, norm, clip_high=0.28)
    assert_close(loss, t(-math.exp(0.2) - 1.28 + 0.8))
    assert_close(m["clip_frac_upper"], t(1 / 3))
    loss_sym, _ = ppo_clip_loss(log_prob, torch.zeros(1, 3), adv, mask, norm)
    assert_close(loss_sym, t(-1.2 - 1.2 + 0.8))


def test_ppo_dual_clip():
    mask = t([[1, 1, 1]])
    log_prob = t([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    adv = t([[-1.0, -1.0, 1.0]])
    norm = make_normaliser(mask, "token-mean")
    # t0: A < 0, r = 5: PPO gives max(5, 1.2) = 5; dual-clip bounds it: min(5, 3 * 1) = 3
    # t1: A < 0, r = 2 < 3: stays max(2, 1.2) = 2, gradient r / 3 = 2/3
    # t2: A > 0: dual-clip does not apply; r = 5 > 1.2 -> -1.2
    loss, m = ppo_clip_loss(log_prob, torch.zeros(1, 3), adv, mask, norm, dual_clip=3.0)
    assert_close(loss, t((3.0 + 2.0 - 1.2) / 3))
    loss.backward()
    assert_close(log_prob.grad, t([[0.0, 2 / 3, 0.0]]))
    assert_close(m["clip_frac_dual"], t(1 / 3))
    no_dual, _ = ppo_clip_loss(log_prob, torch.zeros(1, 3), adv, mask, norm)
    assert_close(no_dual, t((5.0 + 2.0 - 1.2) / 3))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(log_prob, torch.zeros(1, 3), adv, mask, norm, dual_clip=1.0)


def test_ppo_is_weights():
    log_prob, old, adv, mask = _ppo_batch()
    w = t([[0.5, 1.0, 2.0], [1.0, 9.0, 9.0]])
    loss, _ = ppo_clip_loss(log_prob, old, adv, mask, make_normaliser(mask, "token-mean"),
                            is_weights=w)
    # per-token losses of the golden test times w: -1.2*0.5, 0.8, -2.2103*2, 1.6487
    assert_close(loss, t((-0.6 + 0.8 - 4 * math.exp(0.1) + math.exp(0.5)) / 4))


# ---- GSPO --------------------------------------------------------------------------------

def test_gspo_golden():
    # row 0: log ratios [0.2, 0.4], A = +1;  row 1: [0.1, -0.1, 0.0], A = -2
    log_prob = t([[0.2, 0.4, 1e4], [0.1, -0.1, 0.0]], requires_grad=True)
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([[1.0, 1.0, 1e6], [-2.0, -2.0, -2.0]])
    norm = make_normaliser(mask, "seq-mean-token-mean")
    loss, m = gspo_loss(log_prob, torch.zeros(2, 3), adv, mask, norm, clip_low=0.2, clip_high=0.2)
    # s_0 = e^((0.2+0.4)/2) = e^0.3 = 1.3499 > 1.2, A > 0 -> clipped: -1.2 on both tokens
    # s_1 = e^0 = 1 -> -A s = 2 on each token
    # seq-mean-token-mean: (-1.2 + 2) / 2 = 0.4
    assert_close(loss, t(0.4))
    loss.backward()
    # row 0 clipped -> 0; row 1: (1/2 seqs)(1/3 tokens)(-A = 2)(s = 1) = 1/3 per token
    assert_close(log_prob.grad, t([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    assert_close(m["clip_frac_upper"], t(2 / 5))  # the 2 tokens of row 0, of 5 valid tokens
    assert_close(m["ratio_mean"], t((2 * math.exp(0.3) + 3) / 5))
    assert_close(m["ratio_max"], t(math.exp(0.3)))
    xs = [0.2, 0.4, 0.1, -0.1, 0.0]
    assert_close(m["approx_kl"], t(sum(math.exp(x) - 1 - x for x in xs) / 5))


def test_gspo_gradient_equals_sequence_level_objective():
    g = torch.Generator().manual_seed(0)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    old = 0.1 * torch.randn(3, 4, generator=g)
    log_prob = (old + 0.1 * torch.randn(3, 4, generator=g)).requires_grad_()
    seq_adv = t([0.7, -1.3, 0.4])
    adv = seq_adv[:, None].expand(3, 4)
    norm = make_normaliser(mask, "seq-mean-token-mean")
    loss, _ = gspo_loss(log_prob, old, adv, mask, norm, clip_low=0.99, clip_high=100.0)
    (grad,) = torch.autograd.grad(loss, log_prob)
    # the paper's objective, unclipped: mean_i -A_i exp(mean_t (log_prob - old))
    lp = log_prob.detach().clone().requires_grad_()
    s = (((lp - old) * mask).sum(-1) / mask.sum(-1)).exp()
    want_loss = (-seq_adv * s).mean()
    (want_grad,) = torch.autograd.grad(want_loss, lp)
    assert_close(loss, want_loss)
    assert_close(grad, want_grad)


# ---- PG, registry ------------------------------------------------------------------------

def test_policy_gradient_golden():
    log_prob = t([[-1.0, -2.0], [-0.5, -1e9]], requires_grad=True)
    adv = t([[1.0, 1.0], [-2.0, 1e6]])
    mask = t([[1, 1], [1, 0]])
    loss, metrics = policy_gradient_loss(log_prob, adv, mask, make_normaliser(mask, "token-mean"))
    # -A logp: [1, 2, -1] -> mean 2/3;  gradient -A / 3
    assert_close(loss, t(2 / 3))
    loss.backward()
    assert_close(log_prob.grad, t([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))
    assert metrics == {}


def test_registry_on_policy_ppo_has_pg_gradient():
    log_prob, _, adv, mask = _ppo_batch()
    norm = make_normaliser(mask, "token-mean")
    assert {"clip", "gspo", "pg"} <= set(POLICY_LOSSES)
    grads = {}
    for name in ("clip", "pg"):
        lp = log_prob.detach().clone().requires_grad_()
        loss, _ = POLICY_LOSSES[name](lp, lp.detach(), adv, mask, norm)
        (grads[name],) = torch.autograd.grad(loss, lp)
    # ratio = 1 everywhere: PPO's gradient is -A grad logp / N, the REINFORCE gradient
    assert_close(grads["clip"], t([[-0.25, 0.25, -0.5], [0.25, 0.0, 0.0]]))
    assert_close(grads["pg"], grads["clip"])


# ---- value loss, entropy -----------------------------------------------------------------

def test_value_loss_clipped_golden():
    values = t([[1.0, 2.0, 3.0], [7.0, 7.0, 7.0]], requires_grad=True)
    old = t([[1.5, 1.5, 3.0], [1e6, 1e6, 1e6]])
    returns = t([[2.0, 2.5, 3.5], [-1e6, -1e6, -1e6]])
    mask = t([[1, 1, 1], [0, 0, 0]])
    loss, m = value_loss(values, old, returns, mask, make_normaliser(mask, "token-mean"),
                         clip_eps=0.2)
    # t0: (1-2)^2 = 1; V_clip = 1.5 - 0.2 = 1.3, (1.3-2)^2 = 0.49 -> 0.5 * 1 = 0.5
    # t1: (2-2.5)^2 = 0.25; V_clip = 1.5 + 0.2 = 1.7, (1.7-2.5)^2 = 0.64 -> 0.5 * 0.64 = 0.32 (clipped)
    # t2: (3-3.5)^2 = 0.25; V_clip = 3 -> tie 0.25 -> 0.125
    assert_close(loss, t((0.5 + 0.32 + 0.125) / 3))
    assert_close(m["value_clip_frac"], t(1 / 3))
    loss.backward()
    # gradient (V - R)/3 where the unclipped term wins; 0 where the clipped one does
    assert_close(values.grad, t([[-1 / 3, 0.0, -1 / 6], [0.0, 0.0, 0.0]]))


def test_value_loss_unclipped_golden():
    values = t([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = t([[1, 1, 1]])
    loss, m = value_loss(values, t([[1.5, 1.5, 3.0]]), t([[2.0, 2.5, 3.5]]), mask,
                         make_normaliser(mask, "token-mean"))
    # 0.5 * [1, 0.25, 0.25] -> mean 0.25
    assert_close(loss, t(0.25))
    assert_close(m["value_clip_frac"], t(0.0))


def test_entropy_golden():
    # uniform over 4: ln 4
    assert_close(entropy_from_logits(torch.zeros(2, 4)), t([math.log(4)] * 2))
    # p = [1/4, 3/4]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    h = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    assert_close(entropy_from_logits(t([0.0, math.log(3)])), t(h))
    # huge logits (1e4 and 1e4 + 1 are exact in float32): same entropy as [0, 1], no overflow
    # and no cancellation. [0, 1]: p1 = e/(1+e) = 0.7311; H = ln(1+e) - p1 = 0.5822
    e = math.e
    assert_close(entropy_from_logits(t([1e4, 1e4 + 1.0])), t(math.log(1 + e) - e / (1 + e)))


def test_entropy_with_filtered_vocab_has_finite_gradient():
    logits = t([0.0, math.log(3), float("-inf")], requires_grad=True)
    h = entropy_from_logits(logits)
    assert_close(h, t(0.25 * math.log(4) + 0.75 * math.log(4 / 3)))
    h.backward()
    assert torch.isfinite(logits.grad).all()
    # dH/dz_i = -p_i (log p_i + H): p0 = 1/4 -> -0.25 (ln 0.25 + H); the -inf entry gets 0
    assert_close(logits.grad[0], t(-0.25 * (math.log(0.25) + h.item())))
    assert logits.grad[2].item() == 0.0


def test_policy_ratio_and_stats_golden():
    from sealrl.algos import policy_ratio, ratio_stats
    # the PPO golden batch: valid log-ratios 0.5, -0.5, 0.1 | 0.5 (padding ignored)
    log_prob, old, adv, mask = _ppo_batch()
    r = policy_ratio(log_prob, old, mask)
    e5, e1, em5 = math.exp(0.5), math.exp(0.1), math.exp(-0.5)
    assert_close(r, t([e5, em5, e1, e5]))
    assert not r.requires_grad
    # sorted: e^-0.5, e^0.1, e^0.5, e^0.5; p50 at position 1.5: (e^0.1 + e^0.5) / 2;
    # p99 at position 0.99 * 3 = 2.97, between two e^0.5: e^0.5
    s = ratio_stats(r)
    assert (float(s["ratio_min"]), float(s["ratio_max"])) == pytest.approx((em5, e5))
    assert float(s["ratio_p50"]) == pytest.approx((e1 + e5) / 2)
    assert float(s["ratio_p99"]) == pytest.approx(e5)
    # sequence level (gspo): row 0 mean log-ratio (0.5 - 0.5 + 0.1) / 3 = 1/30, row 1 0.5
    assert_close(policy_ratio(log_prob, old, mask, level="sequence"),
                 t([math.exp(1 / 30)] * 3 + [e5]))
    assert {k: float(v) for k, v in ratio_stats(torch.zeros(0)).items()} == dict.fromkeys(s, 1.0)
