"""The iteration metrics that need measurements: completion latencies (from the engine's
per-sample finish times), per-version sample outcomes and effective group sizes (from the
ledger), preparation tokens/s and queue times (from the state machine's stage timestamps), and
the one definition of stage shares. Values are checked against hand-built inputs."""
import time

import pytest

from sealrl.experience import PolicyVersion, RewardRecord, StopReason, sample_id
from sealrl.experience.records import SamplingContract
from sealrl.obs.timeline import stage_shares
from sealrl.rollout.engine import RolloutSample
from sealrl.trainer.iteration_metrics import (from_stage_start, preparation_metrics, rollout_metrics,
                                              share_metrics, version_metrics)
from sealrl.trainer.ledger import new_iteration
from sealrl.trainer.state import StateMachine
from tests.helpers_experience import make_batch
from tests.test_rollout_engine import make_engine, mixed_requests

V = PolicyVersion("run", 3)


def _sample(g, c, finish_s=0.0, stop=StopReason.EOS, response=(5, 2)):
    return RolloutSample(sample_id=sample_id(g, c), group_id=g, candidate=c, prompt_ids=(1, 4),
                         response_ids=response, rollout_log_probs=(-0.1,) * len(response),
                         filtered_log_probs=None, stop_reason=stop, policy_version=V, seed=c,
                         finish_s=finish_s)


def test_completion_latencies_golden():
    # group a completes at max(0.5, 1.25) = 1.25, group b at max(0.25, 2.0) = 2.0
    groups = {"a": [_sample("a", 0, 0.5), _sample("a", 1, 1.25)],
              "b": [_sample("b", 0, 0.25), _sample("b", 1, 2.0)]}
    records = {s.sample_id: RewardRecord.success(1.0, "t") for ss in groups.values() for s in ss}
    m = rollout_metrics(groups, records, generate_s=2.5)
    assert m["rollout/first_completion_s"] == 0.25
    assert m["rollout/last_completion_s"] == 2.0
    assert m["rollout/group_completion_s_mean"] == (1.25 + 2.0) / 2
    assert m["rollout/group_completion_s_min"] == 1.25


def test_finish_time_is_a_measurement_not_part_of_the_sample():
    a, b = _sample("g", 0, 0.5), _sample("g", 0, 9.0)
    assert a == b and hash(a) == hash(b)


def test_engine_finish_times_follow_the_decode_steps(tiny_engine):
    """Each decode step takes >= 30 ms: a row that stopped after k tokens finished after k - 1
    decode steps; rows stopping at the same step share one finish time exactly."""
    engine, version, tokenizer = tiny_engine
    backend = engine._active.backend
    decode = backend.decode

    def slow_decode(*args):
        time.sleep(0.03)
        return decode(*args)

    backend.decode = slow_decode
    try:
        contract = SamplingContract(max_new_tokens=6, stop_token_ids=tuple(range(4, 26)))
        t0 = time.perf_counter()
        samples = engine.generate(mixed_requests(tokenizer), contract, version)
        wall = time.perf_counter() - t0
    finally:
        backend.decode = decode
    lengths = [len(s.response_ids) for s in samples]
    assert len(set(lengths)) > 1
    by_length = {}
    for s in samples:
        assert (len(s.response_ids) - 1) * 0.03 <= s.finish_s <= wall
        by_length.setdefault(len(s.response_ids), set()).add(s.finish_s)
    assert all(len(times) == 1 for times in by_length.values())
    times = [by_length[k].pop() for k in sorted(by_length)]
    assert times == sorted(times) and len(set(times)) == len(times)


@pytest.fixture(scope="module")
def tiny_engine():
    from sealrl.models.tiny import build_tiny_model
    model, tokenizer = build_tiny_model(seed=0)
    engine, version = make_engine(model, tokenizer)
    return engine, version, tokenizer


