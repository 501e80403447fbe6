"""The rollout wire: what crosses between the driver and any rollout client (an in-process
engine, a generation process, a Ray replica pool, later another engine). Plain frozen records
and one error, no torch and no transformers, so that the ledger, the reward role and the
placement layer can name them without loading a model library (rollout/client.py is the
protocol that carries them)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from sealrl.experience.episode import EpisodeRecord
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import StopReason


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt's group, or the subset of its candidates a retry regenerates."""

    group_id: str                 # run/iter/prompt
    prompt_ids: tuple[int, ...]
    seed: int                     # per-request seed
    candidates: tuple[int, ...]   # which candidates of the group to sample
    env_input: str = ""           # multi-turn: JSON of the row an environment starts from (episodes.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "candidates", tuple(int(c) for c in self.candidates))
        if not self.prompt_ids:
            raise ValueError(f"request {self.group_id}: prompt_ids is empty")
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"request {self.group_id}: candidates must be non-empty and unique, "
                             f"got {self.candidates}")
        if min(self.candidates) < 0:
            raise ValueError(f"request {self.group_id}: negative candidate in {self.candidates}")


@dataclass(frozen=True)
class RolloutSample:
    """One sampled response with the facts the rollout role owns (DESIGN section 3)."""

    sample_id: str
    group_id: str
    candidate: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_log_probs: tuple[float, ...]          # log_softmax(logits / T), unfiltered
    filtered_log_probs: tuple[float, ...] | None  # under the top-k/top-p distribution sampled
    stop_reason: StopReason
    policy_version: PolicyVersion
    seed: int                                     # the per-candidate seed actually used
    # Seconds from the start of the generate call to the end of the decode step this sample
    # stopped at (eos, stop or length). A measurement, not a fact: no part of equality, of
    # the sealed record or of any digest.
    finish_s: float = field(default=0.0, compare=False)
    episode: EpisodeRecord | None = None          # multi-turn: the turns (rollout/episodes.py)
    # Partial rollouts (rollout/switching.py): (first response token, PolicyVersion) of each run
    # of tokens one version sampled, the first at 0 by policy_version; () = all by policy_version.
    segments: tuple = ()


class VersionNotHeldError(RuntimeError):
    """generate() was asked for a version this replica does not serve."""


def env_input(prompt) -> str:
    """GenerationRequest.env_input of a dataset prompt (data.dataset.Prompt): the row an episode's
    environment starts from (rollout/episodes.py reads it back)."""
    return json.dumps({"prompt_id": prompt.prompt_id, "text": prompt.text,
                       "ground_truth": prompt.ground_truth, "data_source": prompt.data_source}, sort_keys=True)
