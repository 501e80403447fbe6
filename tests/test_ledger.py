"""Group completion and reward-error policies (DESIGN section 4), on hand-made samples, through
the driver's own attempt loops (trainer/collect.py) with scripted roles."""
import dataclasses

from sealrl.experience import PolicyVersion, RewardRecord, RewardStatus, StopReason, sample_id
from sealrl.experience.wire import RolloutSample
from sealrl.trainer.collect import generate, score
from sealrl.trainer.ledger import new_iteration, request_seed
from tests.helpers_experience import ScriptedRole, stage_run

V = PolicyVersion("run", 0)


def _sample(g, c, stop=StopReason.EOS):
    return RolloutSample(sample_id=sample_id(g, c), group_id=g, candidate=c, prompt_ids=(1,),
                         response_ids=(5, 2), rollout_log_probs=(-0.1, -0.2), filtered_log_probs=None,
                         stop_reason=stop, policy_version=V, seed=c)


def test_request_seeds_are_derived_not_random():
    assert request_seed(0, 3, "p1") == request_seed(0, 3, "p1")
    assert len({request_seed(0, 3, "p1"), request_seed(0, 4, "p1"), request_seed(1, 3, "p1"),
                request_seed(0, 3, "p2")}) == 4


def test_failed_candidates_are_regenerated_with_the_same_seed():
    ledger, reqs = new_iteration(0, 3, 2, "run", 0, [("a", (1,)), ("b", (1,))])
    ga, gb = list(reqs)
    first = [_sample(ga, 0), _sample(ga, 1, StopReason.ERROR), _sample(ga, 2),
             _sample(gb, 0), _sample(gb, 0), _sample(gb, 1), _sample(gb, 2)]   # b0 delivered twice
    rollout = ScriptedRole(lambda requests: first,
                           lambda requests: [_sample(r.group_id, c) for r in requests for c in r.candidates])
    groups = generate(stage_run(rollout), ledger, reqs, V)
    assert [(r.group_id, r.candidates, r.seed) for r in rollout.asked[1]] == [(ga, (1,), reqs[ga].seed)]
    assert [s.candidate for s in groups[ga]] == [0, 1, 2] and len(groups[gb]) == 3
    assert ledger.counts()["groups/regenerated_samples"] == 1


def test_group_dropped_after_retry_limit_never_padded():
    ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("a", (1,)), ("b", (1,))])
    ga, gb = list(reqs)
    always_fail = lambda requests: [_sample(r.group_id, c, StopReason.ERROR) for r in requests for c in r.candidates]  # noqa: E731
    rollout = ScriptedRole(lambda requests: [_sample(ga, 0), _sample(gb, 0), _sample(gb, 1)], always_fail)
    groups = generate(stage_run(rollout), ledger, reqs, V)
    assert list(groups) == [gb]
    assert ledger.groups[ga].status == "dropped" and "1/2 candidates" in ledger.groups[ga].reason


def _records(groups, bad):
    return {s.sample_id: (RewardRecord.failure(RewardStatus.TIMEOUT, "v", "deadline") if s.sample_id in bad
                          else RewardRecord.success(1.0, "v")) for ss in groups.values() for s in ss}


def test_reward_error_policies():
    for policy, kept_groups, penalised in (("drop_group", 1, 0), ("penalty", 2, 1)):
        ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("a", (1,)), ("b", (1,))])
        ga, gb = list(reqs)
        groups = {ga: [_sample(ga, 0), _sample(ga, 1)], gb: [_sample(gb, 0), _sample(gb, 1)]}
        records = _records(groups, {sample_id(ga, 1)})
        ledger.count_reward_errors(groups, records)
        kept = ledger.apply_reward_policy(groups, records, policy)
        ledger.commit(list(kept))
        counts = ledger.counts()
        assert len(kept) == kept_groups and counts["reward/penalised"] == penalised
        assert counts["reward/errors"] == 1
        # the errored record keeps its status: it is never turned into a score
        assert not records[sample_id(ga, 1)].ok
    assert ledger.groups[ga].status == "committed"


