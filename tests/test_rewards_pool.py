"""RewardPool under good and bad scorers: status, message, bounded time, no process left behind.

The scorers below live at module level so spawned workers can unpickle them; this module imports
only `sealrl.rewards` (lazy) and its base at the top, so a worker that imports it stays light.
Statuses are compared as strings (RewardStatus is a str enum) for the same reason.
"""
from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path

import pytest

import sealrl.rewards as rewards
from sealrl.rewards.base import RewardSample

# The deadline under test: a call on a ready worker takes milliseconds (~0.1 s for math-verify's
# first comparison), a "hang" sleeps 1000 s. Deadlines start at dispatch, never during a boot.
TIMEOUT_S = 5.0
# "Bounded time": far below any hang (1000 s), far above the deadline plus the start-up of
# replacement workers on a busy 2-core machine.
BOUND_S = 60.0


class Misbehave:
    """Does what the response says: "ok:<x>", "sleep:<s>:<x>", "raise", "hang", "nan", ..."""

    name = "misbehave"
    version = "7"

    def __call__(self, sample: RewardSample):
        kind, _, arg = sample.response.partition(":")
        if kind == "ok":
            return float(arg)
        if kind == "sleep":
            seconds, _, value = arg.partition(":")
            time.sleep(float(seconds))
            return float(value)
        if kind == "raise":
            raise RuntimeError("boom")
        if kind == "hang":
            time.sleep(1000)
        if kind == "exit":
            os._exit(3)  # the worker dies without answering
        return {"nan": math.nan, "inf": -math.inf, "none": None, "str": "1.0", "bool": True,
                "big": 10**400, "list": [1.0], "dict": {"total": 2.0, "a": 1.0, "b": -3},
                "dict_no_total": {"a": 1.0}, "dict_nan": {"total": 1.0, "a": math.nan},
                "dict_only_total": {"total": 0.25}}[kind]


class FailingSetup:
    name = "failing_setup"
    version = "1"

    def setup(self) -> None:
        raise OSError("model folder missing")

    def __call__(self, sample: RewardSample) -> float:
        return 1.0


def s(response: str, i: int = 0) -> RewardSample:
    return RewardSample(sample_id=f"run/0/p{i}/{i}", prompt="", response=response)


