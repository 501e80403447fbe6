"""A bounded number of decode rows: fixed waves, or continuous batching (`rollout.max_rows`;
runs use continuous batching, the waves remain as the baseline benchmarks/continuous.py measures).

`decode_loop` runs every row of a generate call at once. With `max_rows` > 0 at most that many
rows decode together (the KV cache holds at most that many rows: the memory bound of a large
model), as whole requests (a prompt is prefilled once and fanned out to its candidates):

- **waves** (`waves`): the requests are cut into consecutive waves of at most `max_rows` rows,
  each one decode_loop; a wave runs as long as its longest response, its finished rows idle.
- **continuous** (`continuous`): after every step, waiting requests are admitted into the rows
  that finished, while the others keep decoding. A new prompt is prefilled straight into the
  running cache's columns: left-padded so that its last token sits just before the column the
  running rows feed next, its earlier columns masked (key_valid), its RoPE positions its own
  (col - pad_len, as every state's); the merged cache is then trimmed of the leading columns no
  state reads. A row's randomness is its seed and its own step (sampling.py), its stop budget
  its own max_new_tokens.

What is the same and what is not: every row samples from logits of the same prompt and
prefix, so ids are those of the static path whenever the float rounding of its logits does
not move a draw across a CDF boundary; the log-probs agree to rounding (the tests: ids equal,
log-probs within 1e-5 of the unbounded path on the tiny model). They are not bitwise in
general: on CPU a GEMM's rounding can depend on how many rows share it, and attention reads a
different number of masked columns. So both modes are opt-in, and the default (max_rows=0)
is the unbounded decode_loop, unchanged. Lean backend only (the HF cache has no column
layout to splice into): the engine runs waves there.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from sealrl.experience.records import SamplingContract
from sealrl.rollout.lean import KVCache
from sealrl.rollout.loop import RowOutputs, _record, _Transition, decode_loop, prefilled
from sealrl.rollout.sampling import Workspace, sample_step, uniform_noise
from sealrl.rollout.stops import StopChecker


def waves(request_rows: list[list[int]], max_rows: int) -> list[list[int]]:
    """Consecutive runs of whole requests (their rows) of at most max_rows rows each (a
    request larger than max_rows is a wave of its own)."""
    out, cur = [], []
    for rows in request_rows:
        if cur and len(cur) + len(rows) > max_rows:
            out.append(cur)
            cur = []
        cur = cur + rows
    return out + ([cur] if cur else [])


def run_waves(backend, prompts, group_of, seeds, contract, device, eos_ids, stops, started, request_rows,
              max_rows, on_step=None) -> RowOutputs:
    """decode_loop wave after wave; outputs by row as one call's."""
    out = RowOutputs.empty(len(seeds))
    for wave in waves(request_rows, max_rows):
        used = sorted({group_of[r] for r in wave})

        def copy(local: RowOutputs, rows: list[int]) -> list[int]:
            for i in rows:
                r = wave[i]
                out.tokens[r], out.log_probs[r] = local.tokens[i], local.log_probs[i]
                out.filtered_log_probs[r], out.reasons[r] = local.filtered_log_probs[i], local.reasons[i]
                out.finish_s[r] = local.finish_s[i]
            return [wave[i] for i in rows]
        hook = None if on_step is None else (lambda rows, local: on_step(copy(local, rows), out))
        local = decode_loop(backend, [prompts[g] for g in used], [used.index(group_of[r]) for r in wave],
                            [seeds[r] for r in wave], contract, device, eos_ids, stops, started, on_step=hook)
        copy(local, range(len(wave)))
    return out


class _Batch:
    """The running states: their logits, cache, pad lengths and key validity (all columns)."""

    def __init__(self, logits: Tensor, cache: KVCache, pad_len: Tensor, key_valid: Tensor, col: int):
        self.logits, self.cache, self.pad_len, self.key_valid, self.col = logits, cache, pad_len, key_valid, col

    def select(self, parents: Tensor) -> None:
        self.cache, self.pad_len = self.cache.select(parents), self.pad_len[parents]
        self.key_valid = self.key_valid.index_select(0, parents)


def _admit(backend, batch: _Batch | None, prompts: list[tuple[int, ...]], max_new: int, device) -> _Batch:
    """`batch` plus one state per new prompt, prefilled at the columns that end where the running
    rows feed next; the result trimmed of the columns no state reads."""
    lm = backend.lm
    if batch is None:
        start = prefilled(backend, prompts, max_new, device)
        kv = start.key_valid if start.key_valid is not None else \
            torch.ones((len(prompts), start.cache.kv.shape[0]), dtype=torch.bool, device=device)
        return _Batch(start.logits, start.cache, start.pad_len, kv, start.width)
    col, width = batch.col, max(len(p) for p in prompts)
    if width > col:   # the new prompt needs more columns before the feed column: shift everything right
        _shift(batch, width - col)
        col = batch.col
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for g, p in enumerate(prompts):
        ids[g, width - len(p):], valid[g, width - len(p):] = torch.tensor(p), True
    ids, valid = ids.to(device), valid.to(device)
    T = col + max_new - 1   # the new rows' last fed column is col + max_new - 2
    fresh = KVCache(torch.zeros((T, *batch.cache.kv.shape[1:3], len(prompts), *batch.cache.kv.shape[4:]),
                                dtype=batch.cache.kv.dtype, device=device), lm.rope_factors(T), col - width)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = torch.zeros((len(prompts), width, col), dtype=torch.bool, device=device)
    mask[:, :, col - width:] = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    logits = lm.forward(ids, positions, fresh, mask[:, None])
    pad_new = col - valid.long().sum(1)
    T = max(T, batch.cache.kv.shape[0])
    kv = torch.zeros((T, *batch.cache.kv.shape[1:3], batch.cache.kv.shape[3] + len(prompts),
                      *batch.cache.kv.shape[4:]), dtype=batch.cache.kv.dtype, device=device)
    torch.cat([batch.cache.kv[:col], fresh.kv[:col]], dim=3, out=kv[:col])
    key_valid = torch.zeros((kv.shape[3], T), dtype=torch.bool, device=device)
    key_valid[:batch.key_valid.shape[0], :batch.key_valid.shape[1]] = batch.key_valid
    key_valid[:batch.key_valid.shape[0], batch.key_valid.shape[1]:] = True
    key_valid[batch.key_valid.shape[0]:] = torch.arange(T, device=device)[None, :] >= pad_new[:, None]
    merged = _Batch(torch.cat([batch.logits, logits]), KVCache(kv, lm.rope_factors(T), col),
                    torch.cat([batch.pad_len, pad_new]), key_valid, col)
    _trim(merged)
    return merged