def test_retried_candidates_complete_on_the_stage_clock():
    """The second generate call starts >= 50 ms after the first: its sample's finish time is
    shifted by that call's start, the first call's samples only by the first call's start.
    Bounds come from the call starts seen inside `generate` (each is at or after the offset
    from_stage_start took), so however late either call starts on a busy machine, they hold."""
    ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("p", (1, 4))])
    g = next(iter(reqs))
    calls, entered = [], []

    def generate(requests):
        entered.append(time.perf_counter() - start)
        calls.append(requests)
        if len(calls) == 1:  # candidate 1 fails, found only after 50 ms
            time.sleep(0.05)
            return [_sample(g, 0, 0.01), _sample(g, 1, 0.02, StopReason.ERROR)]
        return [_sample(g, 1, 0.01)]

    start = time.perf_counter()
    timed = from_stage_start(generate, start)
    groups = ledger.complete(timed(list(reqs.values())), timed, reqs)
    elapsed = time.perf_counter() - start
    first, retried = groups[g]
    eps = 1e-9
    assert 0.01 <= first.finish_s <= 0.01 + entered[0] + eps              # its own call's start only
    assert first.finish_s + 0.05 - eps <= retried.finish_s <= 0.01 + entered[1] + eps  # the retry's start
    assert retried.finish_s <= elapsed + 0.01


def test_version_metrics_from_the_ledger():
    """n = 2, three prompts: a complete at once, b complete after one regenerated candidate,
    c never complete (dropped after the retry)."""
    ledger, reqs = new_iteration(5, 2, 1, "run", 0, [("a", (1,)), ("b", (1,)), ("c", (1,))])
    ga, gb, gc = reqs
    first = [_sample(ga, 0), _sample(ga, 1), _sample(gb, 0), _sample(gb, 1, stop=StopReason.ERROR),
             _sample(gc, 0, stop=StopReason.ERROR)]
    retry = lambda requests: [_sample(r.group_id, c) for r in requests for c in r.candidates  # noqa: E731
                              if r.group_id == gb]
    groups = ledger.complete(first, retry, reqs)
    ledger.commit(list(groups))
    trained = [s.group_id for ss in groups.values() for s in ss]
    m = version_metrics(ledger.rows(), 2, trained, version_step=7)
    assert m == {"rollout/policy_version_step": 7.0, "rollout/samples_ok": 4.0,
                 "rollout/samples_retried": 3.0,   # b1 once, c0 and c1 once each
                 "rollout/samples_dropped": 2.0,   # all of c
                 "groups/effective_size_mean": 4 / 3, "groups/effective_size_min": 0.0}
    assert m["rollout/samples_retried"] == ledger.counts()["groups/regenerated_samples"]


def test_preparation_metrics_golden():
    batch = make_batch()  # prompts 4 x 3 tokens, responses 3 + 1 + 0 + 4: 20 tokens
    spans = [("generate", 10.0, 12.0), ("reward", 12.0, 13.0), ("reference", 13.5, 14.5),
             ("critic_values", 14.5, 15.0), ("old_log_prob", 15.25, 16.25), ("advantage", 16.25, 16.5)]
    m = preparation_metrics(spans, batch, ("reference", "critic_values", "old_log_prob"))
    assert m == {"prep/reference_queue_s": 0.5, "prep/reference_tokens_per_s": 20.0,
                 "prep/critic_values_queue_s": 0.0, "prep/critic_values_tokens_per_s": 40.0,
                 "prep/old_log_prob_queue_s": 0.25, "prep/old_log_prob_tokens_per_s": 20.0}
    # bypass mode: the old log-prob stage runs no forward, so it gets no rate and no queue
    assert set(preparation_metrics(spans, batch, ("reference",))) == {"prep/reference_queue_s",
                                                                       "prep/reference_tokens_per_s"}


def test_queue_time_is_measured_by_the_state_machine():
    sm = StateMachine()
    sm.start_iteration(0)
    with sm.stage("reward", "reward"):
        time.sleep(0.01)
        reward_ending = time.perf_counter()
    time.sleep(0.04)  # the driver builds the batch: the reference waits
    with sm.stage("reference", "reference"):
        reference_started = time.perf_counter()
        time.sleep(0.02)
    m = preparation_metrics(sm.stage_spans, make_batch(), ("reference",))
    # the gap between the stages, whatever a busy machine adds to the sleeps
    assert 0.04 <= m["prep/reference_queue_s"] <= reference_started - reward_ending
    assert m["prep/reference_tokens_per_s"] == 20 / sm.stage_seconds["reference"]
    sm.start_iteration(1)
    assert sm.stage_spans == []


def test_share_metrics_is_the_timeline_definition():
    row = {"time/generate_s": 1.0, "time/update_s": 2.0, "time/iteration_s": 4.0,
           "time/train_wall_s": 40.0, "prep/reference_queue_s": 3.0}
    assert share_metrics(row) == {"time/share_generate": 0.25, "time/share_update": 0.5,
                                  "time/share_other": 0.25}
    assert share_metrics(row) == {f"time/share_{k}": v for k, v in stage_shares(row).items()}
