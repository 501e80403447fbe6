"""Group ledger (DESIGN section 4): prompts become groups of n candidates; a group reaches the
loss only when complete. Failed candidates are regenerated with the same policy version and
the same per-request seed; after the retry limit the whole group is dropped and recorded, never
padded with other prompts' samples. Reward errors follow the configured policy. Rollout samples
and reward records are joined by key and attempt, never by position: duplicate, late and
unexpected deliveries are refused and counted. Every outcome is counted and written to
`ledger.jsonl`."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from sealrl.experience import Join, RewardRecord, RewardStatus, StopReason, digest, group_id
from sealrl.experience.wire import GenerationRequest, RolloutSample, env_input


def request_seed(run_seed: int, iteration: int, prompt_id: str) -> int:
    """Per-request seed derived from (run seed, iteration, prompt): never from global RNG, so a
    resumed or re-placed run samples the same responses."""
    return int(digest(run_seed, iteration, prompt_id, length=15), 16)


@dataclass(slots=True)
class GroupEntry:
    iteration: int
    group_id: str
    prompt_id: str
    status: str = "pending"          # committed | dropped | filtered (dynamic sampling: zero variance)
    reason: str = ""
    round: int = 0                   # generation round of the iteration (dynamic sampling over-samples)
    baseline: dict | None = None     # ReMax: the greedy response's score, text, tokens and scorer
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
    attempt: int = 0                                     # the latest generate call (0 = first)
    rollout: Join = field(default_factory=lambda: Join("rollout"))   # keyed (group id, candidate)
    rewards: Join = field(default_factory=lambda: Join("reward"))    # keyed sample id
    reward_attempt: int = -1                             # the latest scoring call
    dynamic: bool = False                                # dynamic sampling: filtered groups, rounds

    # ---- rollout completion: the driver loops over attempts (collect.generate) -------------
    def expect_samples(self, requests: dict[str, GenerationRequest]) -> None:
        """Attempt 0 asks for every candidate of every group."""
        self.rollout.ask([(g, c) for g in requests for c in range(self.n)], 0)

    def deliver(self, samples: list[RolloutSample], attempt: int) -> None:
        """Samples of generate call `attempt`, whenever they arrive (see experience.join).
        Failed samples (stop reason error) are left missing, to be regenerated."""
        for s in samples:
            if s.stop_reason is not StopReason.ERROR:
                self.rollout.offer((s.group_id, s.candidate), attempt, s)

    def retry_requests(self, requests: dict[str, GenerationRequest]) -> list[GenerationRequest]:
        """The next attempt's requests: the failed or missing candidates of each group, with the
        same request seed; none when every candidate arrived or after `max_retries` retries."""
        missing = {g: tuple(c for c in range(self.n) if (g, c) not in self.rollout.accepted) for g in requests}
        missing = {g: c for g, c in missing.items() if c}
        if not missing or self.attempt >= self.max_retries:
            return []
        self.attempt += 1
        self.rollout.ask([(g, c) for g, cands in missing.items() for c in cands], self.attempt)
        for g, cands in missing.items():
            self.groups[g].regenerated += len(cands)
        return [dataclasses.replace(requests[g], candidates=cands) for g, cands in missing.items()]

    def complete_groups(self, requests: dict[str, GenerationRequest]) -> dict[str, list[RolloutSample]]:
        """Close the join: the groups with every candidate; the others are dropped, recorded."""
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

    # ---- rewards: the driver loops over scoring attempts (collect.score) -----------------
    def expect_records(self, ids: list[str]) -> int:
        """A new scoring attempt for `ids`; returns its number."""
        self.reward_attempt += 1
        self.rewards.ask(ids, self.reward_attempt)
        return self.reward_attempt

    def deliver_rewards(self, pairs: list[tuple[str, RewardRecord]], attempt: int) -> None:
        """(sample id, record) pairs of scoring call `attempt`, whenever they arrive."""
        for sample_id, record in pairs:
            self.rewards.offer(sample_id, attempt, record)

    def records(self, ids: list[str], attempt: int, scorer: str, delivered: int) -> dict[str, RewardRecord]:
        """Close scoring attempt `attempt`: its accepted record per id. A sample left without a
        record gets an error record naming the scorer and the counts: never a misaligned or
        missing score."""
        self.rewards.close([attempt])
        lost = f"the reward role delivered {delivered} records for {len(ids)} samples"
        return {i: self.rewards.accepted.get(i) or RewardRecord.failure(
                    RewardStatus.ERROR, scorer, f"scorer {scorer!r}: {lost}; none for sample {i!r}")
                for i in ids}

    def count_reward_errors(self, groups: dict[str, list[RolloutSample]], records: dict[str, RewardRecord]) -> None:
        """Errored records of each group as first scored (before any retry)."""
        for g, samples in groups.items():
            self.groups[g].reward_errors = sum(not records[s.sample_id].ok for s in samples)

    def apply_reward_policy(self, groups: dict[str, list[RolloutSample]], records: dict[str, RewardRecord],
                            policy: str) -> dict[str, list[RolloutSample]]:
        """After any retries (policy retry): drop_group and retry drop a group with an errored
        sample; penalty keeps it (the driver gives it the configured penalty score; its record
        keeps the error status)."""
        kept = {}
        for g, samples in groups.items():
            errors = [records[s.sample_id] for s in samples if not records[s.sample_id].ok]
            if errors and policy != "penalty":
                first = errors[0]
                self.drop(g, f"reward {first.status.value} on {len(errors)} sample(s): {first.message}")
                continue
            self.groups[g].penalised = len(errors)
            kept[g] = samples
        return kept

    def drop(self, g: str, reason: str) -> None:
        self.groups[g].status, self.groups[g].reason = "dropped", reason

    def filter(self, g: str, reason: str) -> None:
        self.groups[g].status, self.groups[g].reason = "filtered", reason

    def absorb(self, other: IterationLedger, round_: int) -> None:
        """Take in the groups, failures and join counts of another generation round's ledger."""
        for g, entry in other.groups.items():
            entry.round = round_
            self.groups[g] = entry
        self.failures += other.failures
        for mine, theirs in ((self.rollout, other.rollout), (self.rewards, other.rewards)):
            for k, v in theirs.counts.items():
                mine.counts[k] += v

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
            **({"groups/filtered": sum(e.status == "filtered" for e in entries),
                "groups/sampling_rounds": 1 + max((e.round for e in entries), default=0)} if self.dynamic else {}),
        }

    def rows(self) -> list[dict]:
        return [asdict(e) for e in self.groups.values()]


def new_iteration(iteration: int, n: int, max_retries: int, run_id: str, run_seed: int,
                  prompts: list) -> tuple[IterationLedger, dict[str, GenerationRequest]]:
    """A ledger for one iteration and its generation requests, keyed by group id. `prompts`:
    dataset prompts (data.dataset.Prompt), whose requests carry the row an environment starts
    an episode from (env_input), or bare (prompt id, token ids) pairs."""
    ledger = IterationLedger(iteration, n, max_retries)
    requests = {}
    for p in prompts:
        prompt_id, ids, row = (*p, "") if isinstance(p, tuple) else (p.prompt_id, p.token_ids, env_input(p))
        g = group_id(run_id, iteration, prompt_id)
        if g in requests:
            raise ValueError(f"prompt {prompt_id!r} appears twice in iteration {iteration}")
        ledger.groups[g] = GroupEntry(iteration, g, prompt_id)
        requests[g] = GenerationRequest(g, tuple(ids), request_seed(run_seed, iteration, prompt_id), tuple(range(n)),
                                        row)
    return ledger, requests
