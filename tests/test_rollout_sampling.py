"""Sampler: its randomness is a pure function of (seed, step); the inverse-CDF draw is exact."""
from __future__ import annotations

import math

import torch

from sealrl.models.logprobs import token_log_probs
from sealrl.rollout.sampling import (
    Workspace,
    _logsumexp,
    candidate_seed,
    draw,
    filter_logits,
    fmix32,
    sample_step,
    uniform_noise,
)

M32 = 0xFFFFFFFF


def fmix32_reference(h: int) -> int:
    """murmur3 fmix32 in plain Python integers (the published constants)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_tensor_hash_equals_the_integer_reference():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, M32, 123456789, 0xDEADBEEF]
    got = fmix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [fmix32_reference(v) for v in values]


def test_uniforms_depend_on_seed_and_step_only():
    seeds = torch.tensor([candidate_seed(7, c) for c in range(64)])
    block = uniform_noise(seeds, torch.arange(0, 32))  # (64, 32)
    alone = uniform_noise(seeds[9:10], torch.tensor([17]))  # one row, one step, computed alone
    assert alone.item() == block[9, 17].item()
    assert ((block > 0) & (block < 1)).all()
    assert len(set(block.flatten().tolist())) == block.numel()
    # roughly uniform: mean 1/2, variance 1/12 over 2048 draws
    assert abs(block.mean().item() - 0.5) < 0.03 and abs(block.var().item() - 1 / 12) < 0.01


def test_the_candidates_of_a_group_draw_uncorrelated_uniforms():
    """GRPO's spread within a group needs its n samples drawn independently: the uniforms of the
    8 candidates of 500 requests over 64 steps, pairwise, and of the 64 steps of a candidate."""
    requests, n, steps = 500, 8, 64
    seeds = torch.tensor([candidate_seed(1000 + r, c) for r in range(requests) for c in range(n)])
    u = uniform_noise(seeds, torch.arange(steps)).view(requests, n, steps)
    by_candidate = u.transpose(0, 1).reshape(n, -1)   # (8, 32,000)
    by_step = u.reshape(-1, steps).t()                  # (64, 4,000)
    for rows in (by_candidate, by_step):
        r = torch.corrcoef(rows)
        off = r[~torch.eye(len(rows), dtype=torch.bool)].abs().max().item()
        # independent uniforms: each correlation has standard deviation 1/sqrt(N); 5 of them is
        # passed by chance with probability < 1e-6 per pair (at most 2,016 pairs here)
        assert off < 5 / math.sqrt(rows.shape[1])


def test_candidate_seeds_are_stable_and_distinct():
    assert candidate_seed(7, 0) == candidate_seed(7, 0)
    seeds = {candidate_seed(s, c) for s in range(20) for c in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2 ** 63 for s in seeds)


def test_draws_follow_the_softmax():
    """4000 draws over 5 tokens: each frequency within 4.5 sigma of its probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    seeds = torch.tensor([candidate_seed(1, c) for c in range(4000)])
    u = uniform_noise(seeds, torch.tensor([0]))[:, 0]  # (4000,)
    tokens, log_probs, filtered = sample_step(logits, torch.zeros(4000, dtype=torch.long), u, 1.0,
                                              0, 1.0)
    assert filtered is None
    p = torch.softmax(logits[0], -1)
    freq = torch.bincount(tokens, minlength=5).double() / 4000
    sigma = (p * (1 - p) / 4000).sqrt()
    assert ((freq - p).abs() <= 4.5 * sigma).all(), (freq, p)
    assert torch.allclose(log_probs, p.log()[tokens].float())


def test_a_zero_probability_token_is_never_drawn_even_at_the_edges():
    z = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]]).expand(4, -1)
    cdf = torch.softmax(z.double(), -1).cumsum(-1)
    u = torch.tensor([0.0, 1e-300, 1.0 - 2.0 ** -52, 1.0], dtype=torch.float64)
    assert draw(cdf, cdf[:, -1:], u).tolist() == [1, 1, 3, 3]


