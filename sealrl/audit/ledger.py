"""The ledger check: every prompt the (replayed) sampler passed to an iteration was trained
(committed, in that iteration's experience file), filtered by dynamic sampling, or dropped with
a reason, never two of these; over-sampling rounds replay against the sampler; a ReMax group's
greedy baseline in the ledger is the one sealed in the experience."""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterator

from sealrl.audit.folder import IterationFile, RunFolder
from sealrl.audit.report import Violation
from sealrl.experience.ids import group_id

SCORE_TOL = 1e-5      # scores are float32, reward totals float64


def check_ledger(run: RunFolder) -> Iterator[Violation]:
    """Every sampled prompt (ledger row) was trained (committed, in that iteration's file),
    dropped with a reason, or filtered for zero variance (dynamic sampling); every trained group
    has one committed row, and with dynamic sampling its scores vary; none is two of these."""
    for msg in run.ledger_errors:
        yield Violation("ledger", msg)
    trained: dict[tuple[int, str], IterationFile] = {(f.iteration, g): f for f in run.readable for g in f.groups}
    rows: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in run.ledger:
        rows[(r["iteration"], r["group_id"])].append(r)
    if run.ledger_errors and not run.ledger:
        return
    yield from _ledger_vs_sampler(run, rows, max([it for it, _ in [*rows, *trained]], default=-1))
    for (it, g), entries in rows.items():
        v = lambda msg: Violation("ledger", msg, it, g)  # noqa: E731, B023
        statuses = [e["status"] for e in entries]
        if len(entries) > 1:
            yield v(f"recorded {len(entries)} times ({', '.join(statuses)})")
        for e in entries:
            if e["status"] not in ("committed", "dropped", "filtered"):
                yield v(f"status {e['status']!r} is neither committed, dropped nor filtered")
            if e["status"] == "filtered" and not run.cfg.algorithm.dynamic_sampling:
                yield v("filtered, but algorithm.dynamic_sampling is off: nothing filters groups")
            if g != group_id(run.run_id, it, e["prompt_id"]):
                yield v(f"ledger group id is not run/iteration/prompt for prompt {e['prompt_id']}")
        if "dropped" in statuses:
            if "committed" in statuses:
                yield v("both committed and dropped")
            if any(e["status"] == "dropped" and not str(e.get("reason", "")).strip() for e in entries):
                yield v("dropped without a reason")
            if (it, g) in trained:
                yield v("recorded as dropped but its samples were trained")
        if "filtered" in statuses:
            reasons = [str(e.get("reason", "")) for e in entries if e["status"] == "filtered"]
            if not all(r.startswith("zero variance") for r in reasons):
                yield v("filtered without its reason (zero variance)")
            if (it, g) in trained:
                yield v("recorded as filtered (zero variance) but its samples were trained")
        if "committed" in statuses and (it, g) not in trained:
            yield v("committed in the ledger but absent from the iteration's experience file")
    for (it, g), f in trained.items():
        entries = [e for e in rows.get((it, g), []) if e["status"] == "committed"]
        if not entries:
            yield Violation("ledger", "trained group has no committed ledger row", it, g)
            continue
        prompt = f.cols["prompt_id"][f.groups[g][0]]
        errored = sum(f.cols["reward_status"][i] != "ok" for i in f.groups[g]) if "reward_status" in f.cols else 0
        scores = [f.cols["scores"][i] for i in f.groups[g]] if "scores" in f.cols else []
        if run.cfg.algorithm.dynamic_sampling and len(scores) > 1 and len(set(scores)) == 1:
            yield Violation("ledger", f"trained group's scores are all {scores[0]}: dynamic sampling filters "
                            "zero-variance groups", it, g)
        yield from _remax_baseline(f, g, entries[0], it)
        for e in entries:
            if e["prompt_id"] != prompt:
                yield Violation("ledger", f"ledger prompt {e['prompt_id']} but trained prompt {prompt}", it, g)
            if e.get("penalised", 0) != errored:
                yield Violation("ledger", f"ledger counts {e.get('penalised', 0)} penalised samples, the file "
                                f"holds {errored} errored rewards", it, g)


