"""A lean teacher-forced forward of the Llama / Qwen2 decoder on the HF module's own parameters.

`actor.lean_forward=true`. The HF forward of a small model spends much of its time outside the
matmuls: per-module calls and kwargs plumbing, a 4D mask built and applied in every layer, six
element-wise kernels per RMSNorm, ten per RoPE, three separate q/k/v matmuls. This forward
computes the same function with fewer, larger ops, reading the very `nn.Parameter`s of the HF
module (no copy of the weights; gradients flow to them through autograd):

- the linear layers run on the flat real tokens of the micro-batch, (N, hidden), N = sum of
  prompt + response lengths: no FLOPs on padding, whatever the length spread;
- attention runs per sequence on a right-padded grid (B, L): every sequence starts at column
  0 with positions 0..len-1, so plain causal attention (`is_causal`, no mask tensor) is exact
  for every real query (padding sits after each sequence's last token, where causality hides
  it); one index_copy scatters q/k/v into the grid and one index_select gathers the output
  (none when all lengths are equal);
- q, k, v (and gate, up) of plain `nn.Linear`s are one matmul on the concatenated weights
  (the concatenation is part of the graph: each weight gets its own slice of the gradient);
  projections of other types (LoRA layers) are called as modules, so the adapter applies;
- RMSNorm is `F.rms_norm` (one kernel), RoPE rotates q and k together in HF's half-split
  layout with the cos/sin of the HF module's own rotary embedding (scaling types included),
  and the residual adds ride in `addmm`; the final norm runs on the predicting positions only.

The result is the HF forward's up to float rounding, not bitwise (other kernels, other
summation orders): tests/test_models_lean_forward.py holds log-probs, entropy, values and
gradients within 1e-5 of HF's in fp32, padded and packed. Hence opt-in. Covered: model_type
llama / qwen2, full attention, RoPE independent of the sequence length, fp32 weights and
compute, no dropout in force, no gradient checkpointing; anything else takes the HF forward
(`unsupported_reason` says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# With gradients, rows up to this length take the math attention kernel (matmuls and a softmax),
# longer ones the fused CPU kernel: on 2 cores the fused kernel's forward + backward took 1.2-3x
# as long at 10-24 tokens (its fixed cost per block), the math kernel's 1.1-1.3x as long from 32
# on at head size 64; without gradients (the reference pass) the fused kernel was as fast or
# faster in the embedded model's training (docs/benchmarks.md, "Session 9").
MATH_ATTENTION_MAX_LEN = 24


def lean_unsupported_reason(config) -> str | None:
    """None when a lean Llama/Qwen2 forward computes what the HF module computes (the
    architecture rules shared by this file and the rollout engine's rollout/lean.py)."""
    if config.model_type not in ("llama", "qwen2"):
        return f"model_type {config.model_type!r} is not llama/qwen2"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    return None


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM, a critic
    backbone (the decoder itself) or a peft wrapper of either."""
    return model if hasattr(model, "layers") and hasattr(model, "embed_tokens") else model.get_decoder()


def unsupported_reason(model: nn.Module) -> str | None:
    """None when `lean_hidden` computes what `model`'s HF forward computes right now."""
    if (reason := lean_unsupported_reason(model.config)) is not None:
        return reason
    decoder = decoder_of(model)
    if getattr(decoder, "gradient_checkpointing", False):
        return "gradient checkpointing is on"
    if any(p.dtype != torch.float32 for p in decoder.parameters()):
        return "weights are not fp32"
    if any(hasattr(p, "_local_tensor") for p in decoder.parameters()):
        return "weights are sharded (FSDP2 DTensors)"
    if torch.is_autocast_enabled(decoder.embed_tokens.weight.device.type):
        return "autocast is on"
    if decoder.training and getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout is in force"
    if decoder.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in decoder.modules()):
        return "dropout is in force"
    return None


def _plain(*mods: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in mods)


def _cat_bias(mods) -> Tensor | None:
    biases = [m.bias for m in mods]
    return None if all(b is None for b in biases) else torch.cat(biases)  # all or none (HF layouts)


def _fused(x: Tensor, mods: tuple[nn.Module, ...]) -> Tensor:
    """[m(x) for m in mods] concatenated on the last dim: one matmul when all are plain Linear."""
    if _plain(*mods):
        return F.linear(x, torch.cat([m.weight for m in mods]), _cat_bias(mods))
    return torch.cat([m(x) for m in mods], dim=-1)


def _residual(x: Tensor, h: Tensor, proj: nn.Module) -> Tensor:
    """x + proj(h), the add fused into the matmul for a plain bias-free Linear."""
    if type(proj) is nn.Linear and proj.bias is None:
        return torch.addmm(x, h, proj.weight.t())
    return x + proj(h)


