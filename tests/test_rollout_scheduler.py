"""rollout.max_rows / rollout.continuous_batching (rollout/scheduler.py): with at most max_rows
rows decoding at once, in waves or admitting requests into finished rows, every request's ids
equal the unbounded path's and its log-probs agree within 1e-5 (batch rounding: not bitwise)."""
from __future__ import annotations

import pytest

from sealrl.config import build_config
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import scheduler
from sealrl.rollout.scheduler import waves
from tests.test_rollout_engine import encode, make_engine

# the last prompt is the longest: admitted late, it needs columns before the running rows' (a shift)
TEXTS = ["07+45=", "3+4=", "9=", "12*3=", "5+5+5+5=", "1=", "88-1=", "100+200+300+400="]
# frequent tokens of the untrained tiny model as stops: responses of 1 to 16 tokens
CONTRACT = SamplingContract(temperature=1.0, max_new_tokens=16, stop_token_ids=(16, 14, 54, 25, 47, 36, 7, 9))


def test_waves_cut_whole_requests():
    # by hand: rows of requests of 3, 3, 2, 4 with at most 6 rows -> [3+3], [2+4]; at most 4 -> [3], [3], [2], [4]
    reqs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11]]
    assert waves(reqs, 6) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert waves(reqs, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11]]
    assert waves([[0, 1, 2, 3, 4]], 2) == [[0, 1, 2, 3, 4]]   # a request larger than max_rows: its own wave


@pytest.fixture(scope="module")
def engine():
    model, tok = build_tiny_model(seed=0)
    eng, version = make_engine(model, tok)
    reqs = [GenerationRequest(f"r/0/{i}", encode(tok, t), seed=100 + i, candidates=tuple(range(3)))
            for i, t in enumerate(TEXTS)]
    return eng, version, reqs


# (max_rows, continuous, the long prompt arrives while the running rows' column is still before its length)
@pytest.mark.parametrize("max_rows,cont,shifted", [(4, False, 0), (7, False, 0), (4, True, 1), (7, True, 1),
                                                   (10, True, 0)])
def test_bounded_rows_give_the_unbounded_samples(engine, monkeypatch, max_rows, cont, shifted):
    eng, version, reqs = engine
    eng.max_rows, eng.continuous = 0, False
    ref = eng.generate(reqs, CONTRACT, version)
    calls = {"admit": 0, "shift": 0, "trim": 0}
    for name in calls:
        real = getattr(scheduler, f"_{name}")

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(scheduler, f"_{name}", counted)
    eng.max_rows, eng.continuous = max_rows, cont
    try:
        got = eng.generate(reqs, CONTRACT, version)
    finally:
        eng.max_rows, eng.continuous = 0, False
    assert [s.sample_id for s in got] == [s.sample_id for s in ref]
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    assert [s.stop_reason for s in got] == [s.stop_reason for s in ref]
    for a, b in zip(got, ref):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
    lengths = {len(s.response_ids) for s in ref}
    assert len(lengths) > 3 and {StopReason.STOP, StopReason.LENGTH} <= {s.stop_reason for s in ref}
    if cont:   # requests were admitted into a running batch (more admissions than waves), trimmed
        assert calls["admit"] > len(TEXTS) * 3 // max_rows and calls["trim"] >= 1
        assert (calls["shift"] >= 1) == bool(shifted)


def test_continuous_streams_each_row_at_its_step(engine):
    eng, version, reqs = engine
    eng.max_rows, eng.continuous = 5, True
    seen = []
    try:
        got = eng.generate(reqs, CONTRACT, version, stream=seen.append)
    finally:
        eng.max_rows, eng.continuous = 0, False
    streamed = sorted((s for c in seen for s in c), key=lambda s: s.sample_id)
    assert streamed == sorted(got, key=lambda s: s.sample_id)


def test_hf_backend_runs_waves():
    """The HF fallback has no column layout to splice into: continuous_batching runs waves there."""
    model, tok = build_tiny_model(seed=0)
    eng, version = make_engine(model, tok, prefer_lean=False)
    reqs = [GenerationRequest(f"r/0/{i}", encode(tok, t), seed=100 + i, candidates=(0, 1)) for i, t in enumerate(TEXTS)]
    ref = eng.generate(reqs, CONTRACT, version)
    eng.max_rows, eng.continuous = 5, True
    got = eng.generate(reqs, CONTRACT, version)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    for a, b in zip(got, ref):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)


def test_config_keys():
    assert build_config(None, ["rollout.max_rows=64"]).rollout.max_rows == 64
    with pytest.raises(Exception, match="rollout.continuous_batching was removed: rows are always admitted"):
        build_config(None, ["rollout.continuous_batching=true"])
    with pytest.raises(Exception, match="rollout.max_rows"):
        build_config(None, ["rollout.max_rows=-1"])
