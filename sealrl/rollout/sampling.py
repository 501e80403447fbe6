"""Batch-invariant sampling: one counter-based uniform per (candidate, step), inverse CDF.

A retry regenerates one candidate alone, and a replica may batch a candidate with any others;
both must reproduce the same response. So the randomness of candidate c at step t is a pure
function of (candidate seed, t): a 52-bit uniform u built from 32-bit integer hashes (murmur3's
fmix32) of those counters. The token is the one whose interval of the cumulative distribution
of softmax(logits/T) (after top-k/top-p, which zero the removed tokens) contains u: a draw
from that distribution, exact up to float64 rounding of the CDF, and a token of probability
zero has an empty interval, so it is never drawn. Given the same logits, the same token
comes out whatever the batch.

Why not Gumbel-max: it needs one noise value per vocabulary entry per step, and on CPU that
noise costs more than the draw. Measured on 2 shared cores, 1 thread, B=128 rows, vocabulary
87: Gumbel noise from the same hash, drawn in blocks of 8 steps, 260 us per step; from one
torch.Generator per row, 330 us per step; this sampler's uniforms for all 32 steps at once,
200 us in total (6 us per step), the draw itself (softmax, cumsum, searchsorted) about 130
us per step with the log-probs. Gumbel noise also grows with the vocabulary (150k tokens x
128 rows per step); one uniform per row does not. The int64 multiplications below wrap
modulo 2**64 on CPU and CUDA alike; only the low 32 bits are kept, so the result is exact.

Buffers: a step's full-vocabulary tensors ((states, V) in fp32 and fp64: 6-25 MB each for a
49k vocabulary) are written into a Workspace that one generate call reuses step after step.
Freshly allocated buffers that large come from the OS each step (glibc returns them on free),
and their page faults cost more than the arithmetic: measured on the 2-core machine, 1 thread,
32 rows x 49,152 tokens, 67 ms per step with fresh buffers against about 20 ms with reused
ones. The same kernels run on the same inputs, so the draws and log-probs are bitwise those
of fresh buffers (tests/test_rollout_sampling.py checks it).
"""
from __future__ import annotations

import torch
from torch import Tensor

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


class Workspace:
    """Named buffers reused across the steps of one generate call (see the module docstring).

    `take(name, shape, dtype)` returns a contiguous view of the named buffer, grown when a
    step needs more elements than any step before; its contents are whatever the last user
    left, so every caller overwrites all of it (out= of the op that fills it).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a 64-bit bijection, full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def candidate_seed(request_seed: int, candidate: int) -> int:
    """63-bit seed of one candidate, a function of (request seed, candidate) only."""
    return _splitmix64(_splitmix64(request_seed & _M64) ^ candidate) >> 1


def fmix32(h: Tensor) -> Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit values; a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seeds: Tensor, steps: Tensor) -> Tensor:
    """Uniforms in (0, 1) for every (seed, step): seeds (B,) int64, steps (S,) -> (B, S) float64.

    Two chained 32-bit hashes give 52 random bits k; u = (k + 0.5) / 2**52 is exact in float64,
    never 0 and never 1.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    step_key = fmix32((steps * 0x9E3779B9 + 0x7F4A7C15) & _M32)  # (S,)
    a = fmix32(lo[:, None] ^ fmix32(hi[:, None] ^ step_key[None, :]))  # (B, S)
    b = fmix32(fmix32(a ^ 0x68E31DA4) ^ hi[:, None])
    k = (a << 20) | (b >> 12)  # 32 + 20 bits
    return (k.double() + 0.5) * 2.0 ** -52