def child_pids() -> set[int]:
    """Live or zombie children of this process, from /proc (no psutil)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if int(fields[1]) == os.getpid():
            pids.add(int(stat.parent.name))
    return pids


@pytest.fixture(autouse=True)
def no_process_left_behind():
    before = child_pids()
    yield
    assert child_pids() - before == set()


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: no process, not even a zombie


# value-level validation, shared by inline and worker modes: (response, status, total, components)
CASES = [
    ("ok:0.5", "ok", 0.5, {"misbehave": 0.5}),
    ("ok:0", "ok", 0.0, {"misbehave": 0.0}),       # a real zero is a score
    ("bool", "ok", 1.0, {"misbehave": 1.0}),
    ("dict", "ok", 2.0, {"a": 1.0, "b": -3.0}),     # "total" is the score, the rest components
    ("dict_only_total", "ok", 0.25, {"misbehave": 0.25}),
    ("raise", "error", None, "raised RuntimeError: boom at test_rewards_pool.py"),
    ("nan", "error", None, "returned nan (float)"),
    ("inf", "error", None, "returned -inf (float)"),
    ("none", "error", None, "returned None (NoneType)"),
    ("str", "error", None, "returned '1.0' (str)"),
    ("big", "error", None, "(int); expected a finite number"),
    ("list", "error", None, "returned [1.0] (list)"),
    ("dict_no_total", "error", None, "without a 'total' key"),
    ("dict_nan", "error", None, "entry 'a': nan"),
]


def check_case(record, i, response, status, total, expected):
    assert record.status == status, (response, record)
    assert record.total == total and record.scorer == "misbehave" and record.scorer_version == "7"
    if status == "ok":
        assert record.components == expected and record.message == ""
    else:
        assert expected in record.message and "'misbehave'" in record.message
        assert f"'run/0/p{i}/{i}'" in record.message and record.components == {}
        with pytest.raises(ValueError):
            record.score()  # an error is never a number


def test_inline_mode_validates_like_workers():
    with rewards.RewardPool(Misbehave(), num_scorers=0) as pool:
        assert pool.worker_pids == []
        records = pool.score([s(c[0], i) for i, c in enumerate(CASES)])
    for i, (record, case) in enumerate(zip(records, CASES)):
        check_case(record, i, *case)


def test_bad_scorers_in_workers_bounded_time_and_recovery():
    pool = rewards.RewardPool(Misbehave(), num_scorers=2, timeout_s=TIMEOUT_S)
    first_pids = pool.worker_pids
    assert len(first_pids) == 2
    batch = [s(c[0], i) for i, c in enumerate(CASES)]
    batch += [s("hang", 90), s("exit", 91), s("ok:3", 92)]
    t0 = time.monotonic()
    records = pool.score(batch)
    wall = time.monotonic() - t0
    assert wall < BOUND_S, wall
    for i, (record, case) in enumerate(zip(records, CASES)):
        check_case(record, i, *case)
    hang, died, ok = records[len(CASES):]
    assert hang.status == "timeout" and hang.total is None
    assert "run/0/p90/90" in hang.message and f"{TIMEOUT_S:g} s deadline" in hang.message
    assert "killed" in hang.message and "'misbehave'" in hang.message
    assert died.status == "error" and "died (exit code 3)" in died.message
    assert ok.status == "ok" and ok.total == 3.0
    # both broken workers were replaced; the next batch scores normally
    records = pool.score([s(f"ok:{i}", i) for i in range(6)])
    assert [r.total for r in records] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    new_pids = pool.worker_pids
    assert len(new_pids) == 2 and set(new_pids) != set(first_pids)
    pool.close()
    assert_gone(first_pids + new_pids)
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([s("ok:1")])


def test_every_worker_hangs_then_queued_samples_still_score():
    with rewards.RewardPool(Misbehave(), num_scorers=2, timeout_s=TIMEOUT_S) as pool:
        pids = pool.worker_pids
        t0 = time.monotonic()
        records = pool.score([s("hang", 0), s("hang", 1), s("ok:1", 2), s("ok:2", 3)])
        wall = time.monotonic() - t0
        # deadlines start at dispatch: the queued samples wait for replacements, not time out
        assert [r.status for r in records] == ["timeout", "timeout", "ok", "ok"]
        assert [r.total for r in records[2:]] == [1.0, 2.0]
        assert wall < BOUND_S, wall
        pids += pool.worker_pids
    assert_gone(pids)


def test_results_join_by_id_in_input_order():
    # the first sample finishes last; records still come back in input order
    batch = [s("sleep:0.3:10", 0), s("ok:11", 1), s("sleep:0.1:12", 2), s("ok:13", 3)]
    with rewards.RewardPool(Misbehave(), num_scorers=2, timeout_s=TIMEOUT_S) as pool:
        assert [r.total for r in pool.score(batch)] == [10.0, 11.0, 12.0, 13.0]
        assert pool.score([]) == []
        with pytest.raises(ValueError, match="duplicate sample_id"):
            pool.score([s("ok:1", 0), s("ok:2", 0)])
        pids = pool.worker_pids
    assert_gone(pids)


def test_dropped_pool_leaves_no_process():
    pool = rewards.RewardPool(Misbehave(), num_scorers=1, timeout_s=TIMEOUT_S)
    pids = pool.worker_pids
    del pool
    gc.collect()
    assert_gone(pids)


def test_scorer_that_cannot_start_or_be_pickled():
    before = child_pids()   # other tests' children (e.g. Ray's) are not this pool's
    with pytest.raises(RuntimeError, match="model folder missing"):
        rewards.RewardPool(FailingSetup(), num_scorers=2)
    assert child_pids() - before == set()

    class Local(Misbehave):  # not importable by name in a worker
        pass

    with pytest.raises(TypeError, match="cannot be pickled"):
        rewards.RewardPool(Local(), num_scorers=1)
    with pytest.raises(TypeError, match="not a RewardFunction"):
        rewards.RewardPool(lambda sample: 1.0, num_scorers=0)


def test_math_verify_blow_up_times_out_in_a_worker():
    # sympy does not finish comparing 9^(9^9) with 42; the deadline does
    fn = rewards.MathVerifier()
    batch = [RewardSample(sample_id="m/0/p/0", prompt="", response="\\boxed{9^{9^{9}}}",
                          ground_truth="42"),
             RewardSample(sample_id="m/0/p/1", prompt="", response="\\boxed{\\frac{84}{2}}",
                          ground_truth="42"),
             RewardSample(sample_id="m/0/p/2", prompt="", response="\\boxed{1}",
                          ground_truth=None)]
    with rewards.RewardPool(fn, num_scorers=2, timeout_s=TIMEOUT_S) as pool:
        t0 = time.monotonic()
        slow, good, bad_truth = pool.score(batch)
        assert time.monotonic() - t0 < BOUND_S
        assert slow.status == "timeout" and slow.scorer == "math_verify"
        assert good.status == "ok" and good.total == 1.0
        assert bad_truth.status == "error" and "ground_truth" in bad_truth.message
        pids = pool.worker_pids
    assert_gone(pids)


def test_weighted_reward_in_workers():
    fn = rewards.WeightedReward({"correct": (rewards.ArithmeticExactMatch(), 1.0),
                                 "format": (rewards.FormatReward(r"\d+"), 0.1)})
    batch = [RewardSample(sample_id=f"w/0/p/{i}", prompt="", response=r, ground_truth=t)
             for i, (r, t) in enumerate([("42<eos>", "42"), ("41", "42"), ("42", None)])]
    with rewards.RewardPool(fn, num_scorers=1, timeout_s=60) as pool:   # generous: not what this tests
        right, wrong, broken = pool.score(batch)
    assert right.total == pytest.approx(1.1) and right.components == {"correct": 1.0, "format": 1.0}
    assert wrong.total == pytest.approx(0.1) and wrong.components == {"correct": 0.0, "format": 1.0}
    assert broken.status == "error" and broken.total is None and "'correct'" in broken.message
    assert right.scorer == "weighted" and right.scorer_version == fn.version


def test_reward_model_in_its_own_process(tmp_path):
    import torch
    from transformers import LlamaForSequenceClassification

    from sealrl.models.tiny import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                               intermediate_size=64)
    config.num_labels = 1
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    rm = rewards.RewardModelScorer(tmp_path, batch_size=2)
    batch = [RewardSample(sample_id=f"rm/0/p/{i}", prompt=f"{i}+{i}=", response=str(2 * i))
             for i in range(5)]
    expected = rm.score_batch(batch)  # loads the model here; the pickle sent to the worker does not
    with rewards.RewardPool(rm, num_scorers=1, timeout_s=120.0) as pool:
        records = pool.score(batch)  # one request: the whole batch, one score_batch call
        pids = pool.worker_pids
    assert [r.total for r in records] == pytest.approx(expected, abs=1e-6)
    assert all(r.scorer == "reward_model" and r.scorer_version == rm.version for r in records)
    assert_gone(pids)


class ShortBatch:
    """A batch scorer that loses a score, or raises, depending on the first response."""

    name = "short_batch"
    version = "1"

    def __call__(self, sample: RewardSample) -> float:
        return self.score_batch([sample])[0]

    def score_batch(self, samples):
        if samples[0].response == "raise":
            raise ValueError("cuda out of memory")
        return [1.0] * (len(samples) - 1)


def test_batch_scorer_faults_mark_every_sample():
    with rewards.RewardPool(ShortBatch(), num_scorers=0) as pool:
        lost = pool.score([s("a", 0), s("b", 1)])
        raised = pool.score([s("raise", 0), s("b", 1)])
    assert all(r.status == "error" and "returned 1 scores for 2 samples" in r.message for r in lost)
    assert all(r.status == "error" and "ValueError: cuda out of memory" in r.message for r in raised)
    assert [f"run/0/p{i}/{i}" in r.message for i, r in enumerate(raised)] == [True, True]
