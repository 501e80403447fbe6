"""reward.stream (trainer/variants/streaming.py, RewardPool.stream): samples are scored as the rollout
finishes them, and the iteration's records, sealed experience, metrics and weights are those of
the unstreamed run, whatever order samples finished and were scored in; reward errors stay
error records."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sealrl.config import ConfigError, build_config, check_config
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.store import read_iteration
from sealrl.experience.wire import GenerationRequest
from sealrl.models.tiny import build_tiny_model
from sealrl.rewards.base import RewardSample
from sealrl.rewards.pool import RewardPool
from sealrl.trainer.driver import train
from sealrl.trainer.iteration_metrics import is_wall_clock
from sealrl.trainer.variants.streaming import EarlyScores
from tests.harness import small_args
from tests.test_rewards_pool import Misbehave
from tests.test_rollout_engine import encode, make_engine


def _sample(i: int, response: str) -> RewardSample:
    return RewardSample(sample_id=f"r/0/p/{i}", prompt="q", response=response)


RESPONSES = ["ok:1.5", "raise", "sleep:0.2:-2", "ok:0.25", "nan", "sleep:0.1:3"]


def _as_tuples(records) -> list[tuple]:
    return [(r.status.value, r.total, r.message) for r in records]


def test_stream_gives_the_records_of_score_in_any_order():
    """The same samples added in two orders, in pieces, give score()'s records, each under its
    sample id, in the order added; an error stays an error record with score()'s message."""
    samples = [_sample(i, r) for i, r in enumerate(RESPONSES)]
    with RewardPool(Misbehave(), num_scorers=2, timeout_s=5.0) as pool:
        reference = pool.score(samples)
        for order in (list(range(6)), [5, 2, 0, 4, 1, 3]):
            stream = pool.stream()
            for start in range(0, 6, 2):   # three pieces, as three decode steps would hand them in
                stream.add([samples[i] for i in order[start:start + 2]])
                stream.add([])             # a step where nothing finished: a poll
            records = stream.finish()
            assert list(records) == [samples[i].sample_id for i in order]
            assert _as_tuples(records[s.sample_id] for s in samples) == _as_tuples(reference)
    # by hand: ok:1.5 -> 1.5, sleep:0.2:-2 -> -2, ok:0.25 -> 0.25, sleep:0.1:3 -> 3; raise and nan: errors
    assert [r.total for r in reference if r.ok] == [1.5, -2.0, 0.25, 3.0]
    assert [r.status.value for r in reference] == ["ok", "error", "ok", "ok", "error", "ok"]
    assert "boom" in reference[1].message


def test_stream_scores_while_the_caller_goes_on():
    """Samples handed in are scored while the caller does something else (here: sleeps, as a
    decode would compute): by the time finish() is called their records are already there."""
    with RewardPool(Misbehave(), num_scorers=2, timeout_s=5.0) as pool:
        stream = pool.stream()
        stream.add([_sample(0, "sleep:0.3:1"), _sample(1, "sleep:0.3:2")])
        time.sleep(1.0)   # the caller's work: both scorers run meanwhile (0.3 s each, in parallel)
        stream.add([])
        assert sorted(stream._results) == ["r/0/p/0", "r/0/p/1"]
        t0 = time.perf_counter()
        assert [r.total for r in stream.finish().values()] == [1.0, 2.0]
        assert time.perf_counter() - t0 < 0.1   # nothing left to wait for


def test_the_pool_is_exclusive_while_a_stream_is_open():
    with RewardPool(Misbehave(), num_scorers=1, timeout_s=5.0) as pool:
        stream = pool.stream()
        stream.add([_sample(0, "ok:1")])
        with pytest.raises(RuntimeError, match="ScoreStream is open"):
            pool.score([_sample(1, "ok:2")])
        with pytest.raises(ValueError, match="duplicate sample_id"):
            stream.add([_sample(0, "ok:1")])
        assert stream.finish()["r/0/p/0"].total == 1.0
        assert pool.score([_sample(1, "ok:2")])[0].total == 2.0   # free again


def test_inline_pool_stream_scores_at_finish():
    """num_scorers=0: nothing streams (it would run between decode steps); finish() scores."""
    pool = RewardPool(Misbehave(), num_scorers=0)
    stream = pool.stream()
    stream.add([_sample(0, "ok:4"), _sample(1, "raise")])
    assert stream._results == {}
    records = stream.finish()
    assert [r.status.value for r in records.values()] == ["ok", "error"] and records["r/0/p/0"].total == 4.0


