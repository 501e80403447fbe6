"""A lean decode-time forward for Llama and Qwen2 over plain tensors, with a static KV cache.

Why not the HF module: at rollout batch sizes on CPU a small model's decode step is dominated by
per-op and per-module Python overhead (mask building, cache objects, hooks, kwargs plumbing),
not by FLOPs; and the tail of a batch (the few rows still running after the others stopped)
is all overhead. This forward computes the same function with far fewer ops, by rewriting the
weights once per version:

- q, k, v (and gate, up) projections are stacked into one matrix, stored transposed (in, out)
  so that `x @ W` runs as one GEMM and `addmm` fuses biases and residual adds;
- each RMSNorm weight is folded into the matrix that consumes the normalised vector
  (rms(x) * w @ W == rms(x) @ (diag(w) W)), leaving only the scale rsqrt(mean(x^2) + eps);
- the rows of q and k inside each head are reordered from HF's half-split layout
  (x_0..x_{D/2-1}, y_0..y_{D/2-1}) to pairs (x_0, y_0, x_1, y_1, ...), so RoPE is one complex
  multiplication. Attention scores are dot products over the head dimension, which do not
  depend on the order of that dimension, so q.k is unchanged; v is not reordered.

- a large LM head (more than LM_HEAD_CHUNK vocabulary rows) is kept in the checkpoint's (vocab,
  hidden) layout and applied LM_HEAD_CHUNK rows at a time: at decode batch sizes one GEMM over
  the whole vocabulary streams its weight through the cache in a poor order (measured on the
  2-core machine, 1 thread, SmolLM2's 576 x 49,152 head, batch 32: 0.6-0.75x the time of one
  GEMM in the median of interleaved repeats; bitwise equal outputs there). A head of at most
  LM_HEAD_CHUNK rows (the embedded model's) is one GEMM in (in, out) layout, as before.

The results equal the HF forward's up to float rounding (the parity tests bound the log-prob
difference by 1e-5 in fp32). Supported: model_type llama / qwen2 with full attention and RoPE
frequencies independent of sequence length (default, linear, llama3, yarn); anything else
runs on the HF backend. The frequencies come from the HF module's own rotary embedding, so
scaling variants are computed by transformers, not re-implemented here.

Cache layout: every row's tokens sit at the same cache columns (prompts left-padded to a
common width), so a step writes one column for the whole batch; per-row RoPE positions and a
key-validity mask make the padding invisible. The cache is preallocated for the whole call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.activations import ACT2FN

from sealrl.models.lean_forward import lean_unsupported_reason  # noqa: F401  (shared with the training forward)
from sealrl.rollout.kv_meter import METER

LM_HEAD_CHUNK = 1024  # vocabulary rows per LM-head GEMM (see the module docstring)


@dataclass
class KVCache:
    """Keys and values of all layers in one tensor, time-major: (T_max, layers, 2, B, H_kv, D).

    Columns [0, length) are filled. Time-major makes the filled part one contiguous block, so
    compaction (finished rows leave) copies only what was written, in one op for all layers.
    `keys[i]` / `values[i]` are (B, H_kv, T_max, D) views of layer i; `rope` holds the complex
    RoPE factors for positions [0, T_max).
    """

    kv: Tensor
    rope: Tensor
    length: int = 0
    keys: list[Tensor] = field(init=False)
    values: list[Tensor] = field(init=False)

    def __post_init__(self) -> None:
        METER.allocated(self.kv)   # counted while alive (rollout/kv_meter.py)
        per_layer = self.kv.permute(1, 2, 3, 4, 0, 5)  # (L, 2, B, H_kv, T_max, D) view
        self.keys = list(per_layer[:, 0].unbind(0))
        self.values = list(per_layer[:, 1].unbind(0))

    def select(self, rows: Tensor) -> "KVCache":
        """Rows `rows` (may repeat: fan-out of a prompt to its candidates; or drop: compaction)."""
        T, L, two, _, H, D = self.kv.shape
        out = self.kv.new_empty((T, L, two, rows.numel(), H, D))
        torch.index_select(self.kv[:self.length], 3, rows, out=out[:self.length])
        return KVCache(out, self.rope, self.length)


@dataclass
class _Layer:
    """One decoder layer's rewritten weights, all (in, out); see the module docstring."""

    w_qkv: Tensor           # (hidden, H*D + 2*H_kv*D), ln1 folded in, q/k rows paired
    b_qkv: Tensor | None
    w_o: Tensor             # (H*D, hidden)
    b_o: Tensor | None
    w_gate_up: Tensor       # (hidden, 2*I), ln2 folded in
    b_gate_up: Tensor | None
    w_down: Tensor          # (I, hidden)
    b_down: Tensor | None


