"""Multi-turn episodes, token in and token out (DESIGN section 10).

Each episode continues from its own token ids: turn k's prompt is the episode's sequence so far
(prompt, policy tokens exactly as sampled, observations exactly as encoded once), and nothing
already in it is decoded and encoded again. A tokenizer's encoding of the joined text may
differ from the concatenated ids (merges across a boundary); re-tokenizing would train the
policy on ids it never sampled, so this loop never does it. The environment sees decoded text
of the turn it answers; only its observation is encoded, once, alone.

One call of `EpisodeRunner.generate` plays every requested episode to its end, turn by turn:
the live episodes of a turn are sampled together through the engine's generate (one request per
episode; a candidate keeps its index, so its seed for turn k is candidate_seed(turn_seed(request
seed, k), candidate), and turn 0 is exactly the single-turn sample). A turn ends at eos, at an
environment stop string (a tool call's closing tag: the environment answers and the turn's
stop reason is TOOL), or at its token budget (LENGTH). The episode ends when the environment
says done (its last turn's eos / stop), at the token budget (LENGTH), or at the turn budget
(MAX_TURNS). An environment that raises ends its episode with stop reason ERROR: the sample is
failed (regenerated with the same seeds, then its group dropped and recorded by the ledger),
never scored. Tool failures are statuses of their turn (experience/episode.py), never rewards.

Every turn is sampled from the one version the call holds, and each episode's KV cache is
carried from one turn to the next (rollout/turns.py, a TurnCache made per call, so per
version): a continued turn feeds only its last sampled token and its observation ids on top of
the kept keys and values, never the whole sequence again. The ids are those a re-prefill would
sample and the log-probs equal its up to float rounding (tests/test_turn_cache.py: 1e-5 in
fp32); `reuse_kv=False` keeps that re-prefill path for those tests. The HF fallback backend
keeps no caches and prefills every turn.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from sealrl.envs import make_env
from sealrl.experience.episode import EnvStatus, EpisodeRecord, TurnRecord
from sealrl.experience.ids import sample_id
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.rollout.sampling import _splitmix64
from sealrl.rollout.turns import TurnCache


@dataclass(frozen=True)
class EpisodeSpec:
    """What a rollout worker needs to play episodes (picklable: built again in each worker)."""

    env: str                        # env.name: built-in, module:Class or file.py:Class
    max_turns: int = 4              # policy turns per episode
    max_tokens: int = 96            # response tokens per episode (policy + observation)
    max_observation_tokens: int = 32  # an observation is cut to this, and marked
    tool_timeout_s: float = 2.0     # per tool call
    source: str = ""                # a file env's text, read on the driver: every worker runs this code


@dataclass(frozen=True)
class EpisodeStart:
    """The row an environment starts an episode from."""

    prompt_id: str
    prompt_ids: tuple[int, ...]
    text: str
    ground_truth: Any
    data_source: str


def turn_seed(request_seed: int, turn: int) -> int:
    """The request seed of turn `turn`: the request's own for turn 0, a hash of both after."""
    return request_seed if turn == 0 else _splitmix64((request_seed ^ _splitmix64(turn)) & (2 ** 64 - 1)) >> 1


@dataclass
class _Episode:
    request: GenerationRequest
    candidate: int
    state: Any
    sequence: list[int]                              # prompt + response so far
    turns: list[TurnRecord] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    filtered: list[float] = field(default_factory=list)
    end: StopReason | None = None
    seed: int = 0
    finish_s: float = 0.0
    advanced: int = -1                               # the last turn appended (_advance)

    @property
    def num_response(self) -> int:
        return len(self.sequence) - len(self.request.prompt_ids)


Generate = Callable[..., list[RolloutSample]]   # (requests, contract, version, kv=TurnCache | None)