def test_the_engine_hands_each_sample_on_at_the_step_it_finished():
    """RolloutEngine.generate(stream=): each sample once, equal to the returned one, at the step
    it stopped: the k-th call's samples have exactly k response tokens."""
    model, tokenizer = build_tiny_model(seed=0)
    engine, version = make_engine(model, tokenizer)
    contract = SamplingContract(temperature=1.0, max_new_tokens=12)
    requests = [GenerationRequest("run/0/a", encode(tokenizer, "07+45="), seed=11, candidates=(0, 1, 2)),
                GenerationRequest("run/0/b", encode(tokenizer, "3+4="), seed=12, candidates=(0, 1, 2, 3))]
    calls = []
    samples = engine.generate(requests, contract, version, stream=calls.append)
    assert samples == engine.generate(requests, contract, version)   # the hook changes nothing
    assert len(calls) == max(len(s.response_ids) for s in samples)   # one call per decode step
    for step, finished in enumerate(calls, start=1):
        assert all(len(s.response_ids) == step for s in finished)
    streamed = [s for finished in calls for s in finished]
    assert sorted(streamed, key=lambda s: s.sample_id) == sorted(samples, key=lambda s: s.sample_id)
    assert len({s.response_ids for s in samples}) > 1 and len({len(s.response_ids) for s in samples}) > 1


class _Stream:
    def __init__(self):
        self.added = []

    def add(self, items):
        self.added += items

    def finish(self):
        return {item[0].sample_id: f"record of {item[0].response_ids}" for item in self.added}


class _Tok:
    def decode(self, ids, skip_special_tokens):
        return " ".join(map(str, ids))


class _Run:
    class roles:
        tokenizer = _Tok()

        class reward:
            stream = _Stream


def _rollout_sample(candidate: int, ids: tuple, reason=StopReason.EOS):
    from sealrl.experience.ids import PolicyVersion
    from sealrl.experience.wire import RolloutSample
    return RolloutSample(f"r/0/p/{candidate}", "r/0/p", candidate, (1,), ids, (0.0,) * len(ids), None, reason,
                         PolicyVersion("r", 0, 0, "h"), 7)


def test_early_scores_are_used_only_for_the_sample_delivered():
    """A streamed record is used for an equal sample only: a failed sample is never streamed,
    a sample regenerated differently under the same id is scored again, and the first sample
    seen per id is the one streamed."""
    early = EarlyScores(_Run, lambda g: type("P", (), dict(text="q", ground_truth="1", data_source="d",
                                                            extra_info={}))())
    a, a_other, b, c = (_rollout_sample(0, (5, 6)), _rollout_sample(0, (5, 7)), _rollout_sample(1, (8,)),
                        _rollout_sample(2, (9,), StopReason.ERROR))
    early.add([a, c])
    early.add([a_other, b])   # a second delivery of id 0 (another attempt): not streamed again
    items = {s.sample_id: (s, "q", " ".join(map(str, s.response_ids))) for s in (a_other, b, c)}
    pairs, todo = early.take(list(items), items)
    assert pairs == [("r/0/p/1", "record of (8,)")]
    assert todo == ["r/0/p/0", "r/0/p/2"]


# ---- end to end: the streamed run is the unstreamed run -----------------------------------

REWARD = '''
import time


def score(response, ground_truth, sample_id):
    time.sleep(0.01)
    if sample_id.endswith("/3") and "1" in response:   # candidate 3 errs on any answer with a 1
        raise ValueError("no ones for candidate 3")
    return float(response.strip() == str(ground_truth))
'''
BASE = small_args("run.iterations=3", "run.loggers=", "run.threads=1", "run.eval_every=0", "reward.num_scorers=2")


def _numbers(run: Path) -> list[list]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [[(k, v) for k, v in r.items() if not (is_wall_clock(k) or "_s" in k)] for r in rows]


def _files(run: Path) -> list:
    return [(read_iteration(p).seal_digest, pq.read_table(p).to_pydict())
            for p in sorted((run / "experience").glob("iter_*.parquet"))]


ASYNC = ("rollout.max_staleness=1", "algorithm.correction=token_is")   # the generation thread streams too


RAY = ("placement.backend=ray", "placement.rollout_replicas=2", "placement.num_cpus=2")   # a shard at a time


