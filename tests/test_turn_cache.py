"""KV caches kept across the turns of an episode (rollout/turns.py): the same ids and, within
fp32 rounding, the same behaviour log-probs as prefilling every turn again; a cache never
serves another version."""
from __future__ import annotations

import pytest

from sealrl.data.dataset import prompts_from_rows
from sealrl.data.tasks import make_task
from sealrl.envs import make_env
from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest, env_input
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import RolloutEngine
from sealrl.rollout.episodes import EpisodeRunner, EpisodeSpec
from sealrl.rollout.turns import TurnCache
from sealrl.sync.manifest import build_manifest
from tests.test_episodes import DigitEnv


def _engine(model, tok, step: int = 0):
    manifest = build_manifest(model.state_dict(), "run", step, step, tokenizer_hash(tok),
                              model_config_hash(model.config))
    e = RolloutEngine(model, tok)
    e.load_weights(model.state_dict(), manifest)
    return e, manifest.version


class Counting:
    """engine.generate, recording how many tokens each call was asked to continue from."""

    def __init__(self, engine):
        self.engine, self.kvs = engine, []

    def __call__(self, reqs, contract, version, kv=None):
        self.kvs.append(kv)
        return self.engine.generate(reqs, contract, version, kv=kv)


def _assert_same_episodes(cached, again):
    assert [s.sample_id for s in cached] == [s.sample_id for s in again]
    turns = 0
    for a, b in zip(cached, again):
        assert [t.ids for t in a.episode.turns] == [t.ids for t in b.episode.turns]   # per turn, exactly
        assert [t.observation_ids for t in a.episode.turns] == [t.observation_ids for t in b.episode.turns]
        assert a.response_ids == b.response_ids and a.stop_reason is b.stop_reason and a.seed == b.seed
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5, rel=0)
        if a.filtered_log_probs is not None:
            assert a.filtered_log_probs == pytest.approx(b.filtered_log_probs, abs=1e-5, rel=0)
        turns += len(a.episode.turns)
    return turns


@pytest.mark.parametrize("contract", [SamplingContract(max_new_tokens=12),
                                      SamplingContract(max_new_tokens=9, temperature=0.7, top_k=20, top_p=0.9)])
def test_tiny_model_cached_turns_equal_prefilled_turns(contract):
    model, tok = build_tiny_model(seed=0)
    engine, version = _engine(model, tok)
    reqs = [GenerationRequest("run/0/a", tuple(tok.encode("12+34=", add_special_tokens=False)), 5, (0, 1, 2)),
            GenerationRequest("run/0/b", tuple(tok.encode("7*8=", add_special_tokens=False)), 6, (0, 1)),
            GenerationRequest("run/0/c", tuple(tok.encode("100+200+300=", add_special_tokens=False)), 7, (3,))]
    spec = EpisodeSpec("digits", max_turns=4, max_tokens=40)
    counting = Counting(engine)
    cached = EpisodeRunner(spec, tok, env=DigitEnv()).generate(counting, reqs, contract, version)
    again = EpisodeRunner(spec, tok, env=DigitEnv(), reuse_kv=False).generate(engine.generate, reqs, contract, version)
    turns = _assert_same_episodes(cached, again)
    assert turns > len(cached)   # episodes really went over several turns (the budget groups them too)
    kv = counting.kvs[0]
    assert all(k is kv for k in counting.kvs) and kv.version == version
    # What was fed: each prompt once, then per continued turn its last sampled token and observation.
    prompts = sum(len(r.prompt_ids) for r in reqs)
    later = sum(1 + len(t.observation_ids) for s in cached for t in s.episode.turns[:-1])
    assert kv.fed_tokens == prompts + later
    assert kv.reused_tokens > 0


def test_arith_tools_model_cached_turns_equal_prefilled_turns():
    """The embedded tool model on its task with the calculator, sampled as examples/arith_tools.yaml does."""
    model, tok = load_causal_lm("sealrl/assets/arith-tools")
    engine, version = _engine(model, tok)
    prompts = prompts_from_rows(make_task("mul3", "train", 6, 0), tok, 32).prompts
    reqs = [GenerationRequest(f"run/0/{p.prompt_id}", tuple(p.token_ids), 100 + i, tuple(range(4)), env_input(p))
            for i, p in enumerate(prompts)]
    contract = SamplingContract(max_new_tokens=24, temperature=1.0)
    spec = EpisodeSpec("calc", max_turns=2, max_tokens=64, max_observation_tokens=24)
    env = make_env("calc", 2.0)
    try:
        counting = Counting(engine)
        cached = EpisodeRunner(spec, tok, env=env).generate(counting, reqs, contract, version)
        again = EpisodeRunner(spec, tok, env=env, reuse_kv=False).generate(engine.generate, reqs, contract, version)
    finally:
        env.close()
    turns = _assert_same_episodes(cached, again)
    assert turns > len(cached) and counting.kvs[0].reused_tokens > 0   # the tool was called, caches reused


