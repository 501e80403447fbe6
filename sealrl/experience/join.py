"""Split work by id, and join what comes back by key and attempt (DESIGN sections 2 and 3).

Pure Python: the rules are unit-tested on their own, and the same join serves every place that
collects results from another process or a retried call (the group ledger's rollout samples and
reward records, the replica pool's shards).

Split: `split_ids` sorts the ids and cuts them into `n` contiguous ranges (sizes differ by at
most one, the first ranges take the extra ids). It depends only on the set of ids, never on
their position in a tensor or on completion order, so every process computes the same split.

Join: a key is accepted once, and only from the attempt that last asked for it. What is refused
is counted, never merged:

    duplicate   a second copy from the asking attempt
    late        a copy from a superseded attempt, or one arriving after that attempt was
                closed (same seed, maybe the same bytes: still refused)
    unexpected  a key, or an attempt, that was never asked for (keys carry what must match:
                e.g. (sample id, policy version), so a sample of another version is unexpected)
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
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


class MissingResultsError(RuntimeError):
    """Some asked-for keys have no accepted result; `missing` lists them."""

    def __init__(self, what: str, missing: list) -> None:
        shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
        super().__init__(f"{what}: no result for {len(missing)} key(s): {shown}")
        self.what, self.missing = what, list(missing)

    def __reduce__(self):
        return type(self), (self.what, self.missing)


class Join:
    """One accepted value per asked key (see the module docstring for what is refused)."""

    def __init__(self, what: str) -> None:
        self.what = what                          # names the join in errors and metrics
        self.asked: dict[Hashable, int] = {}      # key -> attempt that asked for it last
        self.accepted: dict[Hashable, Any] = {}   # key -> accepted value
        self.closed: set[int] = set()             # attempts whose results were already decided on
        self.counts = {"accepted": 0, "duplicate": 0, "late": 0, "unexpected": 0}

    def ask(self, keys: Iterable[Hashable], attempt: int) -> None:
        """A new attempt for `keys`: what an older attempt delivered for them is discarded."""
        for k in keys:
            self.asked[k] = attempt
            self.accepted.pop(k, None)

    def offer(self, key: Hashable, attempt: int, value: Any) -> bool:
        """Accept `value` if it answers the attempt that last asked for `key`; else count why not."""
        asked = self.asked.get(key)
        if asked is None or attempt > asked:
            verdict = "unexpected"
        elif attempt < asked:
            verdict = "late"
        elif key in self.accepted:
            verdict = "duplicate"
        elif attempt in self.closed:
            verdict = "late"
        else:
            verdict = "accepted"
            self.accepted[key] = value
        self.counts[verdict] += 1
        return verdict == "accepted"

    def close(self, attempts: Iterable[int]) -> None:
        """These attempts are decided on: anything they deliver from now on is late."""
        self.closed.update(attempts)

    def missing(self) -> list:
        return sorted(k for k in self.asked if k not in self.accepted)

    def results(self) -> dict:
        """key -> accepted value, in sorted key order; raises MissingResultsError if incomplete."""
        missing = self.missing()
        if missing:
            raise MissingResultsError(self.what, missing)
        return {k: self.accepted[k] for k in sorted(self.accepted)}


class LateResults(RuntimeError):
    """A call missed its deadline, and what it produced (`results`) arrives only afterwards:
    the caller counts the call as failed, retries, and offers `results` to the join under the
    missed attempt once the retry is decided, where they are refused as late and counted."""

    def __init__(self, message: str, results: list) -> None:
        super().__init__(message)
        self.results = results
