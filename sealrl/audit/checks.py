"""The audit checks: one small function per invariant of DESIGN sections 3-4, each yielding
Violations. Names are stable (they are what `sealrl audit` prints and what tests match on).

A check skips files the loader could not read (the seal check reports them) and skips a
comparison whose reference value is itself broken (a file with two policy versions), which the
check owning that value reports: one corruption is named by its check, not by all of them. The
seal covers facts only; consumed_step (experience/consumed.jsonl, written after the update),
extra.* columns and derived fields (scores) are outside the digest, and the checks below are
what hold them to account.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Callable, Iterator

from sealrl.audit.derived import check_chain, check_derived, check_scorers
from sealrl.audit.episodes import check_episodes
from sealrl.audit.folder import IterationFile, RunFolder
from sealrl.audit.ledger import SCORE_TOL, check_ledger
from sealrl.audit.report import Violation
from sealrl.audit.staleness import actor_step_before, committed_chain, row_oldest, staleness_problem, step_of
from sealrl.config import ConfigError
from sealrl.experience.fields import FIELDS, Align
from sealrl.experience.ids import PolicyVersion, group_id, split_sample_id
from sealrl.experience.store import changed_cells, read_iteration
from sealrl.rewards.from_config import components

Check = Callable[[RunFolder], Iterator[Violation]]

LOG_PROB_FIELDS = ("rollout_log_probs", "filtered_log_probs", "old_log_probs", "ref_log_probs")
# log_softmax is <= 0 exactly in float32 on CPU; leave room for other kernels' last-bit rounding.
LOG_PROB_EPS = 1e-6
OLD_PRODUCER = {"recompute": "actor", "bypass": "rollout"}


def check_config(run: RunFolder) -> Iterator[Violation]:
    """config.yaml still hashes to the hash written with it (and to run.json's), so the
    settings the other checks judge by (group size, reward-error policy) are the run's own."""
    v = lambda msg: Violation("config", msg)  # noqa: E731
    actual = run.config_hash
    if run.config_hash_line != actual:
        yield v(f"config.yaml hashes to {actual} but its first line records {run.config_hash_line or 'no hash'}: "
                "the effective config was edited after the run")
    if run.run_meta and run.run_meta.get("config_hash") != actual:
        yield v(f"run.json records config hash {run.run_meta.get('config_hash')}, config.yaml hashes to {actual}")


def check_seal(run: RunFolder) -> Iterator[Violation]:
    """Every iteration file is a sealed batch of this run whose facts still match the digest."""
    for f in run.files:
        v = lambda msg: Violation("seal", msg, f.iteration)  # noqa: E731, B023
        if not f.readable:
            yield v(f.error)
            continue
        if f.meta.get("iteration") != f.iteration:
            yield v(f"{f.path.name} holds iteration {f.meta.get('iteration')} (schema metadata)")
        if f.meta.get("run_id") != run.run_id:
            yield v(f"file belongs to run {f.meta.get('run_id')!r}, not {run.run_id!r}")
        if not f.meta.get("seal_digest"):
            yield v("no seal digest: unsealed experience was stored")
            continue
        try:
            read_iteration(f.path)
        except Exception as e:  # any failure to rebuild the sealed batch is a finding
            try:
                cells = changed_cells(f.path)
            except Exception:  # noqa: BLE001 - too damaged to name cells: the digest finding stands
                cells = []
            named = f"; changed: {'; '.join(cells)}" if cells else ""
            yield v(f"facts do not rebuild the sealed batch: {type(e).__name__}: {e}{named}")


def check_used_once(run: RunFolder) -> Iterator[Violation]:
    """Each trained sample is in one file, once; consumed_step is set, constant within a file and
    never decreasing across iterations (each batch is consumed by one later update; it stays
    equal only across an iteration whose optimizer steps were all skipped, which
    check_policy_version holds to publishing nothing)."""
    seen: dict[str, list[int]] = defaultdict(list)
    prev: tuple[int, int] | None = None            # (iteration, consumed_step)
    for error in run.consumed_errors:
        yield Violation("used_once", error)
    files = {f.iteration for f in run.files}
    for it in sorted(set(run.consumed) - files):
        yield Violation("used_once", "consumed.jsonl records the consumption of an iteration with no experience file",
                        it)
    for f in run.readable:
        for sid in f.cols.get("sample_id", ()):
            seen[sid].append(f.iteration)
        bad_iters = sorted({i for i in f.cols.get("iteration", ()) if i != f.iteration})
        if bad_iters:
            yield Violation("used_once", f"rows of iterations {bad_iters} stored in this iteration's file", f.iteration)
        if f.num_rows == 0:
            yield Violation("used_once", "the iteration file holds no samples", f.iteration)
            continue
        if len(f.consumed) > 1:
            yield Violation("used_once", f"consumed {len(f.consumed)} times (steps "
                            f"{[c.get('consumed_step') for c in f.consumed]} in consumed.jsonl)", f.iteration)
            continue
        steps = set(f.cols["consumed_step"])
        if None in steps and f.iteration in run.in_flight:   # stopped during its update: a note, not a fault
            continue
        if None in steps:
            yield Violation("used_once", "consumed_step is not set: no update is recorded as consuming these samples "
                            "(no line in experience/consumed.jsonl; a run stopped during this iteration's update "
                            "redoes it on resume=auto)", f.iteration)
            continue
        if len(steps) > 1:
            yield Violation("used_once", f"rows consumed by different steps {sorted(steps)}", f.iteration)
            continue
        step = steps.pop()
        if prev is not None and step < prev[1]:
            yield Violation("used_once", f"consumed_step {step} is before iteration {prev[0]}'s {prev[1]}",
                            f.iteration)
        prev = (f.iteration, step)
    for sid, iters in seen.items():
        if len(iters) > 1:
            yield Violation("used_once", f"trained {len(iters)} times (iterations {iters})", iters[-1], sample_id=sid)


def check_groups_complete(run: RunFolder) -> Iterator[Violation]:
    """A group reaches the loss whole: rollout.n candidates 0..n-1 of one prompt, ids consistent."""
    n = run.cfg.rollout.n
    for f in run.readable:
        c = f.cols
        ns = {json.loads(s).get("n") for s in set(c.get("sampling", ()))}
        if ns - {n}:
            yield Violation("groups_complete", f"sampling contract n={sorted(ns)} but rollout.n={n}", f.iteration)
        for g, rows in f.groups.items():
            v = lambda msg: Violation("groups_complete", msg, f.iteration, g)  # noqa: E731, B023
            prompts = {c["prompt_id"][i] for i in rows}
            if len(prompts) > 1:
                yield v(f"mixes prompts {sorted(prompts)}")
            if len({tuple(c["prompt_ids"][i]) for i in rows}) > 1:
                yield v("rows carry different prompt token ids")
            for i in rows:
                if g != group_id(run.run_id, c["iteration"][i], c["prompt_id"][i]):
                    yield v(f"group id is not run/iteration/prompt = "
                            f"{group_id(run.run_id, c['iteration'][i], c['prompt_id'][i])}")
                    break
            cands = []
            for i in rows:
                sid = c["sample_id"][i]
                try:
                    sg, cand = split_sample_id(sid)
                except ValueError as e:
                    yield Violation("groups_complete", str(e), f.iteration, g, sid)
                    continue
                if sg != g:
                    yield Violation("groups_complete", f"sample id is not group/candidate of group {g}",
                                    f.iteration, g, sid)
                cands.append(cand)
            if len(rows) != n or sorted(cands) != list(range(n)):
                yield v(f"{len(rows)} samples with candidates {sorted(cands)}; a complete group has "
                        f"rollout.n={n}: 0..{n - 1}")


def check_policy_version(run: RunFolder) -> Iterator[Violation]:
    """One declared policy version of this run per iteration, and the chain holds: iteration i
    samples from a version at most rollout.max_staleness commits before the one its update
    starts from, the version iteration i-1's update committed (step 0 for iteration 0): with
    max_staleness 0, exactly that version (audit/staleness.py)."""
    bound, chain = run.cfg.rollout.max_staleness, committed_chain(run)
    for f in run.readable:
        v = lambda msg: Violation("policy_version", msg, f.iteration)  # noqa: E731, B023
        used = set(f.cols.get("policy_version", ()))
        if len(used) != 1:
            yield v(f"samples carry {len(used)} policy versions {sorted(used)}; an iteration samples from one")
            continue
        pv = used.pop()
        declared = f.meta.get("versions", {})
        if pv not in declared:
            yield v(f"policy version {pv} is not declared in the file's versions {sorted(declared)}")
            continue
        version = PolicyVersion.from_json(declared[pv])
        if version.id != pv:
            yield v(f"declared version of {pv} hashes to {version.id}")
        if version.run_id != run.run_id:
            yield v(f"policy version {pv} belongs to run {version.run_id!r}, not {run.run_id!r}")
        expected = actor_step_before(run, f.iteration)
        if expected is None:
            yield v(f"iteration {f.iteration - 1} has no file with one consumed_step (missing, unreadable "
                    "or mixed): the version chain cannot be followed")
            continue
        problem = staleness_problem(chain, expected, version.step, bound)
        if problem:
            yield v(f"sampled by {pv} (step {version.step}) but the version committed before this iteration "
                    f"is step {expected}: {problem}")
        else:
            yield from _token_versions(f, version.step, {PolicyVersion.from_json(d).step for d in declared.values()},
                                       chain, expected, bound)
        consumed = f.one("consumed_step")
        # equal: every optimizer step of the iteration was skipped (non-finite gradients), so no
        # new version was committed; the next iteration's chain check then holds it to that
        if consumed is not None and consumed < expected:
            yield v(f"consumed at step {consumed}, before the step {expected} its update started from")
        elif consumed is not None:
            actor = run.cfg.actor   # steps skipped for a non-finite gradient do not count: at most
            most = actor.ppo_epochs * -(-f.num_rows // (actor.mini_batch_size or f.num_rows))
            if consumed - expected > most:
                yield v(f"{consumed - expected} optimizer steps consumed {f.num_rows} samples; "
                        f"actor.ppo_epochs x minibatches allow at most {most}")


def _token_versions(f: IterationFile, step: int, declared: set[int], chain: list[int], actor: int,
                    bound: int) -> Iterator[Violation]:
    """Partial rollouts: every token's version declared, the first the sample's own, and the
    staleness of the oldest within the bound (audit/staleness.py row_oldest)."""
    for row in range(f.num_rows if "token_versions" in f.cols else 0):
        oldest, wrong = row_oldest(f, row, step, declared)
        problem = wrong or staleness_problem(chain, actor, oldest, bound)
        if problem:
            yield Violation("policy_version", f"token versions (oldest step {oldest}, the version committed before "
                            f"this iteration is step {actor}): {problem}", f.iteration,
                            sample_id=f.cols["sample_id"][row])


def check_masks(run: RunFolder) -> Iterator[Violation]:
    """Token-aligned lists are as long as the response; log-probs finite and <= 0; other float
    token fields finite."""
    for f in run.readable:
        c = f.cols
        token_fields = [n for n, s in FIELDS.items() if s.align is Align.TOKEN and n in c]
        if "response_mask" not in c:
            yield Violation("masks", "no response_mask column", f.iteration)
        for i in range(f.num_rows):
            length, sid = len(c["response_ids"][i]), c["sample_id"][i]
            for name in token_fields:
                row = c[name][i]
                if row is None or len(row) != length:
                    got = "null" if row is None else f"length {len(row)}"
                    yield Violation("masks", f"{name} has {got}, response has {length} tokens",
                                    f.iteration, sample_id=sid)
                    continue
                if name == "response_mask":
                    continue
                bad = next((t for t, x in enumerate(row) if x is None or not math.isfinite(x)), None)
                if bad is not None:
                    yield Violation("masks", f"{name}[{bad}] = {row[bad]} is not finite", f.iteration, sample_id=sid)
                elif name in LOG_PROB_FIELDS and max(row, default=0.0) > LOG_PROB_EPS:
                    t = max(range(length), key=row.__getitem__)
                    yield Violation("masks", f"{name}[{t}] = {row[t]} > 0 is not a log-probability",
                                    f.iteration, sample_id=sid)


def check_provenance(run: RunFolder) -> Iterator[Violation]:
    """Each field was written by a role declared for it (FIELDS), with the version it must have."""
    algo = run.cfg.algorithm
    reference_versions = set()
    for f in run.readable:
        v = lambda msg: Violation("provenance", msg, f.iteration)  # noqa: E731, B023
        fields, c = f.meta.get("fields", {}), f.cols
        for name, prov in fields.items():
            spec = FIELDS.get(name)
            if spec is None:
                yield v(f"field {name!r} is not declared in sealrl.experience.fields")
            elif prov.get("producer") not in {r.value for r in spec.producers}:
                yield v(f"{name} produced by {prov.get('producer')!r}; declared producers: "
                        f"{'/'.join(r.value for r in spec.producers)}")
        column = lambda name: "reward_status" if name == "reward_records" else name  # noqa: E731
        for name in sorted(n for n in FIELDS if column(n) in c and n not in fields):
            yield v(f"column {column(name)} has no recorded producer and version")
        for name in sorted(n for n in fields if column(n) not in c):
            yield v(f"field {name} is declared in the metadata but has no column")
        policy = f.one("policy_version")     # several versions: the policy_version check reports it
        for name in ("response_mask", "rollout_log_probs", "filtered_log_probs", "token_versions"):
            if name in fields and policy is not None and fields[name].get("version") != policy:
                yield v(f"{name} has version {fields[name].get('version')}, samples were drawn by {policy}")
        yield from _old_log_probs(f, fields, policy, algo.old_log_prob, v, actor_step_before(run, f.iteration)
                                  if run.cfg.rollout.max_staleness else None)
        ref = fields.get("ref_log_probs")
        named = f.one("extra.reference_version")
        if ref is not None:
            reference_versions.add(ref.get("version"))
            if not named or ref.get("version") != named:
                yield v(f"ref_log_probs has version {ref.get('version')}, the reference of the run is {named!r}")
            if ref.get("version") in f.meta.get("versions", {}):
                yield v("ref_log_probs carries a policy version: the reference acted as the policy")
        elif algo.kl_coef > 0:
            yield v(f"algorithm.kl_coef={algo.kl_coef} but no ref_log_probs were recorded")
        if algo.name == "ppo" and "values" not in fields:
            yield v("PPO run without critic values")
        if algo.name == "remax" and "baseline_scores" not in fields:
            yield v("ReMax run without baseline_scores (the greedy responses' rewards)")
        if "reward_records" in fields:
            versions = {f"{s}@{ver}" for s, ver in zip(c.get("reward_scorer", ()), c.get("reward_scorer_version", ()))}
            if fields["reward_records"].get("version") and versions != {fields["reward_records"]["version"]}:
                yield v(f"reward records of scorers {sorted(versions)}, field version "
                        f"{fields['reward_records']['version']}")
    if len(reference_versions) > 1:
        yield Violation("provenance", f"the frozen reference changed version during the run: "
                        f"{sorted(reference_versions)}")


def _old_log_probs(f: IterationFile, fields: dict, policy: str | None, configured: str, v,
                   actor_step: int | None = None) -> Iterator[Violation]:
    """`actor_step` (rollout.max_staleness > 0): the step of the actor consuming the batch, whose
    version recomputed old_log_probs (the proximal policy); else they carry the sampling version."""
    old = fields.get("old_log_probs")
    if old is None:
        yield v("no old_log_probs: the proximal anchor of the update is not recorded")
        return
    mode = f.one("extra.old_log_prob_mode")
    if mode not in OLD_PRODUCER:
        yield v(f"extra.old_log_prob_mode is {mode!r}; expected one value of {sorted(OLD_PRODUCER)}")
        return
    if mode != configured:
        yield v(f"old_log_prob_mode {mode} but algorithm.old_log_prob={configured}")
    if old.get("producer") != OLD_PRODUCER[mode]:
        yield v(f"old_log_probs produced by {old.get('producer')!r}; mode {mode} means {OLD_PRODUCER[mode]}")
    if actor_step is not None and mode == "recompute":
        if step_of(old.get("version")) != actor_step:
            yield v(f"old_log_probs has version {old.get('version')}, the actor consuming the batch "
                    f"is step {actor_step}")
    elif policy is not None and old.get("version") != policy:
        yield v(f"old_log_probs has version {old.get('version')}, samples were drawn by {policy}")
    if mode == "bypass" and "old_log_probs" in f.cols and f.cols["old_log_probs"] != f.cols.get("rollout_log_probs"):
        yield v("bypass mode but old_log_probs differ from rollout_log_probs")


def check_rewards(run: RunFolder) -> Iterator[Violation]:
    """An error is not a score: errored records carry no total and reach the loss only as the
    explicit penalty of reward_error=penalty; ok rows are scored by their total (minus the soft
    overlong penalty, within its bound); with reward.components, a total is their weighted sum."""
    algo = run.cfg.algorithm
    yield from _weighted_sums(run)
    for f in run.readable:
        c = f.cols
        missing = [k for k in ("reward_status", "reward_total", "scores") if k not in c]
        if missing:
            yield Violation("rewards", f"no {missing} columns", f.iteration)
            continue
        budget = {s: json.loads(s)["max_new_tokens"] for s in set(c["sampling"])}
        for i in range(f.num_rows):
            v = lambda msg: Violation("rewards", msg, f.iteration, sample_id=c["sample_id"][i])  # noqa: E731, B023
            status, total, score = c["reward_status"][i], c["reward_total"][i], c["scores"][i]
            if status != "ok":
                if total is not None:
                    yield v(f"reward status {status} carries a total {total}: an error is not a score")
                if algo.reward_error != "penalty":
                    yield v(f"errored reward ({status}) reached the loss with score {score}; "
                            f"algorithm.reward_error={algo.reward_error} never trains on it")
                    continue
                base = algo.reward_error_penalty
            elif total is None:
                yield v("reward status ok without a total")
                continue
            else:
                base = total
            if score is None or not math.isfinite(score):
                yield v(f"score {score} is not finite")
                continue
            what = "the penalty" if status != "ok" else "the reward total"
            if algo.overlong != "soft":
                if abs(score - base) > SCORE_TOL * max(1.0, abs(base)):
                    yield v(f"score {score} is not {what} {base}")
                continue
            cut = base - score     # the soft overlong penalty actually applied
            free = budget[c["sampling"][i]] - algo.overlong_buffer
            if not -SCORE_TOL <= cut <= algo.overlong_penalty + SCORE_TOL:
                yield v(f"score {score} is {what} {base} minus {cut}, outside the soft overlong bound "
                        f"[0, {algo.overlong_penalty}]")
            elif cut > SCORE_TOL and len(c["response_ids"][i]) <= free:
                yield v(f"score {score} is {what} {base} minus {cut}, but the response "
                        f"({len(c['response_ids'][i])} tokens) ends before the overlong buffer (token {free})")


def _weighted_sums(run: RunFolder) -> Iterator[Violation]:
    """With reward.components, every ok record outside reward.route holds each component's
    value, and its total is the weighted sum of them (sealrl.rewards.from_config)."""
    try:
        parts = components(run.cfg.reward, run.cfg.data.task)
    except ConfigError as e:   # the config check names an edited config; a bad one cannot weigh
        yield Violation("rewards", f"reward.components cannot be read: {e}")
        return
    routed = set(run.cfg.reward.route or {})
    for f in run.readable if parts else ():
        c = f.cols
        for i in range(f.num_rows):
            if c["reward_status"][i] != "ok" or c.get("data_source", [""] * f.num_rows)[i] in routed:
                continue
            v = lambda msg: Violation("rewards", msg, f.iteration, sample_id=c["sample_id"][i])  # noqa: E731, B023
            values = json.loads(c["reward_components"][i]) if "reward_components" in c else {}
            missing = [name for name, _, _ in parts if name not in values]
            if missing:
                yield v(f"reward record lacks the components {missing} of reward.components")
                continue
            total = sum(weight * values[name] for name, _, weight in parts)
            if abs(total - c["reward_total"][i]) > SCORE_TOL * max(1.0, abs(total)):
                yield v(f"reward total {c['reward_total'][i]} is not the weighted sum of its components {total}")


CHECKS: dict[str, Check] = {
    "config": check_config,
    "seal": check_seal,
    "used_once": check_used_once,
    "groups_complete": check_groups_complete,
    "policy_version": check_policy_version,
    "masks": check_masks,
    "provenance": check_provenance,
    "rewards": check_rewards,
    "ledger": check_ledger,
    "episodes": check_episodes,
    "derived": check_derived,
    "chain": check_chain,
    "scorers": check_scorers,
}
