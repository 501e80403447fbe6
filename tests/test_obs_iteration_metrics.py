"""The iteration metrics that need measurements: completion latencies (from the engine's
per-sample finish times), per-version sample outcomes and effective group sizes (from the
ledger), preparation tokens/s and queue times (from the state machine's stage timestamps), and
the one definition of stage shares. Values are checked against hand-built inputs."""
import math
import time

import pytest
import torch

from sealrl.config import build_config
from sealrl.experience import PolicyVersion, RewardRecord, Role, StopReason, sample_id
from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import RolloutSample
from sealrl.obs.timeline import StageTimer, stage_shares
from sealrl.trainer.collect import generate
from sealrl.trainer.iteration_metrics import (
    batch_metrics,
    preparation_metrics,
    rollout_metrics,
    share_metrics,
    stage_io_metrics,
    version_metrics,
)
from sealrl.trainer.ledger import new_iteration
from tests.helpers_experience import ScriptedRole, make_batch, stage_run
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
    backend = engine.versions.active.held
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
    Bounds come from the call starts seen inside the calls (each is at or after the offset the
    stage took), so however late either call starts on a busy machine, they hold."""
    ledger, reqs = new_iteration(0, 2, 1, "run", 0, [("p", (1, 4))])
    g = next(iter(reqs))
    entered = []   # seconds from the test's start to each call's entry

    def first_call(requests):   # candidate 1 fails, found only after 50 ms
        entered.append(time.perf_counter() - start)
        time.sleep(0.05)
        return [_sample(g, 0, 0.01), _sample(g, 1, 0.02, StopReason.ERROR)]

    def retry(requests):
        entered.append(time.perf_counter() - start)
        return [_sample(g, 1, 0.01)]

    rollout = ScriptedRole(first_call, retry)
    start = time.perf_counter()
    groups = generate(stage_run(rollout), ledger, reqs, V)
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
    groups = generate(stage_run(ScriptedRole(lambda requests: first, retry)), ledger, reqs, V)
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


def test_queue_time_is_measured_by_the_stage_timer():
    timer = StageTimer()
    timer.start_iteration(0)
    with timer.stage("reward", "reward"):
        time.sleep(0.01)
        reward_ending = time.perf_counter()
    time.sleep(0.04)  # the driver builds the batch: the reference waits
    with timer.stage("reference", "reference"):
        reference_started = time.perf_counter()
        time.sleep(0.02)
    m = preparation_metrics(timer.stage_spans, make_batch(), ("reference",))
    # the gap between the stages, whatever a busy machine adds to the sleeps
    assert 0.04 <= m["prep/reference_queue_s"] <= reference_started - reward_ending
    assert m["prep/reference_tokens_per_s"] == 20 / timer.stage_seconds["reference"]
    timer.start_iteration(1)
    assert timer.stage_spans == []


def test_reward_stage_and_replica_recovery_metrics_golden():
    """Responses of 2 + 1 + 3 tokens scored in a 0.5 s reward stage that started 0.25 s after
    generation ended: 12 tokens/s and 0.25 s of queue; two replacements of 1.5 s and 0.5 s."""
    groups = {"g": [_sample("g", 0, response=(5, 2)), _sample("g", 1, response=(2,)),
                    _sample("g", 2, response=(5, 6, 2))]}
    spans = [("generate", 10.0, 12.0), ("reward", 12.25, 12.75)]
    assert stage_io_metrics(spans, groups, [1.5, 0.5]) == {
        "rollout/replica_replacements": 2.0, "rollout/replica_recovery_s": 2.0,
        "reward/queue_s": 0.25, "reward/tokens_per_s": 12.0}
    assert stage_io_metrics([], groups, []) == {"rollout/replica_replacements": 0.0,
                                                "rollout/replica_recovery_s": 0.0}


def test_share_metrics_is_the_timeline_definition():
    row = {"time/generate_s": 1.0, "time/update_s": 2.0, "time/iteration_s": 4.0,
           "time/train_wall_s": 40.0, "prep/reference_queue_s": 3.0}
    assert share_metrics(row) == {"time/share_generate": 0.25, "time/share_update": 0.5,
                                  "time/share_other": 0.25}
    assert share_metrics(row) == {f"time/share_{k}": v for k, v in stage_shares(row).items()}


def test_response_length_and_stop_shares_golden():
    # lengths 1, 2, 3, 4; stop reasons eos, eos, length, stop; two groups of two
    groups = {"a": [_sample("a", 0, response=(2,)), _sample("a", 1, response=(5, 2))],
              "b": [_sample("b", 0, stop=StopReason.LENGTH, response=(5, 6, 7)),
                    _sample("b", 1, stop=StopReason.STOP, response=(5, 6, 7, 9))]}
    records = {s.sample_id: RewardRecord.success(1.0, "t") for ss in groups.values() for s in ss}
    m = rollout_metrics(groups, records, generate_s=2.5)
    assert m["rollout/num_samples"] == 4 and m["rollout/response_tokens"] == 10
    assert m["rollout/prompt_tokens"] == 4                   # one 2-token prompt per group
    assert m["rollout/tokens_per_s"] == 10 / 2.5
    assert m["rollout/response_len_mean"] == 2.5
    assert m["rollout/response_len_p50"] == 2.5              # between 2 and 3
    assert m["rollout/response_len_p90"] == pytest.approx(3.7)  # position 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert m["rollout/response_len_max"] == 4
    assert (m["rollout/stop_eos_frac"], m["rollout/stop_stop_frac"], m["rollout/stop_length_frac"],
            m["rollout/stop_error_frac"]) == (0.5, 0.25, 0.25, 0.0)


def _consumed_batch(old_producer: Role):
    """helpers' batch (responses 3 eos, 1 length, 0 length, 4 eos tokens; 2 groups) with
    old = rollout + 0.1 and reference = old - 0.2 on the valid tokens."""
    batch = make_batch()
    mask = batch.get("response_mask")
    old = (batch.get("rollout_log_probs") + 0.1).masked_fill(~mask, 0.0)
    batch.put("old_log_probs", old, old_producer, V.id)
    batch.put("ref_log_probs", (old - 0.2).masked_fill(~mask, 0.0), Role.REFERENCE, "ref")
    return batch


def test_batch_metrics_golden():
    from sealrl.roles.actor import loss_mask
    batch = _consumed_batch(Role.ACTOR)
    algo = build_config(None, ["algorithm.overlong=mask"]).algorithm
    m = batch_metrics(batch, loss_mask(batch, algo)[1], consumed_step=5, sampled_version_step=3)
    assert m["e2e/trained_tokens"] == 7.0                    # 3 + 4: the truncated response gets no loss
    assert m["e2e/accepted_groups"] == 2.0
    assert m["update/experience_age_steps"] == 2.0           # steps 4 and 5 used version 3's samples
    assert m["logprob/old_vs_rollout_k1"] == pytest.approx(-0.1, rel=1e-5)   # mean(rollout - old)
    # k3 of old vs reference: log r = ref - old = -0.2: e^-0.2 + 0.2 - 1
    assert m["kl/ref_kl"] == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-4)
    assert m["logprob/old_vs_ref_k1"] == pytest.approx(0.2, rel=1e-5)     # mean(old - ref)


def test_bypass_reports_no_old_vs_rollout_mismatch():
    batch = _consumed_batch(Role.ROLLOUT)   # bypass: old is the rollout's own
    m = batch_metrics(batch, batch.get("response_mask"), consumed_step=1, sampled_version_step=0)
    assert not [k for k in m if k.startswith("logprob/old_vs_rollout")]
    assert m["e2e/trained_tokens"] == 8.0 and "kl/ref_kl" in m


def test_advantage_and_kl_metrics_of_derive_golden():
    """dr_grpo, KL in the reward (k1, beta 0.1), old - ref = 0.2 per token. Lengths 3, 2 | 2, 2,
    scores 1, 0 | 1, 1: sequence scores 1 - 0.06, 0 - 0.04 | 0.96, 0.96; group b has zero
    variance; group a's mean 0.45: advantages 0.49 (3 tokens), -0.49 (2 tokens), 0 (4 tokens)."""
    from sealrl.experience.records import RewardRecord as Record
    from sealrl.trainer.derive import derive
    batch = make_batch(responses=((5, 6, 2), (7, 2), (8, 2), (9, 2)))
    mask = batch.get("response_mask")
    batch.put("reward_records", [Record.success(x, "arith") for x in (1.0, 0.0, 1.0, 1.0)], Role.REWARD, "arith@1")
    old = batch.get("rollout_log_probs")
    batch.put("old_log_probs", old, Role.ROLLOUT, V.id)
    batch.put("ref_log_probs", (old - 0.2).masked_fill(~mask, 0.0), Role.REFERENCE, "ref")
    algo = build_config(None, ["algorithm.name=dr_grpo", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
                               "algorithm.kl_estimator=k1"]).algorithm
    m = derive(batch, algo, 0.1, 4, "dr_grpo@0")
    adv = [0.49] * 3 + [-0.49] * 2 + [0.0] * 4
    mean = sum(adv) / 9
    assert m["adv/mean"] == pytest.approx(mean, rel=1e-5)
    assert m["adv/std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in adv) / 9), rel=1e-5)
    assert m["adv/zero_variance_frac"] == 0.5
    assert m["kl/reward_kl"] == pytest.approx(0.2, rel=1e-5)
    assert m["reward/score_mean"] == 0.75
    assert m["reward/score_std"] == pytest.approx(0.5)       # unbiased: sqrt((3 * 0.25^2 + 0.75^2) / 3)
    assert torch.allclose(batch.get("advantages")[0, :3], torch.tensor(0.49), rtol=1e-5)
