"""Multi-turn episodes, token in and token out: the record is the sampled ids and the
observations encoded once, whatever the tokenizer does to the joined text; limits end an
episode with their reason."""
from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sealrl.envs.base import EnvStep
from sealrl.envs.tools import ToolEnv
from sealrl.experience.episode import EnvStatus, EpisodeRecord
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout.episodes import EpisodeRunner, EpisodeSpec, turn_seed

V = PolicyVersion("run", 3)


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Characters, plus one token "56" that the pre-tokenizer prefers: "5" then "6" sampled
    apart re-encode, once their text is joined, as the single token "56"."""
    chars = "0123456789?;<>/: abcdefghijklmnopqrstuvwxyz"
    vocab = {t: i for i, t in enumerate(("<pad>", "<bos>", "<eos>", "<unk>", *chars, "56"))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("56|[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


class SixEnv:
    """Answers every turn ending in "5" with "6", and ends the episode at a turn without one."""

    name, version, stops = "six", "1", ("5",)

    def reset(self, prompt):
        return prompt.ground_truth

    def step(self, state, text):
        return EnvStep("6", reward=0.5) if text.endswith("5") else EnvStep(done=True, status=EnvStatus.NONE)

    def close(self):
        pass


def scripted(tok, script: list[tuple[str, StopReason]]):
    """A policy that plays `script` turn by turn (ids of each character, sampled one by one),
    recording every request it is sent."""
    seen: list[GenerationRequest] = []

    def generate(reqs, contract, version, kv=None):
        out = []
        for r in reqs:
            k = sum(1 for q in seen if (q.group_id, q.candidates) == (r.group_id, r.candidates))
            seen.append(r)
            text, reason = script[k]
            ids = tuple(tok.convert_tokens_to_ids(list(text)))
            out.append(RolloutSample(f"{r.group_id}/{r.candidates[0]}", r.group_id, r.candidates[0], r.prompt_ids,
                                     ids, tuple(-0.5 for _ in ids), None, reason, version, 7 + k))
        return out
    return generate, seen


def test_observation_ids_are_encoded_once_never_retokenized():
    tok = merging_tokenizer()
    gen, seen = scripted(tok, [("15", StopReason.STOP), ("25", StopReason.STOP), ("9", StopReason.EOS)])
    runner = EpisodeRunner(EpisodeSpec("six", max_turns=5, max_tokens=40), tok, env=SixEnv())
    prompt = tuple(tok.convert_tokens_to_ids(list("ab")))
    [s] = runner.generate(gen, [GenerationRequest("run/0/p", prompt, seed=11, candidates=(0,))],
                          SamplingContract(max_new_tokens=8), V)
    i = {c: tok.convert_tokens_to_ids(c) for c in "125696"}
    expected = (i["1"], i["5"], i["6"], i["2"], i["5"], i["6"], i["9"])   # policy, obs, policy, obs, policy
    assert s.response_ids == expected
    joined = tok.encode(tok.decode(list(prompt + expected)), add_special_tokens=False)
    assert tuple(joined) != prompt + expected and tok.convert_tokens_to_ids("56") in joined  # the trap is real
    # token in: each turn continued from the episode's own ids
    assert [q.prompt_ids for q in seen] == [prompt, prompt + expected[:3], prompt + expected[:6]]
    assert [q.seed for q in seen] == [11, turn_seed(11, 1), turn_seed(11, 2)] and turn_seed(11, 1) != 11
    ep: EpisodeRecord = s.episode
    assert ep.response_ids == expected and ep.end is StopReason.EOS and s.stop_reason is StopReason.EOS
    assert [t.stop_reason for t in ep.turns] == [StopReason.TOOL, StopReason.TOOL, StopReason.EOS]
    assert ep.policy_mask() == [True, True, False, True, True, False, True]
    assert ep.step_reward_row() == [0, 0.5, 0, 0, 0.5, 0, 0]      # on the last token of turns 0 and 1
    assert s.rollout_log_probs == (-0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5)
    assert [t.version for t in ep.turns] == [V.id] * 3 and s.seed == 7
    assert EpisodeRecord.from_json(ep.to_json()) == ep


def test_limits_max_turns_tokens_and_observation_truncation():
    tok = merging_tokenizer()
    env = SixEnv()
    # turn budget: the environment still wanted a turn
    gen, _ = scripted(tok, [("5", StopReason.STOP)] * 3)
    [s] = EpisodeRunner(EpisodeSpec("six", max_turns=2), tok, env=env).generate(
        gen, [GenerationRequest("g", (4,), 1, (0,))], SamplingContract(max_new_tokens=4), V)
    assert s.stop_reason is StopReason.MAX_TURNS and len(s.episode.turns) == 2
    assert StopReason.MAX_TURNS.truncated and not StopReason.MAX_TURNS.terminated
    # token budget: 6 tokens; turn 0 = "15"+"6" (3), turn 1 asked for at most 3 tokens
    gen, seen = scripted(tok, [("15", StopReason.STOP), ("abc", StopReason.LENGTH)])
    [s] = EpisodeRunner(EpisodeSpec("six", max_turns=5, max_tokens=6), tok, env=env).generate(
        gen, [GenerationRequest("g", (4,), 1, (0,))], SamplingContract(max_new_tokens=8), V)
    assert s.stop_reason is StopReason.LENGTH and s.episode.turns[-1].stop_reason is StopReason.LENGTH
    assert len(s.response_ids) == 6

    class Chatty(SixEnv):
        def step(self, state, text):
            return EnvStep("abcdefghij") if text.endswith("5") else EnvStep(done=True)   # 10 tokens

    gen, _ = scripted(tok, [("5", StopReason.STOP), ("9", StopReason.EOS)])
    [s] = EpisodeRunner(EpisodeSpec("six", max_observation_tokens=4), tok, env=Chatty()).generate(
        gen, [GenerationRequest("g", (4,), 1, (0,))], SamplingContract(max_new_tokens=8), V)
    t0 = s.episode.turns[0]
    assert t0.obs_truncated and len(t0.observation_ids) == 4 and "10 tokens cut to 4" in t0.message


def test_a_raising_environment_fails_the_sample_never_scores_it():
    class Broken(SixEnv):
        def step(self, state, text):
            raise KeyError("lost state")

    tok = merging_tokenizer()
    gen, _ = scripted(tok, [("5", StopReason.STOP)])
    [s] = EpisodeRunner(EpisodeSpec("six"), tok, env=Broken()).generate(
        gen, [GenerationRequest("g", (4,), 1, (0,))], SamplingContract(max_new_tokens=8), V)
    assert s.stop_reason is StopReason.ERROR
    assert s.episode.turns[0].status is EnvStatus.ERROR and "lost state" in s.episode.turns[0].message


def test_tool_timeout_is_recorded_in_the_turn_and_the_episode_goes_on():
    import time

    def slow(args):
        time.sleep(30)

    tok = merging_tokenizer()
    env = ToolEnv({"ab": slow}, timeout_s=0.3)
    try:
        gen, _ = scripted(tok, [("<ab>1</ab>", StopReason.STOP), ("7", StopReason.EOS)])
        [s] = EpisodeRunner(EpisodeSpec("tools"), tok, env=env).generate(
            gen, [GenerationRequest("g", (4,), 1, (0,))], SamplingContract(max_new_tokens=16), V)
    finally:
        env.close()
    t0, t1 = s.episode.turns
    assert t0.status is EnvStatus.TIMEOUT and t0.stop_reason is StopReason.TOOL and t0.step_reward is None
    assert tok.decode(list(t0.observation_ids)) == "<out>error: timeout</out>"
    assert t1.stop_reason is StopReason.EOS and s.stop_reason is StopReason.EOS


@pytest.fixture(scope="module")
def engine():
    from sealrl.models.hf import model_config_hash, tokenizer_hash
    from sealrl.rollout import RolloutEngine
    from sealrl.sync.manifest import build_manifest
    model, tok = build_tiny_model(seed=0)
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    e = RolloutEngine(model, tok)
    e.load_weights(model.state_dict(), manifest)
    return e, manifest.version, tok


class DigitEnv:
    """Every turn ends at its first digit; the answer is "=x;" until the turn budget ends it."""

    name, version, stops = "digits", "1", tuple("0123456789")

    def reset(self, prompt):
        return None

    def step(self, state, text):
        return EnvStep("=x;") if text[-1:].isdigit() else EnvStep(done=True, status=EnvStatus.NONE)

    def close(self):
        pass


def test_real_engine_every_turn_is_exactly_what_the_engine_samples(engine):
    eng, version, tok = engine
    contract = SamplingContract(max_new_tokens=12)
    runner = EpisodeRunner(EpisodeSpec("digits", max_turns=4, max_tokens=60), tok, env=DigitEnv())
    reqs = [GenerationRequest("run/0/a", tuple(tok.encode("12+34=", add_special_tokens=False)), 5, (0, 1, 2)),
            GenerationRequest("run/0/b", tuple(tok.encode("7*8=", add_special_tokens=False)), 6, (0, 1))]
    samples = runner.generate(eng.generate, reqs, contract, version)
    assert [s.sample_id for s in samples] == ["run/0/a/0", "run/0/a/1", "run/0/a/2", "run/0/b/0", "run/0/b/1"]
    multi = 0
    stops = contract.stop + DigitEnv.stops
    for s in samples:
        ep = s.episode
        assert s.response_ids == ep.response_ids
        prefix = s.prompt_ids
        for k, (turn, (a, b, _)) in enumerate(zip(ep.turns, ep.spans())):
            budget = min(contract.max_new_tokens, 60 - len(prefix) + len(s.prompt_ids))
            req = GenerationRequest(s.group_id, prefix, turn_seed(reqs[0 if "/a" in s.group_id else 1].seed, k),
                                    (s.candidate,))
            [again] = eng.generate([req], SamplingContract(max_new_tokens=budget, stop=stops), version)
            assert again.response_ids == turn.ids                        # sampled ids == recorded ids
            assert again.rollout_log_probs == pytest.approx(s.rollout_log_probs[a:b], abs=1e-5)  # batch rounding
            assert all(lp == 0.0 for lp in s.rollout_log_probs[b:b + len(turn.observation_ids)])
            prefix = prefix + turn.ids + turn.observation_ids
        multi += len(ep.turns) > 1
    assert multi >= 1   # some episodes really went over several turns
