"""Identity of prompts, groups, samples, and of the model version that produced a value.

Identity is never a position in a tensor: continuous batching returns samples in completion
order, and data-parallel workers see fragments. Every join is by these ids.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


def group_id(run_id: str, iteration: int, prompt_id: str) -> str:
    """`run/iter/prompt`: one group per prompt per iteration (DESIGN section 3)."""
    return f"{run_id}/{iteration}/{prompt_id}"


def sample_id(group: str, candidate: int) -> str:
    """`group/candidate`."""
    return f"{group}/{candidate}"


def split_sample_id(sid: str) -> tuple[str, int]:
    """Inverse of sample_id: (group_id, candidate index)."""
    group, _, cand = sid.rpartition("/")
    if not group or not cand.isdigit():
        raise ValueError(f"malformed sample id {sid!r}: expected 'run/iter/prompt/candidate'")
    return group, int(cand)


def digest(*parts: object, length: int = 16) -> str:
    """A short stable hex hash of JSON-serialisable parts."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True, slots=True)
class PolicyVersion:
    """Which weights produced a value.

    `step` counts committed optimizer steps of the run; `attempt` counts tries of the same update
    (a failed update that was rolled back and retried gets attempt+1, so its outputs differ in
    version). The hashes tie the version to concrete weights, tokenizer and architecture.
    """

    run_id: str
    step: int
    attempt: int = 0
    weights_hash: str = ""
    tokenizer_hash: str = ""
    model_config_hash: str = ""

    @property
    def id(self) -> str:
        """Short stable id: `run@step.attempt#hash12`."""
        h = digest(self.run_id, self.step, self.attempt, self.weights_hash,
                   self.tokenizer_hash, self.model_config_hash, length=12)
        return f"{self.run_id}@{self.step}.{self.attempt}#{h}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PolicyVersion":
        return cls(**json.loads(text))

    def __str__(self) -> str:
        return self.id
