"""What a scorer sees, what it must return, and how a raw return is judged a score or not.

A `RewardFunction` returns a raw score; it never builds a RewardRecord itself. `check_raw` is
the single place that decides whether a raw value is a score:

- a real number (bool, int, float, numpy scalar, Fraction) that converts to a finite float:
  status ok, `total` = that float, `components` = {scorer name: total};
- a dict with string keys and finite real values that has a "total" key: status ok, `total` =
  d["total"], `components` = the other keys (or {scorer name: total} when there are none). The
  components are NOT summed: they are raw diagnostics (e.g. unweighted parts of a weighted sum),
  so a dict without "total" is an error rather than a guess;
- anything else (NaN, inf, None, str, a tensor, a list, a dict without "total" or with a bad
  value) is status error, with a message naming the scorer, the sample id and the bad value.

An exception raised by the scorer is also status error. None of these ever becomes a 0.

This module imports nothing heavy and, on purpose, not sealrl.experience (whose package imports
torch): pool worker processes import it at start-up and send back plain Outcomes, which the
pool turns into RewardRecords on the driver side.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

MAX_MESSAGE_CHARS = 500  # an exception text can embed a whole response; keep records small

RawScore = float | dict[str, float]
Outcome = tuple[float, dict[str, float]] | str
"""A validated score (total, components), or the text of why there is none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSample:
    """One response to score. Picklable; sent as is to pool worker processes."""

    sample_id: str
    """`run/iter/prompt/candidate` (sealrl.experience.ids); results are joined by it."""
    prompt: str
    """Prompt text as the policy saw it (after its chat template)."""
    response: str
    """Decoded response text (may end with the eos text; verifiers strip it)."""
    response_ids: tuple[int, ...] = ()
    """Token ids actually sampled, for scorers that work on tokens."""
    ground_truth: Any = None
    """Reference answer from the dataset: a string or a JSON-able value (e.g. countdown dict)."""
    data_source: str = ""
    """Dataset name, for scorers that dispatch on it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free JSON-able extras from the dataset row."""

    def __post_init__(self) -> None:
        if not isinstance(self.sample_id, str) or not self.sample_id:
            raise ValueError(f"RewardSample.sample_id must be a non-empty str, got {self.sample_id!r}")
        for name in ("prompt", "response"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"RewardSample.{name} must be str, got "
                                 f"{type(getattr(self, name)).__name__} (sample {self.sample_id!r})")
        object.__setattr__(self, "response_ids", tuple(int(t) for t in self.response_ids))


@runtime_checkable
class RewardFunction(Protocol):
    """A scorer: `fn(sample)` returns a raw score (see module docstring for what is valid).

    `name` and `version` are stamped on every record; change `version` whenever the scorer's
    behaviour changes. A scorer may also define `setup(self) -> None` (e.g. load a model): a pool
    calls it once per worker process before that worker takes work, outside any deadline.
    To run in a process pool a scorer must be picklable: a module-level class or function.
    """

    name: str
    version: str

    def __call__(self, sample: RewardSample) -> RawScore: ...


@runtime_checkable
class BatchRewardFunction(RewardFunction, Protocol):
    """A scorer that is cheaper on a batch (a reward model): one raw score per sample, in order.
    Pools call `score_batch` on a whole request instead of `__call__` per sample."""

    def score_batch(self, samples: Sequence[RewardSample]) -> list[RawScore]: ...


def reward_identity(fn: RewardFunction) -> dict[str, Any]:
    """What a resumed run must score with again: the scorer's name and version, and for a
    dataclass scorer its other field values (e.g. eos_text). JSON-able; values that are not
    JSON (nested scorers) by their repr, which for dataclasses lists their fields."""
    config = {f.name: getattr(fn, f.name) for f in dataclasses.fields(fn)
              if f.name not in ("name", "version")} if dataclasses.is_dataclass(fn) else {}
    return json.loads(json.dumps({"name": fn.name, "version": fn.version, "config": config},
                                 sort_keys=True, default=repr))


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a hostile __repr__ must not break the error path
        text = f"<{type(value).__name__} with a failing repr: {type(e).__name__}>"
    return text if len(text) <= 120 else text[:117] + "..."