def _pair_rope_rows(w: Tensor, heads: int) -> Tensor:
    """Reorder each head's rows (or bias entries) from half-split to interleaved pairs."""
    rest = w.shape[1:]
    return w.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)


def _stack_t(*weights: Tensor, norm: Tensor | None = None) -> Tensor:
    """Stack (out, in) weights along out; return (in, out) contiguous, norm weight folded in.
    Each weight is written once, straight into its transposed slot (the same values as
    cat, multiply, then transpose-copy, at about a fifth of the time: three passes were a
    quarter of a SmolLM2 weight sync)."""
    dtype = weights[0].dtype if norm is None else torch.promote_types(weights[0].dtype, norm.dtype)
    out = torch.empty((weights[0].shape[1], sum(w.shape[0] for w in weights)),
                      dtype=dtype, device=weights[0].device)
    start = 0
    for w in weights:
        slot = out[:, start:start + w.shape[0]].t()
        if norm is None:
            slot.copy_(w)
        else:
            torch.mul(w, norm[None, :], out=slot)
        start += w.shape[0]
    return out


def _cat_optional(parts: list[Tensor | None]) -> Tensor | None:
    if all(p is None for p in parts):
        return None
    return torch.cat(parts)  # a partial set of biases would be a malformed checkpoint


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def _linear_residual(residual: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """residual + x @ w (+ b) with the residual add fused into the matmul."""
    out = torch.addmm(residual, x, w)
    return out if b is None else out.add_(b)


def _rms_scale(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without its weight (folded into the next matmul), computed in fp32 like HF."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rope(qk: Tensor, rope: Tensor) -> Tensor:
    """Rotate paired head dims: qk (B, T, heads, D) times rope (B, T, 1, D/2) complex."""
    pairs = torch.view_as_complex(qk.float().unflatten(-1, (qk.shape[-1] // 2, 2)))
    return torch.view_as_real(pairs * rope).flatten(-2).to(qk.dtype)


class LeanCausalLM:
    """Prefill + single-token decode with the weights of one policy version."""

    def __init__(self, weights: dict[str, Tensor], config, rotary: torch.nn.Module,
                 device: torch.device) -> None:
        self.num_heads = H = config.num_attention_heads
        self.num_kv_heads = Hkv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // H
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act].forward  # the bare function: no module-call overhead
        self.device = device
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.dtype = self.embed.dtype
        lm_head = w.get("lm_head.weight", self.embed)  # tied checkpoints may omit it
        if lm_head.shape[0] > LM_HEAD_CHUNK:  # (vocab, hidden) row blocks, norm folded in
            head = lm_head * w["model.norm.weight"][None, :]
            self.lm_head, self.lm_head_chunks = None, list(head.split(LM_HEAD_CHUNK))
        else:
            self.lm_head, self.lm_head_chunks = _stack_t(lm_head, norm=w["model.norm.weight"]), []
        self.layers = [self._layer(w, f"model.layers.{i}.", H, Hkv)
                       for i in range(config.num_hidden_layers)]
        self.inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
        self.attention_scaling = float(rotary.attention_scaling)

    @staticmethod
    def _layer(w: dict[str, Tensor], p: str, H: int, Hkv: int) -> _Layer:
        a, m = p + "self_attn.", p + "mlp."
        q, k = _pair_rope_rows(w[a + "q_proj.weight"], H), _pair_rope_rows(w[a + "k_proj.weight"], Hkv)
        qb, kb = w.get(a + "q_proj.bias"), w.get(a + "k_proj.bias")
        return _Layer(
            w_qkv=_stack_t(q, k, w[a + "v_proj.weight"], norm=w[p + "input_layernorm.weight"]),
            b_qkv=_cat_optional([None if qb is None else _pair_rope_rows(qb, H),
                                 None if kb is None else _pair_rope_rows(kb, Hkv),
                                 w.get(a + "v_proj.bias")]),
            w_o=_stack_t(w[a + "o_proj.weight"]), b_o=w.get(a + "o_proj.bias"),
            w_gate_up=_stack_t(w[m + "gate_proj.weight"], w[m + "up_proj.weight"],
                               norm=w[p + "post_attention_layernorm.weight"]),
            b_gate_up=_cat_optional([w.get(m + "gate_proj.bias"), w.get(m + "up_proj.bias")]),
            w_down=_stack_t(w[m + "down_proj.weight"]), b_down=w.get(m + "down_proj.bias"),
        )

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (max_len, len(self.layers), 2, batch, self.num_kv_heads, self.head_dim)
        return KVCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                       self.rope_factors(max_len))

    def rope_factors(self, max_len: int) -> Tensor:
        """attention_scaling * exp(i * position * inv_freq), (max_len, D/2) complex64; the
        angle is computed as HF computes it (fp32 position times fp32 inverse frequency)."""
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        angle = pos[:, None] * self.inv_freq[None, :]
        return torch.polar(torch.full_like(angle, self.attention_scaling), angle)

    def forward(self, ids: Tensor, positions: Tensor, cache: KVCache, attn_mask: Tensor | None,
                causal: bool = False) -> Tensor:
        """Run T new tokens per row, write their K/V at cache columns [length, length+T).

        ids, positions (B, T); attn_mask (B, 1, T, length+T) bool, or None when no key is
        padding (then `causal` says whether the T new tokens need a causal mask among
        themselves, i.e. a prefill from an empty cache). Returns last-token logits (B, V) fp32.
        """
        B, T = ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        start, end = cache.length, cache.length + T
        rope = cache.rope[positions].unsqueeze(2)  # (B, T, 1, D/2) complex
        x = F.embedding(ids.reshape(-1), self.embed)  # (B*T, hidden): 2D activations throughout
        last_layer = self.layers[-1]
        for layer, keys, values in zip(self.layers, cache.keys, cache.values):
            qkv = _linear(_rms_scale(x, self.eps), layer.w_qkv, layer.b_qkv).view(B, T, -1, D)
            qk = _rope(qkv.narrow(2, 0, H + Hkv), rope)  # (B, T, H+Hkv, D)
            keys.narrow(2, start, T).copy_(qk.narrow(2, H, Hkv).transpose(1, 2))
            values.narrow(2, start, T).copy_(qkv.narrow(2, H + Hkv, Hkv).transpose(1, 2))
            q, mask, is_causal = qk.narrow(2, 0, H), attn_mask, causal and attn_mask is None
            if layer is last_layer and T > 1:
                # Only the last position's output is read; earlier ones needed their K/V only.
                x, q, T = x.view(B, T, -1)[:, -1], q.narrow(1, T - 1, 1), 1
                mask, is_causal = None if mask is None else mask[:, :, -1:], False
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.narrow(2, 0, end), values.narrow(2, 0, end),
                attn_mask=mask, is_causal=is_causal, enable_gqa=H != Hkv)  # (B, H, T, D)
            x = _linear_residual(x, attn.transpose(1, 2).reshape(B * T, H * D), layer.w_o, layer.b_o)
            gate, up = _linear(_rms_scale(x, self.eps), layer.w_gate_up, layer.b_gate_up).chunk(2, -1)
            x = _linear_residual(x, self.act(gate) * up, layer.w_down, layer.b_down)
        cache.length = end
        METER.forward(cache.kv, end)
        return self.logits(_rms_scale(x, self.eps))  # (B, V): T is 1 here

    def logits(self, h: Tensor) -> Tensor:
        """LM head on normalised hidden states h (B, hidden) -> (B, V) fp32."""
        if not self.lm_head_chunks:
            return torch.mm(h, self.lm_head).float()
        return torch.cat([torch.mm(h, c.t()) for c in self.lm_head_chunks], dim=1).float()