class EpisodeRunner:
    def __init__(self, spec: EpisodeSpec, tokenizer, env=None, reuse_kv: bool = True) -> None:
        """`reuse_kv=False`: every turn prefills its whole sequence again (the reference path
        of the parity tests; same ids, log-probs equal up to float rounding)."""
        self.spec, self.tokenizer, self.reuse_kv = spec, tokenizer, reuse_kv
        self.env = env if env is not None else make_env(spec.env, spec.tool_timeout_s, spec.source)

    def generate(self, generate: Generate, requests: list[GenerationRequest], contract: SamplingContract,
                 version, stream=None) -> list[RolloutSample]:
        """Play every (request, candidate) episode to its end; samples in request, candidate order.
        `generate(requests, contract, version, kv=)` samples one turn (RolloutEngine.generate).
        `stream(samples)`: after every decode step, the samples of the episodes that ended at it
        (reward.stream). Each episode's turn then goes to the environment as soon as the turn's
        row stops, not once the whole turn's batch did: the same calls per episode (an
        environment keeps its state per episode), in the order rows stop."""
        episodes = [self._start(r, c) for r in requests for c in r.candidates]
        stops = tuple(dict.fromkeys(contract.stop + tuple(self.env.stops)))
        kv = TurnCache(version) if self.reuse_kv else None   # this call's version only
        for turn in range(self.spec.max_turns):
            live = [e for e in episodes if e.end is None]
            by_budget: dict[int, list[_Episode]] = {}
            for e in live:
                by_budget.setdefault(min(contract.max_new_tokens, self.spec.max_tokens - e.num_response), []).append(e)
            for budget, group in sorted(by_budget.items()):
                turn_contract = dataclasses.replace(contract, max_new_tokens=budget, stop=stops)
                reqs = [GenerationRequest(e.request.group_id, tuple(e.sequence), turn_seed(e.request.seed, turn),
                                          (e.candidate,)) for e in group]
                hook = {} if stream is None else {"stream": self._streamed(group, turn, version, contract, stream)}
                for e, s in zip(group, generate(reqs, turn_contract, version, kv=kv, **hook)):
                    if e.advanced < turn:   # reward.stream advances each episode as its turn ends
                        self._advance(e, s, turn)
            if kv is not None:
                kv.forget([(e.request.group_id, e.candidate) for e in live if e.end is not None])
        for e in episodes:   # the turn budget ran out while the environment wanted more
            if e.end is None:
                e.end = StopReason.MAX_TURNS
        return [self._sample(e, version, contract.filtered) for e in episodes]

    def close(self) -> None:
        self.env.close()

    def _streamed(self, group: list, turn: int, version, contract: SamplingContract, stream) -> Callable:
        """The engine's stream hook for one turn of `group`: advance each episode whose turn
        row stopped, and hand on the samples of those that ended."""
        by_key = {(e.request.group_id, e.candidate): e for e in group}

        def on_step(samples: list[RolloutSample]) -> None:
            ended = []
            for s in samples:
                e = by_key[(s.group_id, s.candidate)]
                self._advance(e, s, turn)
                if e.end is not None:
                    ended.append(self._sample(e, version, contract.filtered))
            stream(ended)
        return on_step

    # ---- one episode -----------------------------------------------------------------------
    def _start(self, request: GenerationRequest, candidate: int) -> _Episode:
        row = json.loads(request.env_input) if request.env_input else {}
        start = EpisodeStart(row.get("prompt_id", request.group_id), request.prompt_ids, row.get("text", ""),
                             row.get("ground_truth"), row.get("data_source", ""))
        e = _Episode(request, candidate, None, list(request.prompt_ids))
        try:
            e.state = self.env.reset(start)
        except Exception as exc:  # noqa: BLE001 - an environment failure fails the sample, named
            e.end, e.turns = StopReason.ERROR, [self._error_turn(f"reset: {type(exc).__name__}: {exc}")]
        return e

    def _advance(self, e: _Episode, s: RolloutSample, turn: int) -> None:
        """Append the sampled turn; ask the environment unless the turn hit its budget."""
        e.advanced = turn
        ids = tuple(s.response_ids)
        e.sequence += ids
        e.log_probs += s.rollout_log_probs
        e.filtered += s.filtered_log_probs or ()
        e.seed = s.seed if turn == 0 else e.seed
        e.finish_s = s.finish_s
        base = dict(ids=ids, version=s.policy_version.id, seed=s.seed)
        if s.stop_reason is StopReason.LENGTH:
            e.turns.append(TurnRecord(stop_reason=StopReason.LENGTH, **base))
            e.end = StopReason.LENGTH
            return
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        try:
            step = self.env.step(e.state, text)
        except Exception as exc:  # noqa: BLE001 - an environment failure fails the sample, named
            e.turns.append(TurnRecord(stop_reason=s.stop_reason, status=EnvStatus.ERROR,
                                      message=f"step: {type(exc).__name__}: {exc}"[:200], **base))
            e.end = StopReason.ERROR
            return
        obs, truncated, note = self._observation(step.observation, e)
        reason = s.stop_reason if step.done else StopReason.TOOL
        e.turns.append(TurnRecord(stop_reason=reason, observation_ids=obs, status=step.status, tool=step.tool,
                                  message=(step.message + note).strip("; "), obs_truncated=truncated,
                                  step_reward=step.reward, **base))
        e.sequence += obs
        e.log_probs += [0.0] * len(obs)       # observation tokens were not sampled
        e.filtered += [0.0] * len(obs) if s.filtered_log_probs is not None else []
        if step.done:
            e.end = StopReason.EOS if s.stop_reason is StopReason.EOS else StopReason.STOP
        elif e.num_response >= self.spec.max_tokens:
            e.end = StopReason.LENGTH

    def _observation(self, obs, e: _Episode) -> tuple[tuple[int, ...], bool, str]:
        """The observation's ids, encoded once, cut to the observation and episode budgets."""
        ids = tuple(obs) if not isinstance(obs, str) else \
            tuple(self.tokenizer.encode(obs, add_special_tokens=False)) if obs else ()
        cap = min(self.spec.max_observation_tokens, self.spec.max_tokens - e.num_response)
        if len(ids) <= cap:
            return ids, False, ""
        return ids[:max(0, cap)], True, f"; observation of {len(ids)} tokens cut to {max(0, cap)}"

    def _error_turn(self, message: str) -> TurnRecord:
        return TurnRecord((), StopReason.ERROR, "", 0, status=EnvStatus.ERROR, message=message[:200])

    def _sample(self, e: _Episode, version, filtered: bool) -> RolloutSample:
        record = EpisodeRecord(f"{self.env.name}@{self.env.version}", tuple(e.turns), e.end)
        response = tuple(e.sequence[len(e.request.prompt_ids):])
        assert response == record.response_ids   # the record is the sequence, token for token
        return RolloutSample(sample_id(e.request.group_id, e.candidate), e.request.group_id, e.candidate,
                             e.request.prompt_ids, response, tuple(e.log_probs),
                             tuple(e.filtered) if filtered else None, e.end, version,
                             e.seed, e.finish_s, episode=record)
