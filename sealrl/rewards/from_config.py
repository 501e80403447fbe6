"""The scorer a run's `reward` section names (docs/rewards.md): a built-in, a user function, a
weighted combination (`reward.components`), each optionally routed by data source (`reward.route`).

    reward.fn          one scorer: a name of config.REWARD_BUILTINS, package.module:function, or
                       path/file.py:function (relative to the working directory)
    reward.components  [{fn, weight, name?}, ...]: total = sum of weight * component value; each
                       component's value is kept in the record under its name (WeightedReward)
    reward.route       {data_source: fn}: samples of that data source are scored by that fn alone;
                       every other sample by reward.fn (or the components)

`build_reward` checks everything it can without scoring (files, functions, signatures, weights,
names, the reward model folder) and raises ConfigError naming the key; it is called by
sealrl.trainer.inputs before a run folder exists, so a bad reward stops a run before training.
"""
from __future__ import annotations

import math
from pathlib import Path

from sealrl.config import REWARD_BUILTINS, ConfigError, RewardConfig, relative_note
from sealrl.rewards.base import RewardFunction, RewardSample, call_checked

COMPONENT_KEYS = ("fn", "weight", "name")
TASK_VERIFIER = {"arith": "arith", "countdown": "countdown", "file": "math",   # what fn=auto means
                 "mul3": "tool_answer", "guess": "guess"}


def _builtin(name: str, cfg: RewardConfig, task: str, key: str) -> RewardFunction:
    from sealrl.rewards import verifiers
    name = TASK_VERIFIER[task] if name == "auto" else name
    if name == "arith":
        return verifiers.ArithmeticExactMatch()
    if name == "countdown":
        return verifiers.CountdownVerifier()
    if name == "math":
        return verifiers.MathVerifier()
    if name in ("tool_answer", "guess"):   # the multi-turn tasks' outcome verifiers
        from sealrl.rewards import episodes
        return episodes.ToolAnswerMatch() if name == "tool_answer" else episodes.GuessVerifier()
    if name == "format":
        if not cfg.format_pattern:
            raise ConfigError(f"{key}=format needs reward.format_pattern (the regex a well-formed answer matches)",
                              "reward.format_pattern")
        try:
            return verifiers.FormatReward(cfg.format_pattern)
        except Exception as e:   # re.error
            raise ConfigError(f"reward.format_pattern {cfg.format_pattern!r} is not a regex: {e}",
                              "reward.format_pattern") from None
    if name == "code_exec":
        from sealrl.rewards.code import CodeExecutionReward
        return CodeExecutionReward(timeout_s=cfg.sandbox_wall_s, cpu_s=cfg.sandbox_cpu_s,
                                   memory_mb=cfg.sandbox_memory_mb, max_processes=cfg.sandbox_max_processes)
    assert name == "reward_model", name
    return _reward_model(cfg, key)


def _reward_model(cfg: RewardConfig, key: str) -> RewardFunction:
    from sealrl.rewards.reward_model import RewardModelScorer
    if not cfg.model_path:
        raise ConfigError(f"{key}=reward_model needs reward.model_path (a Hugging Face sequence-classifier "
                          "folder)", "reward.model_path")
    folder = Path(cfg.model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"reward.model_path: {folder} is not a Hugging Face model folder (no config.json)"
                          f"{relative_note(folder)}", "reward.model_path")
    return RewardModelScorer(folder.resolve())


def scorer(spec: object, cfg: RewardConfig, task: str, key: str) -> RewardFunction:
    """One scorer from a `fn` value: a built-in name or a user function."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{key} must be a non-empty string, got {spec!r}", key)
    if spec in REWARD_BUILTINS:
        return _builtin(spec, cfg, task, key)
    if ":" not in spec:
        raise ConfigError(f"{key} must be {' | '.join(REWARD_BUILTINS)}, package.module:function or "
                          f"path/file.py:function, got {spec!r}", key)
    from sealrl.rewards.custom import CustomReward
    return CustomReward(spec, key)


def component_name(spec: str, task: str) -> str:
    """A component's default name: the built-in's name (auto: the task's verifier), else the
    function's name."""
    if spec == "auto":
        return TASK_VERIFIER[task]
    return spec.rpartition(":")[2] if ":" in spec else spec


def components(cfg: RewardConfig, task: str) -> list[tuple[str, str, float]]:
    """(name, fn spec, weight) of every `reward.components` entry, checked; names are unique."""
    if not isinstance(cfg.components, list):
        raise ConfigError(f"reward.components must be a list of {{fn, weight, name}}, got {cfg.components!r}",
                          "reward.components")
    if cfg.components and cfg.fn != "auto":
        raise ConfigError(f"reward.fn={cfg.fn!r} and reward.components are exclusive: list that fn as a "
                          "component instead", "reward.components")
    out = []
    for i, c in enumerate(cfg.components):
        key = f"reward.components[{i}]"
        if not isinstance(c, dict) or "fn" not in c or set(c) - set(COMPONENT_KEYS):
            raise ConfigError(f"{key} must be a mapping with keys fn, weight (default 1.0) and an optional "
                              f"name, got {c!r}", "reward.components")
        weight = c.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{key}.weight must be a finite number, got {weight!r}", "reward.components")
        name = c.get("name") or component_name(str(c["fn"]), task)
        if not isinstance(name, str) or name == "total" or name in [n for n, _, _ in out]:
            raise ConfigError(f"{key}.name {name!r} must be a string other than 'total', unique among the "
                              "components (set name: to tell two apart)", "reward.components")
        out.append((name, c["fn"], float(weight)))
    return out


def build_reward(cfg: RewardConfig, task: str) -> RewardFunction:
    """The run's scorer (module doc); ConfigError naming the key for anything wrong."""
    from sealrl.rewards.verifiers import WeightedReward
    parts = components(cfg, task)
    if parts:
        main = WeightedReward({name: (scorer(spec, cfg, task, f"reward.components[{i}].fn"), weight)
                               for i, (name, spec, weight) in enumerate(parts)})
    else:
        main = scorer(cfg.fn, cfg, task, "reward.fn")
    if not isinstance(cfg.route, dict):
        raise ConfigError(f"reward.route must map data_source -> fn, got {cfg.route!r}", "reward.route")
    if not cfg.route:
        return main
    return RoutedReward({str(source): scorer(spec, cfg, task, f"reward.route.{source}")
                         for source, spec in cfg.route.items()}, main)


class RoutedReward:
    """Scores each sample with the scorer of its data source, else with `default`. The record's
    components are the chosen scorer's (its name when it has none), so one can tell which ran."""

    name = "route"

    def __init__(self, routes: dict[str, RewardFunction], default: RewardFunction) -> None:
        self.routes, self.default = dict(routes), default
        self.version = ";".join(f"{source}={fn.name}@{fn.version}" for source, fn in sorted(self.routes.items())) \
            + f";*={default.name}@{default.version}"

    def setup(self) -> None:
        for fn in (*self.routes.values(), self.default):
            setup = getattr(fn, "setup", None)   # optional hook (RewardFunction docstring)
            if setup is not None:
                setup()

    def __call__(self, sample: RewardSample) -> dict[str, float]:
        fn = self.routes.get(sample.data_source, self.default)
        total, parts = call_checked(fn, sample, f"data_source {sample.data_source!r} -> {fn.name}")
        return {"total": total, **(parts or {fn.name: total})}