def recorded_takes(monkeypatch) -> list[tuple[int, int]]:
    """(records taken from the stream, records left to score) of every scoring attempt from now."""
    takes, real_take = [], EarlyScores.take

    def take(self, ids, items):
        pairs, todo = real_take(self, ids, items)
        takes.append((len(pairs), len(todo)))
        return pairs, todo
    monkeypatch.setattr(EarlyScores, "take", take)
    return takes


@pytest.mark.parametrize("policy,extra", [("penalty", ()), ("retry", ()), ("penalty", ASYNC),
                                          ("penalty", (*ASYNC, "rollout.lane=process")),   # rows over the pipe
                                          pytest.param("penalty", RAY, marks=pytest.mark.slow)],
                         ids=["penalty", "retry", "async", "process", "ray"])
def test_streamed_run_is_bitwise_the_unstreamed_run(tmp_path, monkeypatch, policy, extra, request):
    """Same weights, sealed experience (records with their error messages) and metrics; the
    erroring reward's samples are error records (penalised or retried) in both; and the
    streamed run's first scoring attempts did take every record from the stream."""
    if extra is RAY:
        request.getfixturevalue("shared_ray")
    (tmp_path / "rew.py").write_text(REWARD)
    takes = recorded_takes(monkeypatch)
    runs = {}
    for stream in ("false", "true"):
        summary = train(build_config(None, BASE + [f"reward.fn={tmp_path / 'rew.py'}:score",
                                                   f"algorithm.reward_error={policy}", f"reward.stream={stream}",
                                                   *extra,
                                                   f"run.output_dir={tmp_path / stream}", "run.name=s"]))
        runs[stream] = (summary["weights_hash"], _files(tmp_path / stream / "s"), _numbers(tmp_path / stream / "s"))
    assert runs["true"] == runs["false"]
    assert takes == [(16, 0)] * 3   # 3 iterations of 4 prompts x 4, all streamed
    errors = sum(dict(r)["reward/errors"] for r in runs["true"][2])
    assert errors > 0   # the erroring reward did err, in the stream too
    rows = runs["true"][1][0][1]
    err = [m for m, st in zip(rows["reward_message"], rows["reward_status"]) if st == "error"]
    assert all("no ones for candidate 3" in m for m in err)


def test_stream_config_is_checked():
    with pytest.raises(ConfigError, match="reward.stream needs reward.num_scorers >= 1"):
        check_config(build_config(None, ["reward.stream=true"]))
    check_config(build_config(None, ["reward.stream=true", "reward.num_scorers=1", "placement.backend=ray"]))
    # partial rollouts stream their finished rows too (tests/test_partial.py)
    check_config(build_config(None, ["reward.stream=true", "reward.num_scorers=1", "rollout.max_staleness=1",
                                     "rollout.partial=switch", "algorithm.correction=token_is"]))
    check_config(build_config(None, ["reward.stream=true", "reward.num_scorers=1"]))


def test_episodes_stream_each_episode_as_it_ends():
    """EpisodeRunner.generate(stream=): the same episodes as without it, each streamed once,
    equal to the one returned, and no later than the decode step its last turn stopped at
    (an episode ending early in a turn is handed on while the turn's other rows decode)."""
    from sealrl.rollout.episodes import EpisodeRunner, EpisodeSpec
    from tests.test_episodes import DigitEnv
    model, tok = build_tiny_model(seed=0)
    eng, version = make_engine(model, tok)
    contract = SamplingContract(max_new_tokens=12)
    reqs = [GenerationRequest("run/0/a", encode(tok, "12+34="), 5, (0, 1, 2)),
            GenerationRequest("run/0/b", encode(tok, "7*8="), 6, (0, 1))]
    plain = EpisodeRunner(EpisodeSpec("digits", max_turns=4, max_tokens=60), tok, env=DigitEnv())
    runner = EpisodeRunner(EpisodeSpec("digits", max_turns=4, max_tokens=60), tok, env=DigitEnv())
    calls = []
    samples = runner.generate(eng.generate, reqs, contract, version, stream=calls.append)
    assert samples == plain.generate(eng.generate, reqs, contract, version)
    streamed = [s for c in calls for s in c]
    ended = [s for s in samples if s.episode.end is not StopReason.MAX_TURNS]   # the turn budget: at the end
    assert sorted(streamed, key=lambda s: s.sample_id) == sorted(ended, key=lambda s: s.sample_id)
    assert len(ended) >= 1 and len({len(s.episode.turns) for s in samples}) > 1