def test_a_continued_batch_may_mix_kept_and_new_rows_and_reuse_the_common_prefix():
    """Engine level: one call holds a row continuing from its block, a row whose request
    diverged from its block after 2 tokens (only those are reused), a row never seen, and a
    row never seen whose sequence is the first one's (it shares that row's state: fed once)."""
    model, tok = build_tiny_model(seed=1)
    engine, version = _engine(model, tok)
    contract = SamplingContract(max_new_tokens=6)
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    kv = TurnCache(version)
    first = engine.generate([GenerationRequest("g/a", enc("1+2="), 3, (0, 1))], contract, version, kv=kv)
    assert kv.fed_tokens == 4   # one prefill for both candidates
    nxt = [GenerationRequest("g/a", first[0].prompt_ids + first[0].response_ids + enc(";5"), 9, (0,)),
           GenerationRequest("g/a", enc("1+9=") + first[1].response_ids, 9, (1,)),
           GenerationRequest("g/new", enc("44*3="), 10, (0,)),
           GenerationRequest("g/twin", first[0].prompt_ids + first[0].response_ids + enc(";5"), 9, (0,))]
    cached = engine.generate(nxt, contract, version, kv=kv)
    plain = engine.generate(nxt, contract, version)
    assert cached[3].response_ids == cached[0].response_ids   # same sequence, same seed
    for a, b in zip(cached, plain):
        assert a.response_ids == b.response_ids and a.stop_reason is b.stop_reason
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5, rel=0)
    reused0 = len(first[0].prompt_ids) + len(first[0].response_ids) - 1   # all but its last sampled token
    assert kv.reused_tokens == reused0 + 2                                 # "1+" of the diverged row
    assert kv.fed_tokens == 4 + (len(nxt[0].prompt_ids) - reused0) + (len(nxt[1].prompt_ids) - 2) + 5


def test_a_turn_cache_never_serves_another_version():
    model, tok = build_tiny_model(seed=0)
    engine, v0 = _engine(model, tok, step=0)
    req = [GenerationRequest("g/a", (5, 6, 7), 3, (0,))]
    kv = TurnCache(v0)
    engine.generate(req, SamplingContract(max_new_tokens=3), v0, kv=kv)
    manifest = build_manifest(model.state_dict(), "run", 1, 1, tokenizer_hash(tok), model_config_hash(model.config))
    engine.load_weights(model.state_dict(), manifest)   # v1: the same weights, another version
    with pytest.raises(ValueError, match="never reused across versions"):
        engine.generate(req, SamplingContract(max_new_tokens=3), manifest.version, kv=kv)
    # the same version re-staged is another backend: refused too
    again = manifest.version
    kv1 = TurnCache(again)
    engine.generate(req, SamplingContract(max_new_tokens=3), again, kv=kv1)
    engine.load_weights(model.state_dict(), manifest)
    with pytest.raises(ValueError, match="another backend"):
        engine.generate(req, SamplingContract(max_new_tokens=3), again, kv=kv1)


def test_the_hf_fallback_keeps_no_blocks_and_prefills_every_turn():
    model, tok = build_tiny_model(seed=0)
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    hf = RolloutEngine(model, tok, prefer_lean=False)
    hf.load_weights(model.state_dict(), manifest)
    reqs = [GenerationRequest("run/0/a", tuple(tok.encode("12+34=", add_special_tokens=False)), 5, (0, 1))]
    contract, spec = SamplingContract(max_new_tokens=8), EpisodeSpec("digits", max_turns=3, max_tokens=30)
    counting = Counting(hf)
    with_kv = EpisodeRunner(spec, tok, env=DigitEnv()).generate(counting, reqs, contract, manifest.version)
    without = EpisodeRunner(spec, tok, env=DigitEnv(), reuse_kv=False).generate(hf.generate, reqs, contract,
                                                                               manifest.version)
    assert [s.response_ids for s in with_kv] == [s.response_ids for s in without]
    assert [s.rollout_log_probs for s in with_kv] == [s.rollout_log_probs for s in without]   # the same path
    assert counting.kvs[0].fed_tokens == 0 and counting.kvs[0].reused_tokens == 0
    assert any(len(s.episode.turns) > 1 for s in with_kv)
