"""Split work by sample id and join results by id, idempotently (DESIGN sections 2 and 3).

Pure Python, no torch, no Ray: the rules are unit-tested on their own.

Split: `split_ids` sorts the ids and cuts them into `n` contiguous ranges (sizes differ by at
most one, the first ranges take the extra ids). It depends only on the set of ids, never on
their position in a tensor or on completion order, so every process computes the same split.

Join: a `ResultJoin` expects one result per sample id for one (run, iteration, role, role
version). A result is accepted only if its key matches and it answers the id's current attempt.
Everything else is rejected and counted, never merged:

    duplicate   the id already has an accepted result (a redelivery)
    stale       an older attempt of the id (a late answer to a request that was retried),
                or an older role version / iteration of the same run
    foreign     an id that was never asked for, or another run / role
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


def split_ids(ids: Iterable[str], n: int) -> list[list[str]]:
    """Sorted ids cut into `n` contiguous ranges; shard k goes to worker k (some may be empty)."""
    if n < 1:
        raise ValueError(f"split_ids: n must be >= 1, got {n!r}")
    ordered = sorted(ids)
    if len(set(ordered)) != len(ordered):
        raise ValueError("split_ids: duplicate ids")
    base, extra = divmod(len(ordered), n)
    out, start = [], 0
    for k in range(n):
        size = base + (k < extra)
        out.append(ordered[start:start + size])
        start += size
    return out


@dataclass(frozen=True, slots=True)
class ResultKey:
    """What a result answers: one sample, of one iteration of one run, from one role version."""

    run_id: str
    iteration: int
    sample_id: str
    role: str
    role_version: str


class MissingResultsError(RuntimeError):
    """Some expected ids have no accepted result; `missing` lists them."""

    def __init__(self, role: str, missing: Sequence[str]) -> None:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        super().__init__(f"role {role}: no result for {len(missing)} sample id(s): {shown}")
        self.role, self.missing = role, list(missing)

    def __reduce__(self):
        return type(self), (self.role, self.missing)


class ResultJoin:
    """Collects one result per expected sample id of (run, iteration, role, role version)."""

    def __init__(self, run_id: str, iteration: int, role: str, role_version: str,
                 sample_ids: Iterable[str]) -> None:
        self.run_id, self.iteration, self.role, self.role_version = run_id, iteration, role, role_version
        self._attempt: dict[str, int] = {}
        for sid in sample_ids:
            if sid in self._attempt:
                raise ValueError(f"ResultJoin: sample id {sid!r} expected twice")
            self._attempt[sid] = 0
        self._results: dict[str, Any] = {}
        self.counts = {"accepted": 0, "duplicate": 0, "stale": 0, "foreign": 0}

    def key(self, sample_id: str) -> ResultKey:
        return ResultKey(self.run_id, self.iteration, sample_id, self.role, self.role_version)

    def attempt(self, sample_id: str) -> int:
        return self._attempt[sample_id]

    def retry(self, sample_ids: Iterable[str]) -> dict[str, int]:
        """Start a new attempt for ids without a result; answers to older attempts become stale.
        Returns id -> new attempt number (to send with the re-dispatched request)."""
        out = {}
        for sid in sample_ids:
            if sid not in self._attempt:
                raise KeyError(f"ResultJoin.retry: {sid!r} is not an expected id")
            if sid in self._results:
                raise ValueError(f"ResultJoin.retry: {sid!r} already has a result")
            self._attempt[sid] += 1
            out[sid] = self._attempt[sid]
        return out

    def offer(self, key: ResultKey, attempt: int, value: Any) -> bool:
        """Accept `value` for `key` if it answers the current attempt; else count why not."""
        verdict = self._classify(key, attempt)
        self.counts[verdict] += 1
        if verdict == "accepted":
            self._results[key.sample_id] = value
        return verdict == "accepted"

    def _classify(self, key: ResultKey, attempt: int) -> str:
        if key.run_id != self.run_id or key.role != self.role or key.sample_id not in self._attempt:
            return "foreign"
        if key.iteration != self.iteration or key.role_version != self.role_version:
            return "stale"
        if key.sample_id in self._results:
            return "duplicate"
        if attempt != self._attempt[key.sample_id]:
            return "stale" if attempt < self._attempt[key.sample_id] else "foreign"
        return "accepted"

    def missing(self) -> list[str]:
        return sorted(s for s in self._attempt if s not in self._results)

    @property
    def complete(self) -> bool:
        return len(self._results) == len(self._attempt)

    def results(self) -> dict[str, Any]:
        """id -> accepted result, in sorted id order; raises MissingResultsError if incomplete."""
        missing = self.missing()
        if missing:
            raise MissingResultsError(self.role, missing)
        return {sid: self._results[sid] for sid in sorted(self._results)}

    def metrics(self) -> dict[str, float]:
        return {f"placement/{self.role}_{k}": float(v) for k, v in self.counts.items()}