def filter_logits(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set tokens outside top-k, then outside the top-p nucleus, to -inf. z (B, V) -> (B, V).

    Order and tie rule follow HF's logits warpers (temperature, top-k, top-p; ties at the k-th
    value are kept). The nucleus is the smallest prefix of the sorted distribution whose mass
    reaches top_p; the most likely token is always kept.
    """
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        z = z.masked_fill(nucleus_drop(z, top_p, top_k), float("-inf"))
    return z


def nucleus_drop(z: Tensor, top_p: float, top_k: int = 0, first: int = 64) -> Tensor:
    """(B, V) bool: the tokens outside the top-p nucleus, without sorting the whole vocabulary.

    The nucleus sits inside the k most likely tokens as soon as their mass reaches top_p (a
    token past them has at least that much mass before it). So take the sorted top k (k = top_k
    when top-k already cut the rest, else `first`), and widen k eightfold until every row's top
    k holds top_p of its mass: usually one partial sort of a few dozen entries per row, instead
    of a sort of the whole vocabulary per step. The masses are exp(z - logsumexp(z)) over the
    full row, so the result is the full-sort nucleus up to float rounding at its boundary.
    """
    V = z.shape[-1]
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (B, 1)
    k = min(V, top_k if 0 < top_k else first)
    while True:
        values, order = z.topk(k, dim=-1)  # (B, k), descending
        mass = torch.exp(values - lse).cumsum(-1)  # (B, k)
        if k == V or bool((mass[:, -1] >= top_p).all()):
            break
        k = min(V, 8 * k)
    keep_sorted = (mass - torch.exp(values - lse)) < top_p  # mass strictly before < top_p
    return ~torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, keep_sorted)


def draw(cdf: Tensor, total: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw per row: cdf (B, V) float64 cumulative mass, total (B, 1), u (B,).

    The target is kept strictly below the total mass, so the chosen interval is never empty:
    a token of probability 0 (an unchanged cumulative mass) is never returned.
    """
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)


def _logsumexp(z: Tensor, work: Workspace) -> Tensor:
    """torch.logsumexp(z, dim=-1), bitwise: the same ops as ATen's CPU/CUDA implementation
    (max, masked infinite max, sum of exp(z - max), log, + max), with its (U, V) temporary in
    `work` instead of a fresh buffer."""
    maxes = torch.amax(z, dim=-1, keepdim=True)  # (U, 1)
    squeezed = maxes.squeeze(-1)  # a view: the fill below is seen by both, as in ATen
    squeezed.masked_fill_(squeezed.abs() == float("inf"), 0)
    shifted = torch.sub(z, maxes, out=work.take("lse", tuple(z.shape), z.dtype)).exp_()
    return shifted.sum(-1).log_().add_(squeezed)


def sample_step(logits: Tensor, rows: Tensor, u: Tensor, temperature: float, top_k: int,
                top_p: float, work: Workspace | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Draw one token per row: (tokens (B,), log-probs (B,), filtered log-probs (B,) or None).

    logits (U, V) fp32, one row per decode state; rows (B,) the state of each row; u (B,)
    uniforms. The distribution work (filter, softmax, CDF, logsumexp) is done once per state.
    The log-probs are in the training space, log_softmax(logits/T) unfiltered, with the same
    arithmetic as `token_log_probs`; filtered ones are under the distribution actually sampled
    from, returned only when top-k/top-p is on. `work` holds the full-vocabulary buffers
    (a fresh Workspace when None); the results do not depend on it.
    """
    work = Workspace(logits.device) if work is None else work
    U, V = logits.shape
    z = logits.float()  # (U, V); dividing by 1.0 would be an exact copy, so it is skipped
    if temperature != 1.0:
        z = torch.div(z, temperature, out=work.take("z", (U, V), torch.float32))
    filtered = top_k > 0 or top_p < 1.0
    zf = filter_logits(z, top_k, top_p) if filtered else z
    cdf = work.take("cdf", (U, V), torch.float64)
    torch.ops.aten._softmax.out(work.take("zd", (U, V), torch.float64).copy_(zf), -1, False, out=cdf)
    cdf.cumsum_(-1)  # (U, V)
    if rows.numel() != U or not torch.equal(rows, torch.arange(U, device=rows.device)):
        cdf = torch.index_select(cdf, 0, rows, out=work.take("cdf_rows", (rows.numel(), V), torch.float64))
    tokens = draw(cdf, cdf[:, -1:], u)
    log_probs = z[rows, tokens] - _logsumexp(z, work)[rows]
    if not filtered:
        return tokens, log_probs, None
    return tokens, log_probs, zf[rows, tokens] - _logsumexp(zf, work)[rows]
