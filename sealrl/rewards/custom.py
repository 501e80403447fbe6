"""A user's own reward function, named in config as `package.module:function` or
`path/to/file.py:function` (docs/rewards.md has the contract; this module enforces it).

The function takes any of the parameters in PARAMETERS, bound by name (so verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)` works unchanged; a parameter
with a default that is not in the table is left to its default). It returns a finite number, or
a dict with a finite "score" and other named finite numbers (kept as the record's components).
Anything else (NaN, inf, None, a string, a dict without "score") becomes an error record naming
the function, through the one judge of raw scores, sealrl.rewards.base.check_raw.

Loading is checked when the scorer is built (sealrl.trainer.inputs, before any run folder): a
missing file, module or function, a non-callable, a module that fails to import, or a signature
that cannot be bound is a ConfigError naming the key, the file and the function. A relative file
path is resolved against the working directory of the sealrl process, like every other path in a
config. A CustomReward pickles as its path and function name: a scorer process loads the file
again (sealrl.rewards.worker calls `setup()`), so the function need not be importable there.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Callable

from sealrl.config import ConfigError, relative_note
from sealrl.plugins import file_hash, import_file, import_source, is_file_spec
from sealrl.rewards.base import RawScore, RewardSample

# parameter name -> what it receives from the sample
PARAMETERS: dict[str, Callable[[RewardSample], Any]] = {
    "data_source": lambda s: s.data_source,
    "prompt": lambda s: s.prompt,
    "response": lambda s: s.response,
    "solution_str": lambda s: s.response,   # verl's name for the response text
    "ground_truth": lambda s: s.ground_truth,
    "extra_info": lambda s: dict(s.metadata),
    "response_ids": lambda s: list(s.response_ids),
    "sample_id": lambda s: s.sample_id,
}
RESPONSE_PARAMETERS = ("response", "solution_str", "response_ids")
USER_MODULE_PREFIX = "sealrl_user_reward_"


def _bind_plan(fn: Callable, where: str, key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(positional-only names, keyword names) to pass, or a ConfigError saying what is expected."""
    expected = f"parameters named from {', '.join(PARAMETERS)} (at least one of response, solution_str)"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {where} has no inspectable signature ({e}); it must take {expected}", key) \
            from None
    positional, keywords = [], []
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in PARAMETERS:
            if p.default is p.empty:
                raise ConfigError(f"{key}: {where} takes a parameter {p.name!r} that sealrl cannot fill; "
                                  f"expected {expected}", key)
            continue
        (positional if p.kind is p.POSITIONAL_ONLY else keywords).append(p.name)
    if not set(positional + keywords) & set(RESPONSE_PARAMETERS):
        raise ConfigError(f"{key}: {where} takes ({', '.join(signature.parameters)}), which never sees the "
                          f"response; expected {expected}", key)
    return tuple(positional), tuple(keywords)


def load_function(spec: str, key: str) -> tuple[Callable, str | None, str]:
    """(function, its file or None, "file/module:function" for messages) of a spec with a colon."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"{key}={spec!r} must look like package.module:function or path/file.py:function", key)
    if is_file_spec(target):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{key}={spec!r}: reward file {target} does not exist{relative_note(target)}", key)
        path = path.resolve()
        try:
            module = import_file(path, USER_MODULE_PREFIX)
        except Exception as e:
            raise ConfigError(f"{key}={spec!r}: loading {path} raised {type(e).__name__}: {e}", key) from None
        source = str(path)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise ConfigError(f"{key}={spec!r}: module {target} cannot be imported ({type(e).__name__}: {e}); "
                              "is it on PYTHONPATH?", key) from None
        source = getattr(module, "__file__", None)
    where = f"{source or target}:{attr}"
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ConfigError(f"{key}={spec!r}: {source or target} has no function {attr!r} "
                          f"(functions there: {', '.join(found) or 'none'})", key)
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {where} is a {type(fn).__name__}, not a function", key)
    return fn, source, where


class CustomReward:
    """A user function as a RewardFunction. `name` is the spec as written in the config (it is
    stamped on every record and named in every error); `version` hashes the function's file, so
    an edited reward file refuses a resume (sealrl.trainer.resume.position). A reward file's text
    is read once, here on the driver, and travels with the function: a scorer process, on this
    node or another (placement.scorers=ray), loads that text, whether or not the file is there."""

    def __init__(self, spec: str, key: str = "reward.fn") -> None:
        self._fn, self.source, where = load_function(spec, key)
        self.spec, self.name = spec, spec
        self.version = file_hash(self.source)
        self.text = Path(self.source).read_text() if is_file_spec(spec.rpartition(":")[0]) else None
        self.positional, self.keywords = _bind_plan(self._fn, where, key)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fn": None}   # a scorer process loads the function again

    def setup(self) -> None:
        if self._fn is not None:
            return
        target, _, attr = self.spec.rpartition(":")
        module = (import_source(self.text, self.source, USER_MODULE_PREFIX) if self.text is not None
                  else importlib.import_module(target))
        self._fn = getattr(module, attr)

    def __call__(self, sample: RewardSample) -> RawScore:
        self.setup()
        raw = self._fn(*(PARAMETERS[n](sample) for n in self.positional),
                       **{n: PARAMETERS[n](sample) for n in self.keywords})
        if not isinstance(raw, dict):
            return raw   # a number, or a non-score that check_raw names
        if "score" not in raw:
            raise ValueError(f"returned a dict without a 'score' key (keys {sorted(map(str, raw))})")
        if "total" in raw:
            raise ValueError("returned a dict with a 'total' key, which sealrl reserves; name it otherwise")
        return {"total": raw["score"], **{k: v for k, v in raw.items() if k != "score"}}
