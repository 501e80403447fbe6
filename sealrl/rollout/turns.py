"""KV caches carried from one turn of an episode to the next, within one version (episodes.py).

A row (one candidate of one request) stops at eos, a stop string or its budget; at that step
its cache holds the keys and values of every token it fed: its prompt and its sampled tokens
but the last (a sampled token is fed only when the next one is drawn). `TurnCache` keeps that
block, compacted to its real columns, (c, layers, 2, H_kv, D), keyed by (group id, candidate)
with the c token ids it covers. The next turn's request for that row carries the episode's
sequence so far; the longest prefix the block covers is not fed again: only the rest (the
last sampled token, then the observation ids as encoded once) runs through the model, on top
of the block, and decoding goes on from there. Rows whose sequences are equal share one decode
state, as identical prompts share one prefill (a confident policy's candidates often make the
same call and get the same answer; decoding them apart cost 3x the re-prefill's time).

Layout of a continued batch (the lean cache puts every row's new token at the same column):
the blocks are right-aligned at column S (the longest block), the new tokens of each row
right-aligned in columns [S, S + F) (F the longest feed), and decoding starts at S + F. A row's
unused columns are zero and masked: attention is a sum over keys, so a masked gap between a
row's block and its feed changes nothing but float rounding (keys keep the RoPE positions they
were computed at; the feed takes positions c, c+1, ...). Rows with no usable block feed their
whole prompt from an empty block (the same path).

Why a cache is bound to one version: its keys and values were computed with that version's
weights. A TurnCache is made for one EpisodeRunner.generate call, which samples every turn with
the one version it holds, and the engine refuses it for any other version or backend. The HF
fallback backend does not keep blocks: its turns prefill their sequence again (same numbers).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sealrl.rollout.lean import KVCache, LeanCausalLM
from sealrl.rollout.loop import RowOutputs, Start, decode_loop


def keep_rows(cache: KVCache, states: list[int], key_valid: Tensor | None) -> list[Tensor]:
    """The real key/value columns of each decode state in `states`, in order: (c, layers, 2,
    H_kv, D) each, gathered in one copy."""
    uniq = list(dict.fromkeys(states))   # rows sharing a state share its block
    if len(uniq) < len(states):
        blocks = dict(zip(uniq, keep_rows(cache, uniq, key_valid)))
        return [blocks[s] for s in states]
    n = cache.length
    if key_valid is None:
        cols = torch.arange(n, device=cache.kv.device).repeat(len(states))
        rows, lengths = torch.tensor(states, device=cache.kv.device).repeat_interleave(n), [n] * len(states)
    else:
        rows, cols = key_valid[states, :n].nonzero(as_tuple=True)   # row-major: each state's columns in order
        lengths = torch.bincount(rows, minlength=len(states)).tolist()
        rows = torch.tensor(states, device=cache.kv.device)[rows]
    return list(cache.kv[cols, :, :, rows].split(lengths))   # (sum c, L, 2, H_kv, D), split per state


def continued(lm: LeanCausalLM, blocks: list[Tensor | None], feeds: list[tuple[int, ...]], max_new: int,
              device: torch.device) -> Start:
    """Decode states (one per row) from kept blocks (None: empty) plus the tokens each row feeds on top."""
    B = len(blocks)
    c = torch.tensor([0 if b is None else b.shape[0] for b in blocks], device=device)   # (B,)
    f = torch.tensor([len(x) for x in feeds], device=device)                              # (B,)
    S, F = int(c.max()), int(f.max())
    P, max_len = S + F, S + F + max_new - 1
    cache = lm.new_cache(B, max_len)
    cache.kv[:S].zero_()   # masked columns hold zeros, never garbage (0 * NaN is NaN)
    col = torch.arange(max_len, device=device)[None, :]   # (1, max_len)
    key_valid = ((col >= S - c[:, None]) & (col < S)) | (col >= P - f[:, None])   # (B, max_len)
    if S:
        rows, cols = key_valid[:, :S].nonzero(as_tuple=True)   # row-major, as the blocks are concatenated
        cache.kv[cols, :, :, rows] = torch.cat([b for b in blocks if b is not None])
    ids = torch.tensor([(0,) * (F - len(x)) + tuple(x) for x in feeds], dtype=torch.long, device=device)  # (B, F)
    positions = (c[:, None] + torch.arange(F, device=device)[None, :] - (F - f[:, None])).clamp(min=0)
    cache.length = S
    query_col = S + torch.arange(F, device=device)
    causal = col[:, :P] <= query_col[:, None]     # (F, P)
    own = col[:, :P] == query_col[:, None]        # padding queries attend to themselves (no NaN)
    mask = (key_valid[:, None, :P] & causal[None]) | own[None]   # (B, F, P)
    logits = lm.forward(ids, positions, cache, mask[:, None])
    return Start(logits, cache, P, P - c - f, None if bool(key_valid.all()) else key_valid)


class TurnCache:
    """Kept KV blocks of one version's rows, for their next turn (see the module docstring)."""

    def __init__(self, version) -> None:
        self.version = version
        self._backend = None
        self._rows: dict[tuple[str, int], tuple[tuple[int, ...], Tensor]] = {}
        self.fed_tokens = 0      # tokens run through the model (prefill or continued feed)
        self.reused_tokens = 0   # tokens whose keys and values came from a kept block

    def bind(self, version, backend) -> None:
        """Refuse any other version, or another backend of it, than the one that filled it."""
        if version != self.version:
            raise ValueError(f"a turn cache of {self.version} asked to serve {version}: "
                             "KV caches are never reused across versions")
        if self._backend is None:
            self._backend = backend
        elif backend is not self._backend:
            raise ValueError(f"a turn cache of {self.version} asked to serve another backend")

    def forget(self, keys) -> None:
        """Drop the blocks of rows that will not continue (their episode ended)."""
        for k in keys:
            self._rows.pop(k, None)

    def _split(self, key: tuple[str, int], prompt: tuple[int, ...]) -> tuple[int, Tensor | None]:
        """(m, block of prompt[:m]): the longest kept prefix of `prompt`, leaving one token to feed."""
        covered, block = self._rows.pop(key, ((), None))
        m, top = 0, min(len(covered), len(prompt) - 1)
        while m < top and covered[m] == prompt[m]:
            m += 1
        return m, None if block is None else block[:m]

    def decode(self, backend, keys: list[tuple[str, int]], prompts: list[tuple[int, ...]], seeds: list[int],
               contract, device: torch.device, eos_ids: frozenset[int], stops, started: float, on_step=None
               ) -> RowOutputs:
        """decode_loop over rows `keys` (prompt, seed each), reusing and then keeping their blocks."""
        splits = [self._split(k, p) for k, p in zip(keys, prompts)]
        # Rows with the same sequence share one state, as identical prompts do in a prefill (a
        # confident policy's candidates often make the same call and get the same answer).
        distinct: dict[tuple[int, ...], tuple[int, Tensor | None]] = {}
        for p, (m, block) in zip(prompts, splits):
            if p not in distinct or m > distinct[p][0]:
                distinct[p] = (m, block)
        index = {p: i for i, p in enumerate(distinct)}
        if not any(m for m, _ in distinct.values()):    # a first turn: each distinct prompt prefilled once
            self.fed_tokens += sum(len(p) for p in distinct)
            out = decode_loop(backend, list(distinct), [index[p] for p in prompts], seeds, contract, device,
                              eos_ids, stops, started, keep=keep_rows, on_step=on_step)
        else:
            blocks = [b if m else None for m, b in distinct.values()]
            feeds = [p[m:] for p, (m, _) in distinct.items()]
            self.fed_tokens += sum(len(x) for x in feeds)
            self.reused_tokens += sum(m for m, _ in distinct.values())
            start = continued(backend.lm, blocks, feeds, contract.max_new_tokens, device)
            out = decode_loop(backend, [], [index[p] for p in prompts], seeds, contract, device, eos_ids, stops,
                              started, start=start, keep=keep_rows, on_step=on_step)
        for k, p, tokens, block in zip(keys, prompts, out.tokens, out.kept):
            covered = p + tuple(tokens[:-1])
            assert block.shape[0] == len(covered), (block.shape, len(covered))   # the block is its ids
            self._rows[k] = (covered, block)
        out.kept = [None] * len(keys)
        return out
