"""Packed sequences, token-budget micro-batches, and the one entry point of every
teacher-forced pass (reference, old log-probs, update, critic values, the optimal-token
baseline's sum of squared probabilities, the data-parallel idle passes): `TeacherForcing`.

packed (the fast path's layout): the sequences of a micro-batch concatenated in one row of width
N = sum of lengths, no padding, position ids restarting at 0 for each sequence:

    input_ids   [p0 p1 p2 r0 r1 | q0 q1 s0 s1 s2]      (1, N)
    position    [ 0  1  2  3  4 |  0  1  2  3  4]

transformers 5 (masking_utils.find_packed_sequence_indices) turns restarting position ids into
a block-diagonal causal mask for sdpa/eager/flex and into cu_seqlens for flash attention,
provided no 2D attention mask and no cache are passed; so the packed forward sends
`position_ids` only, with `use_cache=False`, and attention never crosses sequences
(tests/test_models_packing.py checks packed == padded == one-by-one). Packing spends no FLOPs
on padding, which matters when lengths differ a lot.

`TeacherForcing` holds the options every role shares (micro-batch size or token budget,
packing, logit chunking, the lean forward) and runs one micro-batch; roles/common.teacher_forcing
chooses them once per run (run.exact: the HF reference path). With its defaults it calls
`logprobs.response_log_probs`: bitwise what the HF module computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sealrl.algos import sum_pi_squared_from_logits
from sealrl.models.chunked import chunked_log_probs, output_weight
from sealrl.models.lean_forward import decoder_of, lean_hidden, unsupported_reason
from sealrl.models.logprobs import (
    _check_pairs,
    pad_batch,
    response_log_probs,
    response_logits,
    response_window,
    token_entropy,
    token_log_probs,
)


@dataclass(frozen=True)
class PackedBatch:
    """All sequences (prompt + response) concatenated in one row, no padding."""

    input_ids: Tensor           # (1, N) long
    position_ids: Tensor        # (1, N) long, restarting at 0 per sequence
    starts: tuple[int, ...]     # offset of each sequence in the row
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]

    @property
    def lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lens, self.response_lens)]

    def predicting_index(self, extra: int = 0) -> Tensor:
        """Flat positions whose states predict each response token, in sequence order; with
        extra=1 also the position of each sequence's last token (the state after it)."""
        idx = [s + p - 1 + j for s, p, r in zip(self.starts, self.prompt_lens, self.response_lens)
               for j in range(r + extra)]
        return torch.tensor(idx, dtype=torch.long, device=self.input_ids.device)

    def response_mask(self, extra: int = 0) -> Tensor:
        """(B, R+extra) bool: which padded slots the flat per-token values go to."""
        R = max(self.response_lens, default=0) + extra
        lens = torch.tensor(self.response_lens, device=self.input_ids.device) + extra
        return torch.arange(R, device=self.input_ids.device)[None, :] < lens[:, None]

    def to_padded(self, flat: Tensor, extra: int = 0) -> Tensor:
        """Scatter per-token values (M,) into (B, R+extra) right-padded rows, 0 elsewhere."""
        mask = self.response_mask(extra)
        out = flat.new_zeros(mask.shape)
        return out.masked_scatter(mask, flat)  # row-major, matching predicting_index


def pack_sequences(prompts: list[list[int]], responses: list[list[int]],
                   device: str | torch.device = "cpu") -> PackedBatch:
    """Concatenate every prompt+response into one row with per-sequence position ids."""
    _check_pairs(prompts, responses)
    ids, pos, starts = [], [], []
    for p, r in zip(prompts, responses):
        starts.append(len(ids))
        ids.extend(p)
        ids.extend(r)
        pos.extend(range(len(p) + len(r)))
    return PackedBatch(torch.tensor([ids], dtype=torch.long, device=device),
                       torch.tensor([pos], dtype=torch.long, device=device), tuple(starts),
                       tuple(len(p) for p in prompts), tuple(len(r) for r in responses))