def _remax_baseline(f: IterationFile, g: str, entry: dict, it: int) -> Iterator[Violation]:
    """ReMax: a trained group's samples carry one baseline, its ledger row's greedy score."""
    if "baseline_scores" not in f.cols:
        return
    values = {f.cols["baseline_scores"][i] for i in f.groups[g]}
    recorded = (entry.get("baseline") or {}).get("score")
    if recorded is None:
        yield Violation("ledger", "trained ReMax group has no greedy baseline in its ledger row", it, g)
    elif len(values) != 1 or abs(next(iter(values)) - recorded) > SCORE_TOL * max(1.0, abs(recorded)):
        yield Violation("ledger", f"baseline_scores of the group {sorted(values)} are not its ledger row's "
                        f"greedy score {recorded}", it, g)


def _ledger_vs_sampler(run: RunFolder, rows: dict[tuple[int, str], list[dict]], last: int) -> Iterator[Violation]:
    """Replay the prompt sampler (its batches depend only on the number of training prompts,
    data.prompts_per_iter and run.seed): each iteration's ledger holds one row per prompt it
    passed, and no prompt comes twice in one epoch. This is what catches a dropped group whose
    ledger row was lost: nothing else names it."""
    num_prompts = run.run_meta.get("num_train_prompts")
    if not num_prompts:
        yield Violation("ledger", "run.json records no num_train_prompts: the sampler's batches cannot be replayed")
        return
    by_iter: dict[int, list[tuple[str, str]]] = defaultdict(list)      # iteration -> [(group, prompt)]
    rows_of: dict[int, list[dict]] = defaultdict(list)                   # iteration -> its ledger rows
    for (it, g), entries in rows.items():
        by_iter[it].append((g, entries[0]["prompt_id"]))
        rows_of[it] += entries
    seen: dict[str, tuple[int, int]] = {}        # prompt_id -> (epoch, iteration) of its last use
    sampler = replay_sampler(run.cfg, num_prompts)
    for it in range(last + 1):
        epoch = yield from _sampling_rounds(run, it, rows_of[it], sampler)
        for g, prompt in by_iter[it]:
            if prompt in seen and seen[prompt][0] == epoch:
                yield Violation("ledger", f"prompt {prompt} sampled again in epoch {epoch} "
                                f"(already in iteration {seen[prompt][1]})", it, g)
            seen[prompt] = (epoch, it)


def _sampling_rounds(run: RunFolder, it: int, entries: list[dict], sampler) -> Iterator[Violation]:
    """Replay iteration `it`'s generation rounds (round r is the sampler's next batch after round
    r - 1; one round unless dynamic sampling): each round's ledger rows match its batch, the
    rounds stay in one epoch, and over-sampling stopped only when it had to (data.prompts_per_iter
    groups with signal, algorithm.max_sampling_rounds, or the epoch's end), so a trailing round
    removed from the ledger is found. Returns the epoch of the iteration."""
    algo, target = run.cfg.algorithm, run.cfg.data.prompts_per_iter
    per_round = Counter(e.get("round", 0) for e in entries)
    rounds = 1 + max(per_round, default=0)
    if rounds > (algo.max_sampling_rounds if algo.dynamic_sampling else 1):
        yield Violation("ledger", f"{rounds} generation rounds recorded; algorithm.dynamic_sampling="
                        f"{algo.dynamic_sampling}, max_sampling_rounds={algo.max_sampling_rounds}", it)
    epochs = set()
    for r in range(rounds):
        size = len(sampler.next_batch())
        epochs.add(sampler.epoch)            # of this batch (next_batch opens a new epoch first)
        if per_round[r] != size:
            yield Violation("ledger", f"{per_round[r]} groups recorded in round {r}; the sampler passed "
                            f"{size} prompts", it)
    if len(epochs) > 1:
        yield Violation("ledger", f"the iteration's {rounds} sampling rounds span epochs {sorted(epochs)}", it)
    signal = sum(e["status"] == "committed" or str(e.get("reason", "")).startswith("remax:") for e in entries)
    if (algo.dynamic_sampling and signal < target and rounds < algo.max_sampling_rounds
            and sampler.cursor < sampler.num_prompts):
        yield Violation("ledger", f"over-sampling stopped after {rounds} round(s) with {signal} of {target} "
                        "groups with signal, before max_sampling_rounds or the epoch's end: a round is "
                        "missing from the ledger", it)
    return max(epochs)


def replay_sampler(cfg, num_prompts: int):
    """The prompt sampler of a run, as sealrl.trainer.setup.build_sampler builds it."""
    from sealrl.data.sampler import PromptSampler
    return PromptSampler(num_prompts, cfg.data.prompts_per_iter, seed=cfg.run.seed, shuffle=True)
