"""RewardPool joins a reply to the request it sent, by request id, sample ids and the answering
process; a scorer that forks cannot move rewards between samples or leave zombies.

The scorers live at module level so the spawned workers can unpickle them (see
test_rewards_pool.py for the same pattern).
"""
from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import sealrl.rewards as rewards
from sealrl.rewards.base import RewardSample
from sealrl.seams import host


def _value(sample: RewardSample) -> float:
    return float(sample.response)


class ForkingScorer:
    """Forks on every call; the child answers the wrong value (1 - right) and returns, as a
    careless user function would (both copies continue after fork())."""

    name = "forking"
    version = "1"

    def __call__(self, sample: RewardSample):
        if os.fork() == 0:
            time.sleep(0.001 * (hash(sample.sample_id) % 5))   # vary which copy is first
            return 1.0 - _value(sample)
        return _value(sample)


class ForgingScorer:
    """Writes a reply for another request onto the worker's own pipe before answering: what a
    second process holding the pipe would do. The pool must refuse it, and the sample it was
    for must not get that value."""

    name = "forging"
    version = "1"

    def __call__(self, sample: RewardSample):
        if sample.sample_id == "s3":
            fd = host.CHANNEL_FDS[0]   # the worker's pipe (seams/host.py)
            conn = Connection(fd, readable=False)
            conn.send(("ok", 10**6, os.getpid(), (["s4"], [(42.0, {"forging": 42.0})])))
            conn._handle = None   # not ours to close
        return _value(sample)


def _samples(n: int) -> list[RewardSample]:
    return [RewardSample(sample_id=f"s{i}", prompt="p", response=str(i % 2), response_ids=(1,),
                         ground_truth=None) for i in range(n)]


def _zombies_of(pids: list[int]) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0")) in pids and fields.get("State", "").startswith("Z"):
            found.append(int(status.parent.name))
    return found


def test_forking_scorer_scores_every_sample_with_its_own_reward():
    samples = _samples(120)
    with rewards.RewardPool(ForkingScorer(), num_scorers=2, timeout_s=30) as pool:
        records = pool.score(samples)
        again = pool.score(samples)   # the workers still answer only their own requests
        pids = pool.worker_pids
        scored, stray = pool.take_scored()
        time.sleep(0.5)   # the last children exit while their workers wait for requests
        zombies = _zombies_of(pids)
    for s, r, r2 in zip(samples, records, again):
        assert r.ok and r.total == _value(s), (s.sample_id, r)
        assert r2.ok and r2.total == _value(s), (s.sample_id, r2)
    assert stray == 0   # the forked copies exit before they can answer
    assert set(scored) == {s.sample_id for s in samples} and set(scored.values()) <= set(pids)
    assert zombies == [], f"scorer processes left zombie children {zombies}"   # 240 were forked


def test_reply_for_a_request_not_held_is_refused_counted_and_never_joined():
    samples = _samples(8)
    with rewards.RewardPool(ForgingScorer(), num_scorers=1, timeout_s=30) as pool:
        records = pool.score(samples)
        scored, stray = pool.take_scored()
    assert stray == 1
    by_id = {s.sample_id: r for s, r in zip(samples, records)}
    # the worker that received the forged frame was replaced and its request failed: an error,
    # not a score; every other sample has its own reward, none has the forged 42.0
    assert by_id["s3"].status == "error" and "stray reply" in by_id["s3"].message
    for s in samples:
        if s.sample_id != "s3":
            assert by_id[s.sample_id].ok and by_id[s.sample_id].total == _value(s), s.sample_id
    assert "s3" not in scored and len(scored) == len(samples) - 1


class Allocates:
    """Allocates the response's number of MiB (bytearray: touches every page) and prints."""

    name = "allocates"
    version = "1"

    def __call__(self, sample: RewardSample):
        print(f"scorer output for {sample.sample_id}")   # goes to stderr, never the driver's stdout
        return float(len(bytearray(int(sample.response) << 20)) > 0)


def test_scorer_memory_limit_makes_a_large_allocation_an_error_and_output_goes_to_stderr(capfd):
    samples = [RewardSample(sample_id=f"a{i}", prompt="p", response=r, response_ids=(1,), ground_truth=None)
               for i, r in enumerate(("1", "4096", "1"))]
    with rewards.RewardPool(Allocates(), num_scorers=1, timeout_s=60, memory_mb=512) as pool:
        small, big, after = pool.score(samples)
    assert small.ok and after.ok   # the worker survives its scorer's MemoryError
    assert big.status == "error" and "MemoryError" in big.message
    out, err = capfd.readouterr()
    assert "scorer output for a0" in err and "scorer output" not in out
