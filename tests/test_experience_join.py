"""Split by sample id and the one join by key and attempt: duplicates, late results of older or
closed attempts, other versions and unknown keys are refused and counted; missing keys are
reported by name."""
from __future__ import annotations

import pickle

import pytest

from sealrl.experience import Join, MissingResultsError, split_ids

IDS = [f"run/3/p{k}/{c}" for k in range(3) for c in range(2)]
V = "run@5.0"


def make_join() -> Join:
    j = Join("rollout")
    j.ask([(sid, V) for sid in IDS], 0)
    return j


def test_split_is_contiguous_sorted_ranges_independent_of_order():
    shards = split_ids(reversed(IDS), 4)
    assert shards == [sorted(IDS)[0:2], sorted(IDS)[2:4], sorted(IDS)[4:5], sorted(IDS)[5:6]]
    assert split_ids(IDS, 4) == shards
    assert split_ids(IDS[:1], 3) == [IDS[:1], [], []]
    with pytest.raises(ValueError, match="duplicate"):
        split_ids(IDS + IDS[:1], 2)
    with pytest.raises(ValueError, match="n must be"):
        split_ids(IDS, 0)


def test_each_key_is_accepted_once_and_duplicates_are_counted():
    j = make_join()
    for sid in reversed(IDS):  # completion order does not matter
        assert j.offer((sid, V), 0, sid.upper())
    assert not j.offer((IDS[0], V), 0, "again")
    assert j.counts == {"accepted": 6, "duplicate": 1, "late": 0, "unexpected": 0}
    assert j.results() == {(sid, V): sid.upper() for sid in sorted(IDS)}


def test_a_late_result_of_an_older_attempt_is_refused_after_a_retry():
    j = make_join()
    assert j.offer((IDS[1], V), 0, "first")
    j.ask([(IDS[1], V)], 1)                        # a retry discards what attempt 0 gave
    assert (IDS[1], V) not in j.accepted
    assert not j.offer((IDS[1], V), 0, "late")     # answer to the abandoned attempt
    assert not j.offer((IDS[1], V), 2, "future")   # an attempt never issued
    assert j.offer((IDS[1], V), 1, "retried")
    assert not j.offer((IDS[1], V), 0, "later still")
    assert j.counts == {"accepted": 2, "duplicate": 0, "late": 2, "unexpected": 1}


def test_an_attempt_closed_before_its_delivery_is_late():
    j = make_join()
    j.close([0])
    assert not j.offer((IDS[0], V), 0, "after the join closed")
    assert j.counts["late"] == 1 and (IDS[0], V) not in j.accepted


def test_another_version_or_a_key_never_asked_for_is_unexpected():
    j = make_join()
    assert not j.offer((IDS[0], "run@4.0"), 0, "old version")
    assert not j.offer(("run/3/p9/0", V), 0, "never asked")
    assert j.counts == {"accepted": 0, "duplicate": 0, "late": 0, "unexpected": 2}


def test_missing_keys_are_named_and_the_error_survives_pickling():
    j = make_join()
    for sid in IDS[2:]:
        j.offer((sid, V), 0, 1)
    assert j.missing() == [(sid, V) for sid in sorted(IDS[:2])]
    with pytest.raises(MissingResultsError, match="rollout: no result for 2") as e:
        j.results()
    assert e.value.missing == [(sid, V) for sid in sorted(IDS[:2])]
    again = pickle.loads(pickle.dumps(e.value))   # crosses Ray's process boundary
    assert again.missing == e.value.missing and str(again) == str(e.value)
