"""Memory-lean log-probs and entropy: the LM head applied chunk by chunk over tokens.

The naive path materialises the fp32 logits of every predicted token at once, (M, V) floats
(M = response tokens of a micro-batch): 128 x 64 tokens x 16,384 vocabulary is 537 MB, and a
150k vocabulary makes it 5 GB, plus as much again for softmax and the gradient. Here the
hidden states (M, H) are the only per-token input kept; each chunk of `chunk` tokens runs

    z = h W^T / T            (c, V), fp32 (from the compute dtype of h, W)
    lse = logsumexp(z),  p = exp(z - lse),  mean = sum(p z)
    log_prob = z[token] - lse,   entropy = lse - mean

and drops z. The backward (a custom autograd function) recomputes z per chunk and applies

    d log_prob / dz = onehot(token) - p        d entropy / dz = -p (z - mean)

so the peak is a few (chunk, V) buffers, never (M, V). The formulas are the ones of
`logprobs.token_log_probs` / `token_entropy`: the result equals the naive computation within
float rounding (tests/test_models_chunked.py: 1e-5 in fp32, gradients included).

Under torch.autocast the matmuls run in the autocast dtype (as the HF LM head would), the
softmax arithmetic in fp32; the gradient reaches the fp32 master weight through the cast.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _scaled(x: Tensor, temperature: float) -> Tensor:
    """x / T in fp32; no pass over the (chunk, V) buffer when T = 1 (x / 1 is x exactly)."""
    x = x.float()
    return x if temperature == 1.0 else x / temperature


class _ChunkedHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), tokens (M,)) -> (log_probs (M,), entropy (M,)), chunked."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float,
                chunk: int, with_entropy: bool):
        m = hidden.shape[0]
        lp = hidden.new_empty(m, dtype=torch.float32)
        lse = hidden.new_empty(m, dtype=torch.float32)
        mean = hidden.new_empty(m, dtype=torch.float32)
        for s in range(0, m, chunk):
            z = _scaled(hidden[s:s + chunk] @ weight.t(), temperature)  # (c, V) fp32
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            lp[s:s + chunk] = z.gather(-1, tokens[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
            if with_entropy:
                p = torch.softmax(z, dim=-1)
                mean[s:s + chunk] = (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse, mean)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ent = lse - mean if with_entropy else lse.new_zeros(m)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, tokens, lse, mean = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        m = hidden.shape[0]
        if g_lp is None:
            g_lp = lse.new_zeros(m)
        use_ent = ctx.with_entropy and g_ent is not None
        for s in range(0, m, chunk):
            h = hidden[s:s + chunk]
            z = _scaled(h @ weight.t(), temperature)  # (c, V), recomputed
            p = torch.exp(z - lse[s:s + chunk, None])
            gl = g_lp[s:s + chunk, None].float()
            coeff = gl + g_ent[s:s + chunk, None].float() * (z - mean[s:s + chunk, None]) if use_ent else gl
            dz = -p * coeff
            dz.scatter_add_(1, tokens[s:s + chunk, None], gl)
            dz = _scaled(dz, temperature).to(hidden.dtype)  # d loss / d logits
            if need_h:
                d_hidden[s:s + chunk] = dz @ weight
            if need_w:
                d_weight += (dz.t() @ h).float()
        if need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def output_weight(model) -> Tensor:
    """The LM head's weight (V, H) of a causal LM whose logits are plain `hidden @ W^T`; a head
    with a bias, a logit scale or soft-capping is refused (its logits are not that)."""
    head = model.get_output_embeddings()
    cfg = model.config
    if head is None or getattr(head, "bias", None) is not None or getattr(cfg, "final_logit_softcapping", None) \
            or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError(f"chunked log-probs need an LM head computing hidden @ W^T (no bias, logit scale "
                         f"or soft-capping); {type(model).__name__} has another: set the chunk size to 0")
    return head.weight


def chunked_log_probs(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0,
                      chunk: int = 1024, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log_softmax(h W^T / T)[token] and entropy, (M,) each, `chunk` tokens at a time.

    hidden (M, H) are the final hidden states at the positions that predict `tokens` (M,).
    Under torch.autocast the inputs are cast to the autocast dtype first (gradients flow back
    through the cast), and the function itself runs outside autocast.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        lp, ent = _ChunkedHead.apply(hidden, weight, tokens, float(temperature), int(chunk), bool(with_entropy))
    return lp, ent if with_entropy else None