def test_reward_retry_rescored_then_dropped():
    ledger, reqs = new_iteration(0, 2, 2, "run", 0, [("a", (1,)), ("b", (1,))])
    ga, gb = list(reqs)
    groups = {ga: [_sample(ga, 0), _sample(ga, 1)], gb: [_sample(gb, 0), _sample(gb, 1)]}
    first = _records(groups, {sample_id(ga, 1), sample_id(gb, 0)})
    timeout = RewardRecord.failure(RewardStatus.TIMEOUT, "v", "deadline")
    # a recovers on the first retry, b keeps failing
    retry = lambda ids: [(i, RewardRecord.success(0.0, "v") if i.startswith(ga) else timeout) for i in ids]  # noqa: E731
    reward = ScriptedRole(lambda ids: list(first.items()), retry, retry)
    items = {s.sample_id: (s, "", "", "", "") for ss in groups.values() for s in ss}
    records, kept = score(stage_run(reward=reward, reward_error="retry"), ledger, groups, items)
    assert list(kept) == [ga] and records[sample_id(ga, 1)].ok and not records[sample_id(gb, 0)].ok
    assert reward.asked[1:] == [[sample_id(ga, 1), sample_id(gb, 0)], [sample_id(gb, 0)]]
    assert ledger.counts()["reward/errors"] == 2   # as first scored
    assert ledger.groups[gb].status == "dropped" and "timeout" in ledger.groups[gb].reason


def test_deliveries_accept_each_key_once_from_the_attempt_that_asked():
    ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("a", (1,)), ("b", (1,))])
    ga, gb = list(reqs)
    first = [_sample(ga, 0), _sample(ga, 1), _sample(gb, 0)]          # b1 lost by attempt 0
    late = [_sample(gb, 1)]                                           # ... and arrives after the retry
    regenerated = dataclasses.replace(_sample(gb, 1), response_ids=(6, 2))   # told apart from the late copy
    rollout = ScriptedRole(lambda r: first + [_sample(ga, 0)] + [_sample("run/0/zz", 0)], lambda r: [regenerated])
    groups = generate(stage_run(rollout), ledger, reqs, V)
    ledger.deliver(late, 0)        # superseded attempt: refused, though the same seed gave the same sample
    ledger.deliver([_sample(ga, 1)], 1)   # attempt 1 never asked for a1
    counts = ledger.counts()
    assert sorted(groups) == [ga, gb] and groups[gb][1].response_ids == (6, 2)
    assert (counts["rollout/duplicate_deliveries"], counts["rollout/late_deliveries"],
            counts["rollout/unexpected_deliveries"]) == (1, 1, 2)


def test_reward_records_joined_by_sample_id_missing_ones_are_errors():
    ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("a", (1,))])
    ids = [sample_id(list(reqs)[0], c) for c in range(2)]
    ok = RewardRecord.success(1.0, "v")
    attempt = ledger.expect_records(ids)
    pairs = [(ids[0], ok), (ids[0], ok), ("run/0/x/0", ok)]
    ledger.deliver_rewards(pairs, attempt)
    records = ledger.records(ids, attempt, "v", delivered=len(pairs))
    assert records[ids[0]] is ok and not records[ids[1]].ok
    assert records[ids[1]].message == (f"scorer 'v': the reward role delivered 3 records for 2 samples; "
                                       f"none for sample {ids[1]!r}")
    retry = ledger.expect_records([ids[1]])                                # the retry policy's call
    ledger.deliver_rewards([(ids[1], ok)], retry)
    again = ledger.records([ids[1]], retry, "v", delivered=1)
    ledger.deliver_rewards([(ids[1], RewardRecord.success(0.0, "v"))], 0)  # attempt 0's, late
    counts = ledger.counts()
    assert again[ids[1]] is ok
    assert (counts["reward/duplicate_deliveries"], counts["reward/late_deliveries"],
            counts["reward/unexpected_deliveries"]) == (1, 1, 1)