@dataclass(frozen=True)
class SharedPromptBatch(PackedBatch):
    """A packed row in which each distinct prompt is stored once: sample i reads the flat
    tokens rows[i] (its prompt's one copy, then its own response) at positions 0..len-1.

        input_ids   [p0 p1 p2 r0 r1 | s0 s1 s2 | q0 q1 t0]      three samples, two prompts
        rows        (0 1 2 3 4) (0 1 2 5 6 7) (8 9 10)

    `starts` is the offset of each sample's prompt copy; `position_ids` the position of each
    flat token in its rows (a shared token has one position in all of them)."""

    rows: tuple[tuple[int, ...], ...] = ()

    def predicting_index(self, extra: int = 0) -> Tensor:
        idx = [row[p - 1 + j] for row, p, r in zip(self.rows, self.prompt_lens, self.response_lens)
               for j in range(r + extra)]
        return torch.tensor(idx, dtype=torch.long, device=self.input_ids.device)


def pack_shared_prompts(prompts: list[list[int]], responses: list[list[int]],
                        device: str | torch.device = "cpu") -> SharedPromptBatch:
    """Samples with the same prompt ids share one copy of the prompt (a GRPO group's n
    samples: the prompt's teacher-forced work is done once); other samples are as packed."""
    _check_pairs(prompts, responses)
    ids: list[int] = []
    pos: list[int] = []
    copies: dict[tuple[int, ...], int] = {}
    starts, rows = [], []
    for p, r in zip(prompts, responses):
        key = tuple(p)
        if key not in copies:
            copies[key] = len(ids)
            ids.extend(p)
            pos.extend(range(len(p)))
        start = copies[key]
        rows.append(tuple(range(start, start + len(p))) + tuple(range(len(ids), len(ids) + len(r))))
        starts.append(start)
        ids.extend(r)
        pos.extend(range(len(p), len(p) + len(r)))
    return SharedPromptBatch(torch.tensor([ids], dtype=torch.long, device=device),
                             torch.tensor([pos], dtype=torch.long, device=device), tuple(starts),
                             tuple(len(p) for p in prompts), tuple(len(r) for r in responses), tuple(rows))


def _packed_hidden(model, prompts, responses, extra: int, lean: bool, share: bool):
    """(packed batch, predicting index, hidden states at it): the lean forward, with the prompts
    shared when `share`, or the HF decoder on the packed row."""
    device = next(model.parameters()).device
    packed = (pack_shared_prompts if lean and share else pack_sequences)(prompts, responses, device)
    index = packed.predicting_index(extra)
    if lean:
        rows = packed.rows if isinstance(packed, SharedPromptBatch) else None
        return packed, index, lean_hidden(model, packed.input_ids[0], packed.lengths, index, rows)
    hidden = decoder_of(model)(input_ids=packed.input_ids, position_ids=packed.position_ids,
                               use_cache=False).last_hidden_state[0, index]
    return packed, index, hidden


def partition_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into `lengths` split into the fewest balanced parts of at most `budget` tokens.

    Longest first, each to the part with the fewest tokens so far (ties: the first), starting
    from ceil(total / budget) parts and adding one while a part is over budget. A sequence
    longer than the budget gets a part of its own (sequences are never split). Each part is
    in ascending index order, the parts in order of their first index; deterministic.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    k = max(1, math.ceil(sum(lengths) / budget))
    while True:
        parts: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            j = loads.index(min(loads))
            parts[j].append(i)
            loads[j] += lengths[i]
        over = [j for j in range(k) if loads[j] > budget and len(parts[j]) > 1]
        if not over or k >= n:
            break
        k += 1
    return sorted((sorted(p) for p in parts if p), key=lambda p: p[0])


