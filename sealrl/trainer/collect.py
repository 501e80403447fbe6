"""GENERATING(v) and scoring: the first two stages of an iteration, joined by the group ledger.

`generate` asks the rollout role for every candidate, then regenerates the failed or missing
ones (same version, same per-request seeds) until the ledger has them all or its retry limit
is reached; `score` asks the reward role for a record per sample and, under the `retry`
reward-error policy, scores errored samples again. A failed call is counted and retried, never
turned into samples or scores; a call that missed its deadline and delivers afterwards
(LateResults) is refused by key and attempt once its retry is decided, and counted."""
from __future__ import annotations

import dataclasses
import time

from sealrl.experience import LateResults, RewardRecord, RewardStatus
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.trainer.ledger import IterationLedger


def generate(run, ledger: IterationLedger, requests: dict[str, GenerationRequest], version, early=None
             ) -> dict[str, list[RolloutSample]]:
    """Complete groups of the iteration, by group id. Completion times (`finish_s`) count from
    the stage's start, so a regenerated candidate completes as late as it really did. `early`:
    reward.stream's EarlyScores (trainer/variants/streaming.py), handed every sample as it finishes."""
    start, late, pending = time.perf_counter(), [], list(requests.values())
    stream = {} if early is None else {"stream": early.add}
    ledger.expect_samples(requests)
    while pending:
        attempt, offset = ledger.attempt, time.perf_counter() - start
        try:
            samples = run.roles.rollout.generate(pending, run.contract, version, **stream)
        except LateResults as e:   # counted as failed and retried; its samples arrive after the retry's
            ledger.failures.append(f"rollout: attempt {attempt}: {e}")
            late.append((attempt, e.results))
            samples = []
        except Exception as e:  # noqa: BLE001 - recorded, counted and retried
            ledger.failures.append(f"rollout: {type(e).__name__}: {e}")
            samples = []
        ledger.deliver([dataclasses.replace(s, finish_s=offset + s.finish_s) for s in samples], attempt)
        pending = ledger.retry_requests(requests)
    groups = ledger.complete_groups(requests)
    for attempt, samples in late:   # refused by key and attempt, counted
        ledger.deliver(samples, attempt)
    return groups


def reward_item(sample: RolloutSample, prompt, text: str) -> tuple:
    """What the reward role scores for one sample: (sample, prompt text, response text, ground
    truth, data source, extra info); `prompt` is the group's data.dataset.Prompt."""
    return sample, prompt.text, text, prompt.ground_truth, prompt.data_source, prompt.extra_info


def decode_and_score(run, ledger: IterationLedger, groups: dict[str, list[RolloutSample]], prompt_of,
                     early=None) -> tuple[dict[str, str], dict[str, RewardRecord], dict[str, list[RolloutSample]]]:
    """The reward stage: every response decoded once (for the reward and the record), then
    scored (`early`: what reward.stream scored meanwhile). Returns (text per sample id, record
    per sample id, the groups kept)."""
    tok = run.roles.tokenizer
    texts = {s.sample_id: tok.decode(list(s.response_ids), skip_special_tokens=True)
             for ss in groups.values() for s in ss}
    items = {s.sample_id: reward_item(s, prompt_of(g), texts[s.sample_id]) for g, ss in groups.items() for s in ss}
    records, kept = score(run, ledger, groups, items, early)
    return texts, records, kept


def score(run, ledger: IterationLedger, groups: dict[str, list[RolloutSample]], items: dict[str, tuple],
          early=None) -> tuple[dict[str, RewardRecord], dict[str, list[RolloutSample]]]:
    """(record per sample id, the groups the reward-error policy keeps). `items`: sample id ->
    reward_item(...); `early`: the first attempt's records streamed during generation."""
    policy, late = run.cfg.algorithm.reward_error, []
    records = _score_once(run, ledger, list(items), items, late, early)
    ledger.count_reward_errors(groups, records)
    if policy == "retry":
        for _ in range(ledger.max_retries):
            bad = [i for i in items if not records[i].ok]
            if not bad:
                break
            records.update(_score_once(run, ledger, bad, items, late))
    kept = ledger.apply_reward_policy(groups, records, policy)
    for attempt, pairs in late:   # after the retry: refused by attempt, counted
        ledger.deliver_rewards(pairs, attempt)
    return records, kept


def _score_once(run, ledger: IterationLedger, ids: list[str], items: dict[str, tuple], late: list, early=None
                ) -> dict[str, RewardRecord]:
    """One scoring attempt, joined by sample id. If the reward role itself fails, every sample
    it was asked for gets an error record naming it (a timeout record if it missed its deadline):
    never a score. With `early` (reward.stream), only what it did not score is asked for."""
    attempt = ledger.expect_records(ids)
    scorer = run.roles.reward.scorer
    if early is None:
        pairs = _ask(run, [items[i] for i in ids], ids, attempt, late)
    else:   # joined by sample id like any delivery: the order of the pairs changes nothing
        pairs, todo = early.take(ids, items)
        pairs += _ask(run, [items[i] for i in todo], todo, attempt, late) if todo else []
    ledger.deliver_rewards(pairs, attempt)
    return ledger.records(ids, attempt, scorer, delivered=len(pairs))


def _ask(run, batch: list[tuple], ids: list[str], attempt: int, late: list) -> list[tuple[str, RewardRecord]]:
    """The reward role's (sample id, record) pairs for `batch`, or an error record per id."""
    try:
        return run.roles.reward.score(batch)
    except LateResults as e:
        late.append((attempt, e.results))
        msg = f"reward role: no records within the deadline (attempt {attempt}: {e})"
        return [(i, RewardRecord.failure(RewardStatus.TIMEOUT, "reward-role", msg)) for i in ids]
    except Exception as e:  # noqa: BLE001 - becomes error records, counted by the ledger
        msg = f"reward role failed: {type(e).__name__}: {e}"
        return [(i, RewardRecord.failure(RewardStatus.ERROR, "reward-role", msg)) for i in ids]
