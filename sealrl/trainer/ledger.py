"""Group ledger (DESIGN section 4): prompts become groups of n candidates; a group reaches the
loss only when complete. Failed candidates are regenerated with the same policy version and
the same per-request seed; after the retry limit the whole group is dropped and recorded, never
padded with other prompts' samples. Reward errors follow the configured policy. Rollout samples
and reward records are joined by key and attempt, never by position: duplicate, late and
unexpected deliveries are refused and counted. Every outcome is counted and written to
`ledger.jsonl`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from sealrl.experience import Join, RewardRecord, RewardStatus, StopReason, digest, group_id
from sealrl.rollout.engine import GenerationRequest, RolloutSample


def request_seed(run_seed: int, iteration: int, prompt_id: str) -> int:
    """Per-request seed derived from (run seed, iteration, prompt): never from global RNG, so a
    resumed or re-placed run samples the same responses."""
    return int(digest(run_seed, iteration, prompt_id, length=15), 16)


@dataclass(slots=True)
class GroupEntry:
    iteration: int
    group_id: str
    prompt_id: str
    status: str = "pending"          # committed | dropped
    reason: str = ""
    regenerated: int = 0             # candidates sampled again after a rollout failure
    reward_errors: int = 0           # errored reward records seen (before the policy)
    penalised: int = 0               # errored samples kept with the explicit penalty


@dataclass(slots=True)
class IterationLedger:
    iteration: int
    n: int
    max_retries: int
    groups: dict[str, GroupEntry] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)   # failed generate calls, with the error
    attempt: int = 0                                     # the generate call being joined (0 = first)
    rollout: Join = field(default_factory=lambda: Join("rollout"))   # keyed (group id, candidate)
    rewards: Join = field(default_factory=lambda: Join("reward"))    # keyed sample id
    reward_attempt: int = -1                             # the scoring call being joined

    # ---- rollout completion -------------------------------------------------------------
    def complete(self, samples: list[RolloutSample],
                 regenerate: Callable[[list[GenerationRequest]], list[RolloutSample]],
                 requests: dict[str, GenerationRequest]) -> dict[str, list[RolloutSample]]:
        """Join samples by (group, candidate); regenerate failed or missing candidates with the
        same request seed up to `max_retries`; drop groups that stay incomplete. `samples` are
        the first generate call's (attempt 0); the join closes on return."""
        self.rollout.ask([(g, c) for g in requests for c in range(self.n)], 0)
        self.deliver(samples, 0)
        for attempt in range(1, self.max_retries + 2):
            missing = {g: tuple(c for c in range(self.n) if (g, c) not in self.rollout.accepted) for g in requests}
            missing = {g: c for g, c in missing.items() if c}
            if not missing or attempt > self.max_retries:
                break
            self.attempt = attempt
            self.rollout.ask([(g, c) for g, cands in missing.items() for c in cands], attempt)
            retry = [GenerationRequest(g, requests[g].prompt_ids, requests[g].seed, cands)
                     for g, cands in missing.items()]
            self.deliver(regenerate(retry), attempt)
            for g, cands in missing.items():
                self.groups[g].regenerated += len(cands)
        self.rollout.close(range(self.attempt + 1))
        complete = {}
        for g in requests:
            cands = [self.rollout.accepted.get((g, c)) for c in range(self.n)]
            if None not in cands:
                complete[g] = cands
            else:
                last = f"; last failure: {self.failures[-1][:160]}" if self.failures else ""
                self.drop(g, f"rollout incomplete after {self.max_retries} retries "
                             f"({self.n - cands.count(None)}/{self.n} candidates){last}")
        return complete

    def deliver(self, samples: list[RolloutSample], attempt: int) -> None:
        """Samples of generate call `attempt`, whenever they arrive (see experience.join). Failed
        samples (stop reason error) are left missing, to be regenerated."""
        for s in samples:
            if s.stop_reason is not StopReason.ERROR:
                self.rollout.offer((s.group_id, s.candidate), attempt, s)

    # ---- rewards ------------------------------------------------------------------------
    def score(self, ids: list[str], call: Callable[[int], list[tuple[str, RewardRecord]]],
              scorer: str) -> dict[str, RewardRecord]:
        """One scoring attempt for `ids`: `call(attempt)` delivers (sample id, record) pairs,
        joined by sample id (see experience.join). A sample left without a record gets an error
        record naming the scorer and the counts: never a misaligned or missing score."""
        self.reward_attempt += 1
        attempt = self.reward_attempt
        self.rewards.ask(ids, attempt)
        pairs = call(attempt)
        self.deliver_rewards(pairs, attempt)
        self.rewards.close([attempt])
        lost = f"the reward role delivered {len(pairs)} records for {len(ids)} samples"
        return {i: self.rewards.accepted.get(i) or RewardRecord.failure(
                    RewardStatus.ERROR, scorer, f"scorer {scorer!r}: {lost}; none for sample {i!r}")
                for i in ids}

    def deliver_rewards(self, pairs: list[tuple[str, RewardRecord]], attempt: int) -> None:
        """Records of scoring call `attempt`, whenever they arrive (see experience.join)."""
        for sample_id, record in pairs:
            self.rewards.offer(sample_id, attempt, record)

    # ---- reward policy ------------------------------------------------------------------
    def apply_reward_policy(self, groups: dict[str, list[RolloutSample]], records: dict[str, RewardRecord],
                            policy: str, rescore: Callable[[list[str]], dict[str, RewardRecord]]
                            ) -> dict[str, list[RolloutSample]]:
        """retry: score errored samples again (up to max_retries), then drop the group;
        drop_group: drop any group with an errored sample; penalty: keep it (the driver gives
        it the configured penalty score; its record keeps the error status)."""
        for g, samples in groups.items():
            self.groups[g].reward_errors = sum(not records[s.sample_id].ok for s in samples)
        if policy == "retry":
            for _ in range(self.max_retries):
                bad = [s.sample_id for ss in groups.values() for s in ss if not records[s.sample_id].ok]
                if not bad:
                    break
                records.update(rescore(bad))
        kept = {}
        for g, samples in groups.items():
            errors = [records[s.sample_id] for s in samples if not records[s.sample_id].ok]
            if errors and policy != "penalty":
                first = errors[0]
                self.drop(g, f"reward {first.status.value} on {len(errors)} sample(s): {first.message[:120]}")
                continue
            self.groups[g].penalised = len(errors)
            kept[g] = samples
        return kept

    def drop(self, g: str, reason: str) -> None:
        self.groups[g].status, self.groups[g].reason = "dropped", reason

    def commit(self, kept: list[str]) -> None:
        for g in kept:
            self.groups[g].status = "committed"

    def counts(self) -> dict[str, float]:
        entries = list(self.groups.values())
        return {
            "groups/committed": sum(e.status == "committed" for e in entries),
            "groups/dropped": sum(e.status == "dropped" for e in entries),
            "groups/regenerated_samples": sum(e.regenerated for e in entries),
            "rollout/failed_calls": len(self.failures),
            "rollout/duplicate_deliveries": self.rollout.counts["duplicate"],
            "rollout/late_deliveries": self.rollout.counts["late"],
            "rollout/unexpected_deliveries": self.rollout.counts["unexpected"],
            "reward/duplicate_deliveries": self.rewards.counts["duplicate"],
            "reward/late_deliveries": self.rewards.counts["late"],
            "reward/unexpected_deliveries": self.rewards.counts["unexpected"],
            "reward/errors": sum(e.reward_errors for e in entries),
            "reward/penalised": sum(e.penalised for e in entries),
        }

    def rows(self) -> list[dict]:
        return [asdict(e) for e in self.groups.values()]


def new_iteration(iteration: int, n: int, max_retries: int, run_id: str, run_seed: int,
                  prompts: list[tuple[str, tuple[int, ...]]]) -> tuple[IterationLedger, dict[str, GenerationRequest]]:
    """A ledger for one iteration and its generation requests, keyed by group id."""
    ledger = IterationLedger(iteration, n, max_retries)
    requests = {}
    for prompt_id, ids in prompts:
        g = group_id(run_id, iteration, prompt_id)
        if g in requests:
            raise ValueError(f"prompt {prompt_id!r} appears twice in iteration {iteration}")
        ledger.groups[g] = GroupEntry(iteration, g, prompt_id)
        requests[g] = GenerationRequest(g, tuple(ids), request_seed(run_seed, iteration, prompt_id), tuple(range(n)))
    return ledger, requests
