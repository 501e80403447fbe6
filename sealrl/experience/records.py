"""Typed per-sample records: stop reasons, reward records, sampling contracts, roles.

These are plain values: nothing here knows about tensors or models.
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field


class Role(str, enum.Enum):
    """The role that produced a field (DESIGN section 2)."""

    DRIVER = "driver"
    ROLLOUT = "rollout"
    ACTOR = "actor"
    REFERENCE = "reference"
    REWARD = "reward"
    CRITIC = "critic"


class StopReason(str, enum.Enum):
    """Why a response ended.

    `terminated` (the episode really ended: EOS, a stop string, task end) is not the same as
    `truncated` (cut by a budget: max tokens, a deadline). Only true termination drops the critic
    bootstrap in GAE; a truncated response bootstraps from the value at the cut.
    """

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    TOOL = "tool"
    ERROR = "error"
    MAX_TURNS = "max_turns"   # an episode cut by its turn budget (sealrl/rollout/episodes.py)

    @property
    def terminated(self) -> bool:
        return self in (StopReason.EOS, StopReason.STOP)

    @property
    def truncated(self) -> bool:
        return self in (StopReason.LENGTH, StopReason.MAX_TURNS)


class RewardStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """What a scorer said about one sample.

    An error or a timeout is not a score: `total` is None unless status is ok, and `score()`
    refuses to turn an error into a number. What happens to errored samples is the driver's
    reward-error policy (retry, drop the group, or an explicit penalty), never a silent 0.
    """

    status: RewardStatus
    total: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    scorer: str = ""
    scorer_version: str = ""
    message: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.status, RewardStatus):
            object.__setattr__(self, "status", RewardStatus(self.status))
        if self.status is RewardStatus.OK:
            if self.total is None or not math.isfinite(self.total):
                raise ValueError(f"RewardRecord: status ok needs a finite total, got {self.total!r}")
            for name, value in self.components.items():
                if not math.isfinite(value):
                    raise ValueError(f"RewardRecord: component {name!r} is {value!r}, not finite")
        elif self.total is not None:
            raise ValueError(f"RewardRecord: status {self.status.value} must not carry a total "
                             f"(got {self.total!r}); an error is not a score")

    @property
    def ok(self) -> bool:
        return self.status is RewardStatus.OK

    def score(self) -> float:
        if not self.ok:
            raise ValueError(f"reward of scorer {self.scorer!r} has status {self.status.value} "
                             f"({self.message}); it is not a score")
        return float(self.total)  # type: ignore[arg-type]

    @classmethod
    def success(cls, total: float, scorer: str, version: str = "1",
                components: dict[str, float] | None = None) -> "RewardRecord":
        return cls(RewardStatus.OK, float(total), dict(components or {scorer: float(total)}),
                   scorer, version)

    @classmethod
    def failure(cls, status: RewardStatus, scorer: str, message: str,
                version: str = "1") -> "RewardRecord":
        return cls(RewardStatus(status), None, {}, scorer, version, message)

    def to_json(self) -> str:
        d = asdict(self)
        d["status"] = self.status.value
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RewardRecord":
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class SamplingContract:
    """How a response was sampled; with the seed and request id it regenerates the response."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def filtered(self) -> bool:
        """True when top-k/top-p change the sampling distribution."""
        return self.top_k > 0 or self.top_p < 1.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SamplingContract":
        d = json.loads(text)
        d["stop"] = tuple(d["stop"])
        d["stop_token_ids"] = tuple(d["stop_token_ids"])
        return cls(**d)
