"""Split by sample id and idempotent join: duplicates, late results of older attempts, other
versions and unknown ids are rejected and counted; missing ids are reported by name."""
from __future__ import annotations

import pytest

from sealrl.placement.join import MissingResultsError, ResultJoin, ResultKey, split_ids

IDS = [f"run/3/p{k}/{c}" for k in range(3) for c in range(2)]


def make_join() -> ResultJoin:
    return ResultJoin("run", 3, "rollout", "run@5.0", IDS)


def test_split_is_contiguous_sorted_ranges_independent_of_order():
    shards = split_ids(reversed(IDS), 4)
    assert shards == [sorted(IDS)[0:2], sorted(IDS)[2:4], sorted(IDS)[4:5], sorted(IDS)[5:6]]
    assert split_ids(IDS, 4) == shards
    assert split_ids(IDS[:1], 3) == [IDS[:1], [], []]
    with pytest.raises(ValueError, match="duplicate"):
        split_ids(IDS + IDS[:1], 2)
    with pytest.raises(ValueError, match="n must be"):
        split_ids(IDS, 0)


def test_each_id_is_accepted_once_and_duplicates_are_counted():
    j = make_join()
    for sid in reversed(IDS):  # completion order does not matter
        assert j.offer(j.key(sid), 0, sid.upper())
    assert not j.offer(j.key(IDS[0]), 0, "again")
    assert j.counts == {"accepted": 6, "duplicate": 1, "stale": 0, "foreign": 0}
    assert j.results() == {sid: sid.upper() for sid in sorted(IDS)}


def test_a_late_result_of_an_older_attempt_is_rejected_after_a_retry():
    j = make_join()
    assert j.retry([IDS[1]]) == {IDS[1]: 1}
    assert not j.offer(j.key(IDS[1]), 0, "late")      # answer to the abandoned attempt
    assert not j.offer(j.key(IDS[1]), 2, "future")    # an attempt never issued
    assert j.offer(j.key(IDS[1]), 1, "retried")
    assert not j.offer(j.key(IDS[1]), 0, "later still")
    assert j.counts == {"accepted": 1, "duplicate": 1, "stale": 1, "foreign": 1}
    with pytest.raises(ValueError, match="already has a result"):
        j.retry([IDS[1]])


def test_other_versions_iterations_runs_roles_and_ids_are_rejected():
    j = make_join()
    sid = IDS[0]
    assert not j.offer(ResultKey("run", 3, sid, "rollout", "run@4.0"), 0, "old version")
    assert not j.offer(ResultKey("run", 2, sid, "rollout", "run@5.0"), 0, "old iteration")
    assert not j.offer(ResultKey("other", 3, sid, "rollout", "run@5.0"), 0, "other run")
    assert not j.offer(ResultKey("run", 3, sid, "reward", "run@5.0"), 0, "other role")
    assert not j.offer(ResultKey("run", 3, "run/3/p9/0", "rollout", "run@5.0"), 0, "never asked")
    assert j.counts == {"accepted": 0, "duplicate": 0, "stale": 2, "foreign": 3}
    assert j.metrics()["placement/rollout_stale"] == 2.0


def test_missing_ids_are_named():
    j = make_join()
    for sid in IDS[2:]:
        j.offer(j.key(sid), 0, 1)
    assert not j.complete and j.missing() == sorted(IDS[:2])
    with pytest.raises(MissingResultsError, match="role rollout: no result for 2") as e:
        j.results()
    assert e.value.missing == sorted(IDS[:2])
    with pytest.raises(ValueError, match="expected twice"):
        ResultJoin("run", 3, "rollout", "v", IDS + IDS[:1])
