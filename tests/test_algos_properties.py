"""Property tests of sealrl.algos: invariances that must hold for every input, not just goldens."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import sealrl.algos as A

SETTINGS = settings(max_examples=40, deadline=None)
# dyadic scores sum exactly in float32, so a permutation cannot change a group mean by an ulp;
# 0.1 (inexact) checks that equal scores still give exactly-zero-variance groups
SCORE = st.one_of(st.integers(-12, 12).map(lambda k: k / 4), st.just(0.1))


@st.composite
def grouped_batches(draw, max_len=5):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    ids = draw(st.lists(st.integers(0, 10**9), min_size=len(sizes), max_size=len(sizes), unique=True))
    group_index = [ids[g] for g, size in enumerate(sizes) for _ in range(size)]
    n = len(group_index)
    scores = draw(st.lists(SCORE, min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    mask = (torch.arange(max_len) < torch.tensor(lengths)[:, None]).long()
    perm = torch.tensor(draw(st.permutations(range(n))))
    return torch.tensor(scores), torch.tensor(group_index), mask, perm


@SETTINGS
@given(grouped_batches())
def test_permuting_samples_never_changes_their_advantage(batch):
    scores, groups, mask, perm = batch
    adv, zero_var = A.grpo_advantages(scores, groups)
    adv_p, zero_var_p = A.grpo_advantages(scores[perm], groups[perm])
    assert_close(adv_p, adv[perm])
    assert torch.equal(zero_var_p, zero_var[perm])
    assert_close(A.rloo_advantages(scores[perm], groups[perm]),
                 A.rloo_advantages(scores, groups)[perm])
    kl_rewards = -0.1 * torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape) / 7
    base = A.reinforce_pp_baseline_advantages(scores, groups, mask, kl_rewards)
    base_p = A.reinforce_pp_baseline_advantages(scores[perm], groups[perm], mask[perm],
                                                kl_rewards[perm])
    assert_close(base_p, base[perm])
    lengths = mask.sum(-1)
    assert_close(A.opo_advantages(scores[perm], groups[perm], lengths[perm]),
                 A.opo_advantages(scores, groups, lengths)[perm])
    assert_close(A.gpg_advantages(scores[perm], groups[perm]), A.gpg_advantages(scores, groups)[perm])
    # a tie for the best has margin 0, so which tied sample "wins" cannot matter
    assert_close(A.passk_advantages(scores[perm], groups[perm]), A.passk_advantages(scores, groups)[perm])


def _policy_loss(name):
    def fn(lp, old, adv, mask, norm, returns):
        return A.POLICY_LOSSES[name](lp, old, adv, mask, norm)
    return fn


LOSS_FNS = {
    "clip": _policy_loss("clip"),
    "gspo": _policy_loss("gspo"),
    "pg": _policy_loss("pg"),
    "value": lambda v, old, adv, mask, norm, returns: A.value_loss(v, old, returns, mask, norm, 0.2),
}


@SETTINGS
@given(rows=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=6),
       cuts=st.lists(st.integers(1, 5), max_size=4), mode=st.sampled_from(A.AGG_MODES),
       loss_name=st.sampled_from(sorted(LOSS_FNS)), seed=st.integers(0, 2**16))
def test_micro_batch_split_equals_full_batch(rows, cuts, mode, loss_name, seed):
    mask = torch.tensor(rows, dtype=torch.long)  # may contain empty rows and holes
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    old = 0.3 * torch.randn(B, T, generator=g)
    x = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, T, generator=g)
    returns = torch.randn(B, T, generator=g)
    norm = A.make_normaliser(mask, mode, horizon=8)  # once, over the whole batch
    loss_fn = LOSS_FNS[loss_name]

    full, _ = loss_fn(x, old, adv, mask, norm, returns)
    (grad_full,) = torch.autograd.grad(full, x)

    bounds = [0] + sorted({c for c in cuts if c < B}) + [B]
    total = x.new_zeros(())
    for a, b in zip(bounds[:-1], bounds[1:]):
        # each micro-batch is trimmed to its own widest row, as a packer would do
        valid_cols = mask[a:b].any(0).nonzero()
        w = int(valid_cols.max()) + 1 if len(valid_cols) else 1
        sl = (slice(a, b), slice(0, w))
        share, _ = loss_fn(x[sl], old[sl], adv[sl], mask[sl], norm, returns[sl])
        total = total + share
    (grad_split,) = torch.autograd.grad(total, x)
    assert_close(total, full)
    assert_close(grad_split, grad_full)


@SETTINGS
@given(length=st.integers(1, 6), pad=st.integers(0, 3),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
       last_value=st.floats(-10.0, 10.0), seed=st.integers(0, 2**16))
def test_gae_truncated_minus_terminated_is_the_bootstrap(length, pad, gamma, lam, last_value, seed):
    T = length + pad
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(1, T, generator=g), torch.randn(1, T, generator=g)
    mask = (torch.arange(T) < length).long()[None]
    lv = torch.tensor([last_value])
    adv_trunc, ret_trunc = A.gae(rewards, values, mask, torch.tensor([False]), lv, gamma, lam)
    adv_term, ret_term = A.gae(rewards, values, mask, torch.tensor([True]), lv, gamma, lam)
    # delta at t = (gamma lam)^(L-1-t) * gamma * last_value on valid tokens, 0 at padding
    powers = torch.clamp(length - 1 - torch.arange(T), min=0).double()
    want = torch.where(mask[0].bool(), (gamma * lam) ** powers * gamma * last_value, 0.0)
    want = want[None].float()
    assert_close(adv_trunc - adv_term, want, atol=1e-4, rtol=1e-4)
    assert_close(ret_trunc - ret_term, want, atol=1e-4, rtol=1e-4)


def _assert_finite(*tensors):
    for x in tensors:
        assert torch.isfinite(x).all(), x


@SETTINGS
@given(grouped_batches(max_len=4), st.sampled_from(A.AGG_MODES))
def test_degenerate_batches_never_give_nan_or_inf(batch, mode):
    scores, groups, mask, _ = batch
    mask[0] = 0  # at least one all-masked row
    B, T = mask.shape
    # advantages: single-sample groups, zero-variance groups and empty rows, with gradients
    s = scores.clone().requires_grad_()
    adv, _ = A.grpo_advantages(s, groups)
    rloo = A.rloo_advantages(s, groups)
    base = A.reinforce_pp_baseline_advantages(s, groups, mask)
    (adv.sum() + rloo.sum() + base.sum()).backward()
    _assert_finite(adv, rloo, base, s.grad)
    token_adv = A.broadcast_to_tokens(adv.detach(), mask)
    shaped = A.shaped_token_rewards(scores, torch.rand(B, T), mask, 0.1)
    _assert_finite(A.reinforce_pp_advantages(shaped, mask), token_adv,
                   *A.gae(shaped, torch.randn(B, T), mask, scores > 0, scores, 1.0, 0.95))
    # losses: the normaliser of a batch whose rows may all be empty
    norm = A.make_normaliser(mask, mode)
    lp = torch.randn(B, T, requires_grad=True)
    losses = [A.POLICY_LOSSES[name](lp, lp.detach() + 0.1, token_adv, mask, norm)[0]
              for name in A.POLICY_LOSSES]
    losses.append(A.value_loss(lp, lp.detach() * 2, shaped, mask, norm, clip_eps=0.2)[0])
    sum(losses).backward()
    _assert_finite(*losses, lp.grad)


def test_no_tensor_is_created_off_the_input_device():
    """Inputs on CPU, default device 'meta': any tensor built without the inputs' device (the
    CUDA bug where a CPU tensor meets CUDA inputs) would land on meta and raise on contact."""
    B, T = 3, 4
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    x, y = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    s, groups = torch.randn(B, generator=g), torch.tensor([5, 5, 2])
    norm = A.make_normaliser(mask, "seq-mean-token-mean")
    outputs = []
    with torch.device("meta"):
        outputs += A.gae(x, y, mask, s > 0, s, 0.9, 0.9)
        outputs += [*A.grpo_advantages(s, groups), A.rloo_advantages(s, groups),
                    A.reinforce_pp_advantages(x, mask),
                    A.reinforce_pp_baseline_advantages(s, groups, mask, x),
                    A.whiten(x, mask, shift_mean=False), A.broadcast_to_tokens(s, mask),
                    A.shaped_token_rewards(s, x, mask, 0.1), A.entropy_from_logits(x),
                    A.remax_advantages(x, s, mask), A.opo_advantages(s, groups, mask.sum(-1)),
                    A.gpg_advantages(s, groups), A.passk_advantages(s, groups), A.sum_pi_squared_from_logits(x),
                    A.optimal_token_baseline_advantages(x, mask, groups, -y.abs(), y.abs())]
        outputs += [A.kl_penalty(x, y, kind) for kind in A.KL_ESTIMATORS]
        outputs += [A.aggregate(x, mask, A.make_normaliser(mask, mode)) for mode in A.AGG_MODES]
        for fn in A.POLICY_LOSSES.values():
            loss, metrics = fn(x.clone().requires_grad_(), y, x, mask, norm, is_weights=y.exp())
            loss.backward()
            outputs += [loss, *metrics.values()]
        loss, metrics = A.value_loss(x, y, x * 2, mask, norm, clip_eps=0.2)
        outputs += [loss, *metrics.values()]
        for level in ("token", "sequence"):
            outputs += [A.importance_weights(x, y, mask, level),
                        A.rejection_mask(x, y, mask, level, threshold=0.1)]
        outputs += A.mismatch_metrics(x, y, mask).values()
    assert all(o.device.type == "cpu" for o in outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    s, groups = torch.randn(3, generator=g), torch.tensor([5, 5, 2])

    def run(dev):
        m, xd, yd, sd, gd = (v.to(dev) for v in (mask, x, y, s, groups))
        norm = A.make_normaliser(m, "token-mean")
        out = [*A.gae(xd, yd, m, sd > 0, sd, 0.9, 0.95), A.grpo_advantages(sd, gd)[0],
               A.reinforce_pp_baseline_advantages(sd, gd, m, xd), A.kl_penalty(xd, yd, "k3")]
        out += [A.POLICY_LOSSES[name](xd, yd, xd, m, norm)[0] for name in A.POLICY_LOSSES]
        return [o.cpu() for o in out]

    for got, want in zip(run("cuda"), run("cpu")):
        assert_close(got, want)