def test_filters_keep_top_k_then_nucleus():
    z = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(z, 2, 1.0)).tolist() == [[False, True, False, True, True]]
    p = torch.softmax(z, -1)[0]  # sorted: 0.63, 0.23, 0.086, ...
    nucleus = filter_logits(z, 0, 0.8)
    assert torch.isinf(nucleus).tolist() == [[False, True, False, True, True]]
    assert p[0] + p[2] >= 0.8 > p[0]
    only_top = filter_logits(z, 0, 0.01)  # the most likely token always stays
    assert (~torch.isinf(only_top)).sum() == 1 and not math.isinf(only_top[0, 0].item())


def test_filtered_sampling_stays_inside_and_reports_both_log_probs():
    logits = torch.randn(300, 10, generator=torch.Generator().manual_seed(0))
    seeds = torch.tensor([candidate_seed(3, c) for c in range(300)])
    u = uniform_noise(seeds, torch.tensor([2]))[:, 0]
    tokens, log_probs, filtered = sample_step(logits, torch.arange(300), u, 0.7, 3, 1.0)
    top3 = (logits / 0.7).topk(3, -1).indices
    assert (top3 == tokens[:, None]).any(-1).all()
    z = logits / 0.7
    assert torch.allclose(log_probs, torch.log_softmax(z, -1).gather(-1, tokens[:, None])[:, 0])
    kept = z.masked_fill(z < z.topk(3, -1).values[:, -1:], float("-inf"))
    assert torch.allclose(filtered, torch.log_softmax(kept, -1).gather(-1, tokens[:, None])[:, 0])


def test_state_level_log_probs_are_the_training_formula_exactly():
    """Rows sharing a state: the log-probs equal token_log_probs on each row's own logits."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    u = uniform_noise(torch.tensor([candidate_seed(5, c) for c in range(6)]), torch.tensor([0]))[:, 0]
    tokens, log_probs, _ = sample_step(logits, rows, u, 0.7, 0, 1.0)
    assert torch.equal(log_probs, token_log_probs(logits[rows], tokens, 0.7))


def _naive_step(logits, rows, u, temperature):
    """The step written out with fresh tensors: softmax in float64, cumulative sum, first
    index whose cumulative mass exceeds u * total (kept below the total), log_softmax."""
    z = logits.float() / temperature
    cdf = torch.softmax(z.double(), dim=-1).cumsum(-1)[rows]
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens, z[rows, tokens] - torch.logsumexp(z, dim=-1)[rows]


def test_a_reused_workspace_changes_no_bit():
    """One Workspace through steps that grow, shrink and regrow (stale contents left behind):
    every draw and log-prob is bitwise the fresh-tensor computation."""
    g = torch.Generator().manual_seed(3)
    work = Workspace()
    for U, V, rows, temperature in [(4, 3000, [0, 1, 2, 3], 1.0), (2, 500, [0, 0, 1], 0.7),
                                    (6, 4000, [5, 0, 0, 3], 1.3), (1, 7, [0, 0], 1.0)]:
        logits = torch.randn(U, V, generator=g) * 4
        logits[0, : V // 3] = float("-inf")  # masked entries: exp(-inf) = 0 mass
        rows_t = torch.tensor(rows)
        u = torch.rand(len(rows), generator=g, dtype=torch.float64)
        tokens, log_probs, filtered = sample_step(logits, rows_t, u, temperature, 0, 1.0, work)
        want_tokens, want_lp = _naive_step(logits, rows_t, u, temperature)
        assert filtered is None
        assert torch.equal(tokens, want_tokens) and torch.equal(log_probs, want_lp)
        assert not torch.isinf(logits[rows_t, tokens]).any()  # never a zero-mass token


def test_workspace_logsumexp_is_torch_logsumexp_bitwise():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(5, 2000, generator=g) * 30
    z[1, :1999] = float("-inf")  # one finite entry: its value exactly
    z[2] = float("-inf")         # all masked: -inf, as torch gives
    got = _logsumexp(z, Workspace())
    assert torch.equal(got, torch.logsumexp(z, dim=-1))
    assert got[1].item() == z[1, 1999].item() and got[2].item() == float("-inf")