def _shift(batch: _Batch, c: int) -> None:
    """Move every column right by c (positions unchanged: pad_len moves with them)."""
    old = batch.cache
    kv = torch.zeros((old.kv.shape[0] + c, *old.kv.shape[1:]), dtype=old.kv.dtype, device=old.kv.device)
    kv[c:c + old.length] = old.kv[:old.length]
    key_valid = torch.zeros((batch.key_valid.shape[0], batch.key_valid.shape[1] + c), dtype=torch.bool,
                            device=batch.key_valid.device)
    key_valid[:, c:] = batch.key_valid
    batch.cache = KVCache(kv, old.rope, old.length + c)   # positions unchanged: the same RoPE factors
    batch.key_valid, batch.pad_len, batch.col = key_valid, batch.pad_len + c, batch.col + c


def _trim(batch: _Batch) -> None:
    """Drop the leading columns that no state reads (every state's first valid column is pad_len)."""
    c = int(batch.pad_len.min())
    if c <= 0:
        return
    old = batch.cache
    kv = old.kv[c:].clone()
    batch.cache = KVCache(kv, old.rope, old.length - c)
    batch.key_valid, batch.pad_len, batch.col = batch.key_valid[:, c:], batch.pad_len - c, batch.col - c


def continuous(backend, prompts: list[tuple[int, ...]], group_of: list[int], seeds: list[int],
               contract: SamplingContract, device: torch.device, eos_ids: frozenset[int], stops: StopChecker,
               started: float, request_rows: list[list[int]], max_rows: int, on_step=None) -> RowOutputs:
    """Sample every row with at most max_rows running, admitting whole requests as rows finish."""
    max_new = contract.max_new_tokens
    noise = uniform_noise(torch.tensor(seeds, dtype=torch.int64, device=device),
                          torch.arange(max_new, device=device))  # (N, max_new) per row
    out, work, stop_ids = RowOutputs.empty(len(seeds)), Workspace(device), frozenset(contract.stop_token_ids)
    waiting, batch, alive, state, first = list(request_rows), None, [], [], {}
    step = 0
    while waiting or alive:
        # admit when a quarter of the rows are free (or none run): each admission is a prefill
        # forward and a cache copy, about a decode step's cost, so admitting every freed group
        # one at a time would cost more steps than it saves
        if waiting and (not alive or len(alive) + max(len(waiting[0]), max_rows // 4) <= max_rows):
            new = []
            while waiting and (not alive and not new or len(alive) + len(new) + len(waiting[0]) <= max_rows):
                new += waiting.pop(0)
            gs = list(dict.fromkeys(group_of[r] for r in new))
            base = 0 if batch is None else batch.logits.shape[0]
            batch = _admit(backend, batch, [prompts[g] for g in gs], max_new, device)
            alive, state = alive + new, state + [base + gs.index(group_of[r]) for r in new]
            first.update((r, step) for r in new)
        local = torch.tensor([step - first[r] for r in alive], device=device)
        u = noise[torch.tensor(alive, device=device), local]
        tokens, lps, flps = sample_step(batch.logits, torch.tensor(state, device=device), u,
                                        contract.temperature, contract.top_k, contract.top_p, work)
        nxt = _step(out, alive, state, tokens, lps, flps, [step - first[r] == max_new - 1 for r in alive],
                    eos_ids, stop_ids, stops)
        now = time.perf_counter() - started
        stopped = sorted(set(alive).difference(nxt.alive))
        for row in stopped:
            out.finish_s[row] = now
        if on_step is not None:
            on_step(stopped, out)
        step += 1
        alive, state = nxt.alive, nxt.state
        if not alive:   # every row stopped: the next requests start a fresh cache
            batch = None
            continue
        if nxt.parents != list(range(batch.logits.shape[0])):   # states split or ended: new layout
            batch.select(torch.tensor(nxt.parents, device=device))
        feed = torch.tensor(nxt.feed, device=device)
        batch.logits = backend.decode(batch.cache, feed, batch.col - batch.pad_len,
                                      batch.key_valid[:, :batch.col + 1])
        batch.col += 1
    return out


def _step(out: RowOutputs, alive, state, tokens, lps, flps, last: list[bool], eos_ids, stop_ids, stops
          ) -> _Transition:
    """loop._record with a last-step flag per row: rows at their budget are recorded apart."""
    idx_last = [i for i, x in enumerate(last) if x]
    idx_go = [i for i, x in enumerate(last) if not x]

    def part(idx, is_last):
        t = torch.tensor(idx, dtype=torch.long, device=tokens.device)
        return _record(out, [alive[i] for i in idx], [state[i] for i in idx], tokens[t], lps[t],
                       None if flps is None else flps[t], is_last, eos_ids, stop_ids, stops)
    if idx_last:
        part(idx_last, True)
    return part(idx_go, False) if idx_go else _Transition()