def _finite(value: object) -> float | None:
    """float(value) when value is a finite real number, else None."""
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars, Fraction
        return None
    try:
        out = float(value)
    except (OverflowError, ValueError, TypeError):  # e.g. 10**400
        return None
    return out if math.isfinite(out) else None


def check_raw(raw: object) -> tuple[float, dict[str, float]] | str:
    """(total, components) for a valid raw score, else a text saying what is wrong."""
    total = _finite(raw)
    if total is not None:
        return total, {}
    if not isinstance(raw, dict):
        return (f"returned {_short_repr(raw)} ({type(raw).__name__}); expected a finite number "
                f"or a dict with a 'total' key ('score' from a custom function)")
    if "total" not in raw:
        return f"returned a dict without a 'total' key: {_short_repr(raw)}"
    components: dict[str, float] = {}
    for key, value in raw.items():
        checked = _finite(value)
        if not isinstance(key, str) or checked is None:
            return (f"returned a dict whose entry {_short_repr(key)}: {_short_repr(value)} "
                    f"is not str -> finite number")
        components[key] = checked
    return components.pop("total"), components


def call_checked(fn: "RewardFunction", sample: "RewardSample", label: str) -> tuple[float, dict[str, float]]:
    """(total, components) of one scorer of a composite (a component, a routed source). A raise
    or a bad value is raised again naming `label`; the pool records the sample as an error."""
    try:
        raw = fn(sample)
    except Exception as e:
        raise RuntimeError(f"{label} raised {type(e).__name__}: {e}") from e
    checked = check_raw(raw)
    if isinstance(checked, str):
        raise ValueError(f"{label} {checked}")
    return checked


def _message(scorer: str, version: str, sample_id: str, detail: str) -> str:
    text = f"scorer {scorer!r} (version {version}) on sample {sample_id!r}: {detail}"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def _raised(error: BaseException) -> str:
    """Exception type, text, and the innermost frame it was raised in."""
    where = ""
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        where = f" at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"
    return f"raised {type(error).__name__}: {error}{where}"


def score_raw(fn: RewardFunction, samples: Sequence[RewardSample]) -> list[Outcome]:
    """Call the scorer in this process: one Outcome per sample, in order; never raises for
    scorer faults (exceptions, sys.exit() and invalid returns become error texts naming scorer
    and sample).

    A BatchRewardFunction gets one `score_batch` call: if it raises or returns the wrong number
    of scores, every sample of the batch gets an error (there is no per-sample result).

    A scorer that forks: a copy that comes back here (returns or raises) is not this process and
    ends at once (os._exit), so it can never go on as a second trainer or scorer.
    """
    name, version = fn.name, fn.version

    def outcome(raw: object, sample_id: str) -> Outcome:
        checked = check_raw(raw)
        if isinstance(checked, str):
            return _message(name, version, sample_id, checked)
        total, components = checked
        return total, components or {name: total}

    if isinstance(fn, BatchRewardFunction):
        raws, error = _contained(lambda: list(fn.score_batch(list(samples))))
        if error is not None:
            return [_message(name, version, s.sample_id, _raised(error)) for s in samples]
        if len(raws) != len(samples):
            detail = f"score_batch returned {len(raws)} scores for {len(samples)} samples"
            return [_message(name, version, s.sample_id, detail) for s in samples]
        return [outcome(raw, s.sample_id) for raw, s in zip(raws, samples)]
    outcomes: list[Outcome] = []
    for sample in samples:
        raw, error = _contained(lambda: fn(sample))  # noqa: B023 - called at once
        outcomes.append(outcome(raw, sample.sample_id) if error is None
                        else _message(name, version, sample.sample_id, _raised(error)))
    return outcomes


def _contained(call) -> tuple[Any, BaseException | None]:
    """(call(), None), or (None, the Exception or SystemExit it raised); a forked copy of this
    process that gets back here exits without running anything of its caller."""
    pid = os.getpid()
    try:
        return call(), None
    except (Exception, SystemExit) as e:
        return None, e
    finally:
        if os.getpid() != pid:
            os._exit(0)


def failure_message(scorer: str, version: str, sample_id: str, detail: str) -> str:
    """The message of an error or timeout decided outside the scorer (the pool)."""
    return _message(scorer, version, sample_id, detail)
