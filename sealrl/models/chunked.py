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
float rounding (tests/test_models_chunked.py: 1e-5 in fp32, gradients included). Measured at the
mid shape against the earlier allocate-per-operation version of this file: the log-probs, and
the gradients of a loss without an entropy term, bit for bit the same; the entropy within 2e-7
relative (it reuses the logsumexp's exponentials: entropy = log s - sum(e (z - max)) / s with
e = exp(z - max), s = sum e).

The recompute is one (M, H) x (H, V) matmul of the three the backward would otherwise need
(about 12% of the mid shape's update FLOPs). `keep_logits` (actor.logit_chunk_keep) trades
M V 4 bytes (512 MiB at 128 x 64 tokens, 16,384 vocabulary) for it: the forward writes each
chunk's logits into one kept (M, V) tensor and the backward works on them in place; same bits.

Under torch.autocast the matmuls run in the autocast dtype (as the HF LM head would), the
softmax arithmetic in fp32; the gradient reaches the fp32 master weight through the cast.
"""
from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), tokens (M,)) -> (log_probs (M,), entropy (M,)), chunked.

    Each chunk's (c, V) logits live in one buffer reused by every chunk and worked on in place
    (a fresh (c, V) tensor per operation is a fresh allocation, page faults included, and a
    pass over memory that is not in cache). An output whose gradient is not asked for (the
    entropy when its coefficient is 0) gets None, not a tensor of zeros, so its terms are
    skipped. `keep` keeps the fp32 logits (M, V) from the forward for the backward instead of
    recomputing them (one LM-head matmul less; the same numbers, bit for bit)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float,
                chunk: int, with_entropy: bool, keep: bool):
        m = hidden.shape[0]
        lp = hidden.new_empty(m, dtype=torch.float32)
        lse = hidden.new_empty(m, dtype=torch.float32)
        ent = hidden.new_zeros(m, dtype=torch.float32)
        buf, ebuf = _buffers(hidden, weight, chunk, 2 if with_entropy else 1)
        kept = hidden.new_empty(m, weight.shape[0], dtype=torch.float32) if keep else None
        for s in range(0, m, chunk):
            z = _logits(hidden[s:s + chunk], weight, temperature, buf if kept is None else kept[s:s + chunk])
            top = z.amax(-1, keepdim=True)
            picked = z.gather(-1, tokens[s:s + chunk, None])[:, 0]
            # z - max (what logsumexp sums the exponentials of), in place unless z is kept
            z = z.sub_(top) if kept is None else torch.sub(z, top, out=buf[:z.shape[0]])
            if with_entropy:
                e = torch.exp(z, out=ebuf[:z.shape[0]])
                total = e.sum(-1)
                # entropy = lse - sum(p z) = log(total) - sum(e (z - max)) / total
                ent[s:s + chunk] = total.log() - e.mul_(z).sum(-1) / total
            else:
                total = z.exp_().sum(-1)
            lse[s:s + chunk] = total.log_().add_(top[:, 0])
            lp[s:s + chunk] = picked - lse[s:s + chunk]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, tokens, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.kept = temperature, chunk, with_entropy, kept
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        kept, ctx.kept = ctx.kept, None  # used up in place: a second backward recomputes
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m = hidden.shape[0]
        use_ent = ctx.with_entropy and g_ent is not None
        if g_lp is None and not use_ent:
            return None, None, None, None, None, None, None
        g_lp = lse.new_zeros(m) if g_lp is None else g_lp.float()
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        buf, cbuf = _buffers(hidden, weight, chunk, 2 if use_ent else 1)
        fp32 = hidden.dtype == weight.dtype == torch.float32
        wbuf = torch.empty_like(d_weight) if need_w and fp32 else None
        for s in range(0, m, chunk):
            h = hidden[s:s + chunk]
            gl = g_lp[s:s + chunk, None]
            z = kept[s:s + chunk] if kept is not None else _logits(h, weight, temperature, buf)
            z = z.sub_(lse[s:s + chunk, None])  # log p
            if use_ent:
                # d entropy / dz = -p (z - mean) = -p (log p + entropy)
                coeff = torch.add(z, ent[s:s + chunk, None], out=cbuf[:z.shape[0]])
                coeff.mul_(g_ent[s:s + chunk, None].float()).add_(gl)
                dz = z.exp_().mul_(coeff).neg_()
            else:
                dz = z.exp_().mul_(gl.neg())  # -p g: d loss / dz without the one-hot
            dz.scatter_add_(1, tokens[s:s + chunk, None], gl)
            if temperature != 1.0:
                dz.div_(temperature)
            dz = dz.to(hidden.dtype)  # d loss / d logits
            if need_h:
                torch.mm(dz, weight, out=d_hidden[s:s + chunk])
            if need_w:  # into a buffer, then added: the same sum as a fresh product would give
                d_weight.add_(torch.mm(dz.t(), h, out=wbuf) if wbuf is not None else (dz.t() @ h).float())
        if need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def _buffers(hidden: Tensor, weight: Tensor, chunk: int, count: int) -> list[Tensor]:
    """`count` fp32 (chunk, V) work buffers (the second is None when count is 1)."""
    rows = min(chunk, hidden.shape[0])
    bufs = [torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device) for _ in range(count)]
    return bufs + [None] * (2 - count)


def _logits(h: Tensor, weight: Tensor, temperature: float, buf: Tensor) -> Tensor:
    """h W^T / T in fp32, written into `buf` (the matmul itself writes there when it is fp32)."""
    out = buf[:h.shape[0]]
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    else:
        out.copy_(h @ weight.t())
    return out if temperature == 1.0 else out.div_(temperature)


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
                      chunk: int = 1024, with_entropy: bool = False,
                      keep_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log_softmax(h W^T / T)[token] and entropy, (M,) each, `chunk` tokens at a time.

    hidden (M, H) are the final hidden states at the positions that predict `tokens` (M,).
    Under torch.autocast the inputs are cast to the autocast dtype first (gradients flow back
    through the cast), and the function itself runs outside autocast. `keep_logits`: when a
    backward will follow, keep the (M, V) fp32 logits for it rather than recomputing them
    (M V 4 bytes more memory for one matmul less; the same numbers).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    keep = bool(keep_logits) and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        lp, ent = _ChunkedHead.apply(hidden, weight, tokens, float(temperature), int(chunk), bool(with_entropy),
                                     keep)
    return lp, ent if with_entropy else None
