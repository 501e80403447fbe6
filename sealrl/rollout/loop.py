"""The sampling loop: rows (candidates) share decode states while their tokens coincide.

A state is a distinct token sequence (prompt + response so far). All candidates of a group
start in one state, the prefilled prompt; a row moves to the child state (parent, its sampled
token) after each step. Rows whose tokens coincide share one cache row and one forward: the
same tokens give the same keys, values and logits, so sharing changes nothing but the work.
This generalises "prefill the prompt once and fan out to the candidates" to every later step
(with a confident policy most of a group's candidates agree on the first tokens), and it is
also the compaction: a state no running row points to is dropped from the cache.

What is per row, and never shared: the uniform that draws the token (a function of the
candidate's seed and the step only), the sampled token, its log-probs and the stop decision.
A row's finish time is taken once per step, after the step's tokens reached the host, so rows
that stop at the same step share it exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sealrl.experience.records import SamplingContract, StopReason
from sealrl.rollout.sampling import Workspace, sample_step, uniform_noise
from sealrl.rollout.stops import StopChecker


@dataclass
class RowOutputs:
    """What each row (candidate) produced, indexed by row in request/candidate order."""

    tokens: list[list[int]]
    log_probs: list[list[float]]
    filtered_log_probs: list[list[float]]
    reasons: list[StopReason | None]
    finish_s: list[float]  # seconds from `started` to the end of the step the row stopped at
    kept: list = field(default_factory=list)  # per row, what decode_loop's `keep` returned

    @classmethod
    def empty(cls, rows: int) -> "RowOutputs":
        return cls([[] for _ in range(rows)], [[] for _ in range(rows)],
                   [[] for _ in range(rows)], [None] * rows, [0.0] * rows, [None] * rows)


@dataclass
class _Transition:
    """Which rows go on after a step, and the states they move to."""

    alive: list[int] = field(default_factory=list)    # rows still running
    state: list[int] = field(default_factory=list)    # their new state index
    parents: list[int] = field(default_factory=list)  # per new state: the old state it extends
    feed: list[int] = field(default_factory=list)     # per new state: the token it appends


def _left_pad(prompts: list[tuple[int, ...]], device: torch.device) -> tuple[Tensor, Tensor]:
    """ids (G, P) left-padded with 0 and valid (G, P) bool."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), P), dtype=torch.long)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool)
    for g, p in enumerate(prompts):
        ids[g, P - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[g, P - len(p):] = True
    return ids.to(device), valid.to(device)


def _record(out: RowOutputs, alive: list[int], state: list[int], tokens: Tensor, lps: Tensor,
            flps: Tensor | None, last_step: bool, eos_ids: frozenset[int],
            stop_ids: frozenset[int], stops: StopChecker) -> _Transition:
    """Append each row's token, decide its stop, and map running rows to child states."""
    token_list, lp_list = tokens.tolist(), lps.tolist()
    flp_list = flps.tolist() if flps is not None else None
    nxt, child_of, strings = _Transition(), {}, bool(stops.stop)
    for i, row in enumerate(alive):
        tok = token_list[i]
        out.tokens[row].append(tok)
        out.log_probs[row].append(lp_list[i])
        if flp_list is not None:
            out.filtered_log_probs[row].append(flp_list[i])
        if tok in eos_ids:
            out.reasons[row] = StopReason.EOS
        elif tok in stop_ids or (strings and stops.hit(out.tokens[row])):
            out.reasons[row] = StopReason.STOP
        elif last_step:
            out.reasons[row] = StopReason.LENGTH
        else:
            key = (state[i], tok)
            if key not in child_of:
                child_of[key] = len(nxt.parents)
                nxt.parents.append(state[i])
                nxt.feed.append(tok)
            nxt.alive.append(row)
            nxt.state.append(child_of[key])
    return nxt


@dataclass
class Start:
    """The decode states before the first sampled token: their logits and cache.

    Column `width` of the cache is where the first sampled token is fed; the token at column
    `col` of state s has RoPE position col - pad_len[s]; key_valid (states, max_len) marks the
    real key columns, None when none is padding.
    """

    logits: Tensor                # (G, V) fp32
    cache: object
    width: int
    pad_len: Tensor               # (G,)
    key_valid: Tensor | None


def prefilled(backend, prompts: list[tuple[int, ...]], max_new: int, device: torch.device) -> Start:
    """Prefill each distinct prompt once, left-padded to a common width: one state per prompt."""
    ids, valid = _left_pad(prompts, device)  # (G, P)
    P = ids.shape[1]
    max_len = P + max_new - 1  # the last sampled token is never fed back
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (G, P)
    logits, cache = backend.prefill(ids, positions, valid, max_len)  # (G, V): a state per prompt
    pad_len = P - valid.long().sum(1)  # (G,) per state
    key_valid = None  # per state, only when some prompt is padded
    if not bool(valid.all()):
        key_valid = torch.ones((len(prompts), max_len), dtype=torch.bool, device=device)
        key_valid[:, :P] = valid
    return Start(logits, cache, P, pad_len, key_valid)


def decode_loop(backend, prompts: list[tuple[int, ...]], group_of: list[int], seeds: list[int],
                contract: SamplingContract, device: torch.device, eos_ids: frozenset[int],
                stops: StopChecker, started: float | None = None, start: Start | None = None,
                keep=None, first_step: int = 0, out: RowOutputs | None = None, interrupt=None,
                on_step=None) -> RowOutputs:
    """Prefill each distinct prompt once, then sample all rows until every row stopped.

    prompts (G distinct prompt sequences); group_of[row] = index of the row's prompt;
    seeds[row] = the row's candidate seed; started = time.perf_counter() the finish times are
    measured from (default: entering this function). `start`: decode states built by the
    caller instead of the prefill (a continued turn, rollout/turns.py; prompts unused).
    `keep(cache, states, key_valid)`: called at each step where rows stop (their states), before
    the cache is compacted; what it returns per state is stored in RowOutputs.kept[row].
    A continued segment (rollout/switching.py): `first_step` tokens of every row are already in
    `out` and `start` holds the prefix; `interrupt(step)`, called once the step's tokens are in,
    returns True to return with the running rows unfinished (reason None) before the next step.
    `on_step(rows, out)`: called after every step with the rows that stopped at it (often none),
    whose outputs in `out` are then final: a caller streams finished rows on (reward.stream) while others decode.
    """
    started = time.perf_counter() if started is None else started
    max_new = contract.max_new_tokens
    if start is None:
        start = prefilled(backend, prompts, max_new, device)
    logits, cache, P, pad_len, key_valid = start.logits, start.cache, start.width, start.pad_len, start.key_valid
    start = None   # the prefill's cache is freed at the first fan-out, not kept for the call
    noise = uniform_noise(torch.tensor(seeds, dtype=torch.int64, device=device),
                          torch.arange(max_new, device=device))  # (N, max_new) per row
    out = RowOutputs.empty(len(seeds)) if out is None else out
    alive, state = list(range(len(seeds))), list(group_of)
    stop_ids = frozenset(contract.stop_token_ids)
    work = Workspace(device)  # the sampler's full-vocabulary buffers, reused every step
    for step in range(first_step, max_new):
        u = noise[torch.tensor(alive, device=device), step]  # (B,)
        tokens, lps, flps = sample_step(logits, torch.tensor(state, device=device), u,
                                        contract.temperature, contract.top_k, contract.top_p, work)
        nxt = _record(out, alive, state, tokens, lps, flps, step == max_new - 1, eos_ids,
                      stop_ids, stops)
        now = time.perf_counter() - started
        stopped_rows = sorted(set(alive).difference(nxt.alive))  # rows that stopped at this step
        for row in stopped_rows:
            out.finish_s[row] = now
        if keep is not None and len(nxt.alive) < len(alive):
            going = set(nxt.alive)
            stopped = [(row, state[i]) for i, row in enumerate(alive) if row not in going]
            for (row, _), kept in zip(stopped, keep(cache, [s for _, s in stopped], key_valid)):
                out.kept[row] = kept
        if on_step is not None:
            on_step(stopped_rows, out)
        if not nxt.alive or (interrupt is not None and interrupt(step)):
            break
        if nxt.parents != list(range(logits.shape[0])):  # states split or ended: new layout
            parents = torch.tensor(nxt.parents, device=device)
            cache, pad_len = backend.select(cache, parents), pad_len[parents]
            key_valid = None if key_valid is None else key_valid.index_select(0, parents)
        col = P + step - first_step  # cache column of the token being fed
        step_valid = None if key_valid is None else key_valid[:, :col + 1]
        feed = torch.tensor(nxt.feed, device=device)
        logits = backend.decode(cache, feed, col - pad_len, step_valid)  # (U, V)
        alive, state = nxt.alive, nxt.state
    return out