def _flat_log_probs(model, hidden_or_logits: Tensor, tokens: Tensor, temperature: float, chunk: int,
                    with_entropy: bool, keep_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    if chunk:
        return chunked_log_probs(hidden_or_logits, output_weight(model), tokens, temperature, chunk, with_entropy,
                                 keep_logits)
    lp = token_log_probs(hidden_or_logits, tokens, temperature)
    return lp, token_entropy(hidden_or_logits, temperature) if with_entropy else None


def packed_log_probs(model, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0,
                     with_entropy: bool = False, chunk: int = 0, keep_logits: bool = False,
                     lean: bool = False, share: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
    """Same contract and numbers as logprobs.response_log_probs, computed on one packed row;
    `chunk` > 0 applies the LM head `chunk` tokens at a time (models/chunked.py); `lean` runs
    the decoder through models/lean_forward.py instead of the HF module, and with `share` too
    runs each distinct prompt once (pack_shared_prompts)."""
    if lean or chunk:
        packed, index, hidden = _packed_hidden(model, prompts, responses, 0, lean, share)  # hidden (M, H)
        targets = torch.tensor([t for r in responses for t in r], dtype=torch.long, device=index.device)
        if not chunk:
            hidden = model.get_output_embeddings()(hidden)
        flat_lp, flat_ent = _flat_log_probs(model, hidden, targets, temperature, chunk, with_entropy, keep_logits)
    else:  # logits_to_keep as an index tensor: the LM head runs on the M predicting positions only
        packed = pack_sequences(prompts, responses, next(model.parameters()).device)
        index = packed.predicting_index()  # (M,)
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                       logits_to_keep=index).logits[0]  # (M, V)
        flat_lp, flat_ent = _flat_log_probs(model, logits, packed.input_ids[0, index + 1], temperature, 0,
                                            with_entropy)
    mask = packed.response_mask().float()
    entropy = packed.to_padded(flat_ent) if with_entropy else None
    return packed.to_padded(flat_lp), entropy, mask


def padded_chunked_log_probs(model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                             pad_id: int, with_entropy: bool, chunk: int,
                             keep_logits: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
    """response_log_probs on the padded layout, the LM head applied `chunk` tokens at a time."""
    device = next(model.parameters()).device
    batch = pad_batch(prompts, responses, pad_id, device)
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, use_cache=False).last_hidden_state
    keep = batch.response_mask.bool()
    flat_lp, flat_ent = _flat_log_probs(model, response_window(hidden, batch)[keep], batch.response_ids[keep],
                                        temperature, chunk, with_entropy, keep_logits)
    lp = torch.zeros(keep.shape, dtype=flat_lp.dtype, device=device).masked_scatter(keep, flat_lp)
    ent = torch.zeros_like(lp).masked_scatter(keep, flat_ent) if with_entropy else None
    return lp, ent, batch.response_mask


def packed_values(critic, prompts: list[list[int]], responses: list[list[int]],
                  lean: bool = False, share: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """CriticModel.values on one packed row: (values (B,R), last_values (B,), response_mask (B,R));
    `lean`: the backbone through models/lean_forward.py (`share`: each distinct prompt once)."""
    packed, _, hidden = _packed_hidden(critic.backbone, prompts, responses, 1, lean, share)  # (M + B, H)
    flat = critic.value_head(hidden.float()).squeeze(-1)  # (M + B,)
    v = packed.to_padded(flat, extra=1)  # (B, R+1)
    lens = torch.tensor(packed.response_lens, device=flat.device)
    mask = packed.response_mask().float()
    return v[:, :mask.shape[1]] * mask, v.gather(1, lens[:, None]).squeeze(1), mask


def _sharded(model) -> bool:
    """Whether FSDP2 shards `model`'s weights (DTensor parameters)."""
    return any(hasattr(p, "_local_tensor") for p in model.parameters())


# Tokens (prompt + response per sample) of an auto micro-batch. Each pass has a fixed cost in ops
# that a small model notices (the embedded model's step, 128 samples: 3-9% faster in one
# micro-batch than in two), while a larger one gained nothing from it (the mid shape's 128 x 70
# tokens: the same step in one as in two, 850 MiB more; docs/benchmarks.md, "Session 24"). The
# budget also bounds the memory of long responses (kept logits: tokens x vocabulary x 4 bytes).
AUTO_MICRO_TOKENS = 8192


@dataclass(frozen=True)
class TeacherForcing:
    """How a role runs its teacher-forced passes: micro-batches by sample count or by a token
    budget, padded or packed, full or chunked logits. The defaults are the original path."""

    micro_batch_size: int = 64   # samples per micro-batch (when max_tokens is 0); 0: auto (`_auto_size`)
    max_tokens: int = 0          # token budget per micro-batch, balanced parts (0 = by count)
    pack: bool = False           # packed rows instead of padded batches
    chunk: int = 0               # LM-head chunk in tokens (0 = full logits)
    keep_logits: bool = False    # chunked: keep the fp32 logits for the backward (no recompute)
    lean: bool = False           # models/lean_forward.py where it covers the model, else the HF forward
    share_prompts: bool = False  # lean: a prompt shared by samples of a micro-batch runs once
    group: int = 1               # samples of a group (consecutive): an auto micro-batch holds whole groups

    def describe(self) -> str:
        """One line for the run's log: the path every teacher-forced pass takes."""
        layout = ("lean forward (Llama/Qwen2), each group's prompt once" if self.lean and self.share_prompts else
                  "lean forward" if self.lean else "HF forward, packed" if self.pack else "HF forward, padded")
        head = (f"LM head {self.chunk} tokens at a time, logits {'kept' if self.keep_logits else 'recomputed'}"
                if self.chunk else "whole LM head")
        batches = (f"micro-batches of <= {self.max_tokens} tokens" if self.max_tokens else
                   f"micro-batches of {self.micro_batch_size} samples" if self.micro_batch_size else
                   f"micro-batches of whole groups of {self.group}, the fewest of <= {AUTO_MICRO_TOKENS} tokens")
        return f"{layout}; {head}; {batches}"

    def _layout(self, model) -> str:
        """lean, packed (the HF decoder on one packed row), padded (the HF module) or root (the HF
        module, whole head): what the options ask where it applies. FSDP2-sharded weights take
        root: FSDP2 gathers them when the root module is called, which the packed, lean and
        chunked passes (the decoder, the head) skip."""
        if _sharded(model):
            return "root"
        if self.lean and unsupported_reason(model) is None:
            return "lean"
        return "packed" if self.pack else "padded"

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices into `lengths` (prompt + response tokens per sample), one list per micro-batch."""
        if self.max_tokens:
            return partition_by_tokens(lengths, self.max_tokens)
        n, size = len(lengths), self.micro_batch_size or self._auto_size(lengths)
        return [list(range(s, min(n, s + size))) for s in range(0, n, size)]

    def _auto_size(self, lengths: list[int]) -> int:
        """Samples per micro-batch when micro_batch_size is 0 (the fast path's default): the
        fewest equal runs of whole groups with at most AUTO_MICRO_TOKENS tokens each (a run of
        one group may hold more). A function of the lengths only, so data-parallel ranks can
        count each other's passes (roles/common.pass_counter)."""
        groups = -(-len(lengths) // self.group)
        parts = max(1, -(-sum(lengths) // AUTO_MICRO_TOKENS))
        while True:
            size = -(-groups // parts) * self.group
            if parts >= groups or all(sum(lengths[s:s + size]) <= AUTO_MICRO_TOKENS
                                      for s in range(0, len(lengths), size)):
                return max(size, 1)
            parts += 1

    def log_probs(self, model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                  pad_id: int, with_entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log_probs (B,R), entropy (B,R) or None, response_mask (B,R)), 0 past each response."""
        layout = self._layout(model)
        if layout in ("lean", "packed"):  # the lean forward packs its linear layers whatever `pack` says
            return packed_log_probs(model, prompts, responses, temperature, with_entropy, self.chunk,
                                    self.keep_logits, layout == "lean", self.share_prompts)
        if self.chunk and layout == "padded":
            return padded_chunked_log_probs(model, prompts, responses, temperature, pad_id, with_entropy,
                                            self.chunk, self.keep_logits)
        return response_log_probs(model, prompts, responses, temperature=temperature, pad_id=pad_id,
                                  with_entropy=with_entropy)

    def sum_pi_squared(self, model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                       pad_id: int) -> Tensor:
        """(B, R) sum_v pi(v)^2 of softmax(logits / T) at each response token, 0 past each response
        (the optimal-token baseline's gradient-norm proxy); fast path: the head a chunk at a time."""
        layout = self._layout(model)
        if layout in ("padded", "root"):
            padded = pad_batch(prompts, responses, pad_id, next(model.parameters()).device)
            return sum_pi_squared_from_logits(response_logits(model, padded).float() / temperature) \
                * padded.response_mask
        packed, _, hidden = _packed_hidden(model, prompts, responses, 0, layout == "lean", self.share_prompts)
        head, step = model.get_output_embeddings(), self.chunk or len(hidden) or 1
        flat = [sum_pi_squared_from_logits(head(hidden[s:s + step]).float() / temperature)
                for s in range(0, len(hidden), step)]
        return packed.to_padded(torch.cat(flat) if flat else hidden.new_zeros(0))

    def values(self, critic, prompts: list[list[int]], responses: list[list[int]], pad_id: int):
        """CriticModel.values, packed or padded (or lean: packed linears, per-sequence attention)."""
        layout = self._layout(critic.backbone)
        if layout in ("lean", "packed"):
            return packed_values(critic, prompts, responses, layout == "lean", self.share_prompts)
        return critic.values(prompts, responses, pad_id=pad_id)
