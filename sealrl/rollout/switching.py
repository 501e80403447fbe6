"""Partial rollouts (DESIGN section 10, docs/async.md): a generate call whose in-flight rows
continue under a newer policy version from the next token.

`generate_switching` samples like RolloutEngine.generate, starting from `version`, but once the
tokens of each decode step are in it asks `switch(step, current)` which version samples token
`step` (None: the current one goes on). On a switch, the rows still running are prefilled
again from scratch under the new version (prompt + their response so far, a fresh KV cache: the
old version's cache never serves a new-version token) and go on with the same per-row uniforms
(a function of (candidate seed, step) only, sampling.uniform_noise). So a row's tokens are a
function of (its seed, the versions, the switch steps), and a recorded schedule
(`planned(...)`) regenerates them. Every token's rollout log-prob is the one of the version
that sampled it; each sample records its segments ((first token, version), ...).

Every row of one call switches at the same step (one loop), so a call's schedule is one list of
(step, version); a row that stopped before a switch simply has fewer segments.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sealrl.experience.ids import PolicyVersion, sample_id
from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest, RolloutSample, VersionNotHeldError
from sealrl.rollout.loop import RowOutputs, decode_loop, prefilled
from sealrl.rollout.sampling import candidate_seed
from sealrl.rollout.stops import StopChecker

Switch = Callable[[int, PolicyVersion], "PolicyVersion | None"]


def planned(plan: dict, resolve: Callable[[object], PolicyVersion]) -> Switch:
    """A recorded schedule (a replay): token `step` -> the key of the version that sampled it
    from there on; `resolve(key)` is that version, once the rollout holds it (it may wait)."""
    def switch(step: int, current: PolicyVersion) -> PolicyVersion | None:
        if step not in plan:
            return None
        version = resolve(plan[step])
        return version if version != current else None
    return switch


def live_switch(engine) -> Switch:
    """The clock's schedule: from the next token, the version `engine` activated last, if it
    activated one after this call began (a publication mid-generation)."""
    began = engine.active_version

    def switch(step: int, current: PolicyVersion) -> PolicyVersion | None:
        newest = engine.active_version   # one reference read: a publication swaps it whole
        return newest if newest != began and newest != current else None
    return switch


def wait_held(engine, version: PolicyVersion, poll_s: float = 0.005) -> PolicyVersion:
    """`version` once `engine` serves it (a replay waiting for its publication); raises
    VersionNotHeldError when the engine has gone past its step with another version instead."""
    while True:
        try:
            return engine.serving(version).version
        except VersionNotHeldError:
            active = engine.active_version
            if active is not None and active.step >= version.step:
                raise VersionNotHeldError(f"replay: the record switches to {version}, the rollout "
                                          f"was published {active} instead") from None
        time.sleep(poll_s)


def generate_switching(engine, requests: list[GenerationRequest], contract: SamplingContract,
                       version: PolicyVersion, switch: Switch, stream=None) -> list[RolloutSample]:
    """Every requested candidate, in request then candidate order, with its segments.
    `stream(samples)`: the samples that finished at a decode step, equal to those returned.
    With rollout.max_rows (engine.max_rows) the rows run in waves of at most that many, each
    starting from `version` and switching on its own schedule."""
    started = time.perf_counter()
    engine.check_requests(requests)
    rows = [(req, cand) for req in requests for cand in req.candidates]
    bound = engine.max_rows or len(rows) or 1
    out: list[RolloutSample] = []
    for a in range(0, len(rows), bound):
        out += _segmented(engine, rows[a:a + bound], contract, version, switch, started, stream)
    return out


def _segmented(engine, rows: list[tuple], contract: SamplingContract, version: PolicyVersion, switch: Switch,
               started: float, stream) -> list[RolloutSample]:
    """`rows` ((request, candidate), ...) decoded in one loop from `version`, segment by segment."""
    snap = engine.serving(version)
    seeds = [candidate_seed(req.seed, cand) for req, cand in rows]
    stops = StopChecker(engine.tokenizer, contract.stop)
    out = RowOutputs.empty(len(rows))
    segments = [[(0, snap.version)] for _ in rows]
    running, start, first = list(range(len(rows))), None, 0
    prefixes = [req.prompt_ids for req, _ in rows]
    filtered = contract.filtered

    def sample(i: int, reason, finish_s: float) -> RolloutSample:
        req, cand = rows[i]
        return RolloutSample(sample_id(req.group_id, cand), req.group_id, cand, req.prompt_ids,
                             tuple(out.tokens[i]), tuple(out.log_probs[i]),
                             tuple(out.filtered_log_probs[i]) if filtered else None, reason,
                             segments[i][0][1], seeds[i], finish_s, segments=tuple(segments[i]))
    with torch.inference_mode():
        while running:
            distinct = list(dict.fromkeys(prefixes[r] for r in running))
            if first:   # the new version's own cache: prefill prompt + response so far
                start = prefilled(snap.held, distinct, contract.max_new_tokens - first, engine.device)
            where = {p: i for i, p in enumerate(distinct)}
            asked: list[PolicyVersion] = []

            def interrupt(step: int) -> bool:
                nxt = switch(step + 1, snap.version)
                if nxt is not None and nxt != snap.version:
                    asked.append(nxt)
                return bool(asked)

            def finished(stopped: list[int], sub: RowOutputs, running=running) -> None:   # final (loop.py)
                stream([sample(running[j], sub.reasons[j], sub.finish_s[j]) for j in stopped])
            sub = _rows(out, running)
            decode_loop(snap.held, distinct, [where[prefixes[r]] for r in running], [seeds[r] for r in running],
                        contract, engine.device, engine.eos_ids, stops, started, start=start, first_step=first,
                        out=sub, interrupt=interrupt, on_step=None if stream is None else finished)
            for j, r in enumerate(running):   # the token lists are shared; the per-row scalars come back
                out.reasons[r], out.finish_s[r] = sub.reasons[j], sub.finish_s[j]
            running = [r for r in running if out.reasons[r] is None]
            if not running:
                break
            snap = engine.serving(asked[0])
            first = len(out.tokens[running[0]])   # every running row has sampled the same number of steps
            for r in running:
                prefixes[r] = rows[r][0].prompt_ids + tuple(out.tokens[r])
                segments[r].append((first, snap.version))
    return [sample(i, out.reasons[i], out.finish_s[i]) for i in range(len(rows))]


def _rows(out: RowOutputs, rows: list[int]) -> RowOutputs:
    """The outputs of `rows`, sharing their token lists with `out` (appended in place)."""
    return RowOutputs([out.tokens[r] for r in rows], [out.log_probs[r] for r in rows],
                      [out.filtered_log_probs[r] for r in rows], [out.reasons[r] for r in rows],
                      [out.finish_s[r] for r in rows], [out.kept[r] for r in rows])


def token_steps(sample: RolloutSample) -> list[int]:
    """The step of the version that sampled each response token."""
    bounds = list(sample.segments or ((0, sample.policy_version),)) + [(len(sample.response_ids), None)]
    return [v.step for (a, v), (b, _) in zip(bounds, bounds[1:]) for _ in range(a, b)]