def _rotate(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's RoPE, q and k together: qk (..., heads, D) * cos + rotate_half(qk) * sin."""
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


class _Grid:
    """Where each flat token (sequence order) sits in the right-padded (B, L) attention grid."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.B, self.L = len(lengths), max(lengths)
        self.uniform = min(lengths) == self.L
        if not self.uniform:
            lens = torch.tensor(lengths, device=device)
            real = torch.arange(self.L, device=device)[None, :] < lens[:, None]  # (B, L)
            self.index = real.flatten().nonzero().squeeze(1)  # (N,) row-major = sequence order

    def scatter(self, flat: Tensor) -> Tensor:
        """(N, C) -> (B, L, C), zeros at padding."""
        if self.uniform:
            return flat.view(self.B, self.L, -1)
        grid = flat.new_zeros(self.B * self.L, flat.shape[1])
        return grid.index_copy(0, self.index, flat).view(self.B, self.L, -1)

    def gather(self, grid: Tensor) -> Tensor:
        """(B, L, C) -> (N, C), the real positions only."""
        flat = grid.reshape(self.B * self.L, -1)
        return flat if self.uniform else flat.index_select(0, self.index)


class _SharedGrid:
    """A (B, L) attention grid whose rows may share flat tokens: row b holds the flat tokens
    `rows[b]` (a prompt stored once, then one sample's response), right-padded. Scatter copies
    each shared token into every row that reads it (its gradient sums over them); gather reads
    each flat token back from the first row that holds it (all rows compute the same state for
    a shared prompt: causal attention sees the same prompt tokens at the same positions)."""

    def __init__(self, rows, n_flat: int, device: torch.device) -> None:
        self.B, self.L = len(rows), max(len(r) for r in rows)
        src, dst = [], [-1] * n_flat
        for b, row in enumerate(rows):
            src.extend((*row, *[row[0]] * (self.L - len(row))))  # padding: after the row's end, never attended
            for col, j in enumerate(row):
                if dst[j] < 0:
                    dst[j] = b * self.L + col
        if min(dst, default=0) < 0:
            raise ValueError("shared grid: a flat token is in no row")
        self.src = torch.tensor(src, dtype=torch.long, device=device)  # (B*L,) grid slot -> flat token
        self.dst = torch.tensor(dst, dtype=torch.long, device=device)  # (N,) flat token -> first grid slot

    def scatter(self, flat: Tensor) -> Tensor:
        return flat.index_select(0, self.src).view(self.B, self.L, -1)

    def gather(self, grid: Tensor) -> Tensor:
        return grid.reshape(self.B * self.L, -1).index_select(0, self.dst)


def _attention(attn: nn.Module, h: Tensor, grid: _Grid, cos: Tensor, sin: Tensor, cfg) -> Tensor:
    """Causal self-attention of the normalised states h (N, hidden) -> (N, H*D), before o_proj."""
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = attn.head_dim
    qkv = grid.scatter(_fused(h, (attn.q_proj, attn.k_proj, attn.v_proj))).unflatten(-1, (H + 2 * Hkv, D))
    qk = _rotate(qkv[:, :, :H + Hkv], cos, sin)  # (B, L, H+Hkv, D)
    q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
    short = grid.L <= MATH_ATTENTION_MAX_LEN and q.device.type == "cpu" and torch.is_grad_enabled()
    if short:   # the math kernel called directly: sdpa_kernel() would switch a process-wide flag, under
        # which another thread's attention (a generation lane's) would take the math kernel too
        out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, scale=attn.scaling,
                                                                 enable_gqa=H != Hkv)[0]
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=H != Hkv)
    return grid.gather(out.transpose(1, 2).flatten(2))  # (N, H*D)


def lean_hidden(model: nn.Module, input_ids: Tensor, lengths: list[int], index: Tensor,
                rows: tuple[tuple[int, ...], ...] | None = None) -> Tensor:
    """Final-norm hidden states (len(index), hidden) at flat positions `index` of the packed
    tokens `input_ids` (N,): the sequences of `lengths` concatenated, each attending to itself
    only, positions restarting at 0 (what models/packing.py's packed forward computes).

    With `rows` (models/packing.py's pack_shared_prompts) sequence b is the flat tokens
    rows[b] instead, at positions 0..len-1: a prompt stored once serves every row that lists
    it, so its linear layers run once, not once per sample (`lengths` is then unused)."""
    decoder, cfg = decoder_of(model), model.config
    eps, width = cfg.rms_norm_eps, (cfg.hidden_size,)
    act = ACT2FN[cfg.hidden_act]
    grid = _Grid(lengths, input_ids.device) if rows is None else _SharedGrid(rows, len(input_ids), input_ids.device)
    x = decoder.embed_tokens(input_ids)  # (N, hidden)
    cos, sin = decoder.rotary_emb(x, torch.arange(grid.L, device=x.device)[None])  # (1, L, D) each
    cos, sin = cos[0, :, None], sin[0, :, None]  # (L, 1, D): broadcast over rows and heads
    for layer in decoder.layers:
        h = F.rms_norm(x, width, layer.input_layernorm.weight, eps)
        x = _residual(x, _attention(layer.self_attn, h, grid, cos, sin, cfg), layer.self_attn.o_proj)
        mlp = layer.mlp
        gate, up = _fused(F.rms_norm(x, width, layer.post_attention_layernorm.weight, eps),
                          (mlp.gate_proj, mlp.up_proj)).chunk(2, dim=-1)
        x = _residual(x, act(gate) * up, mlp.down_proj)
    return F.rms_norm(x.index_select(0, index), width, decoder.norm.weight, eps)
