"""From a YAML file and dotted overrides (`actor.lr=1e-5`) to a checked Config.

Two levels (`section.field`), and nested sections below them (`actor.lora.rank`). Unknown keys
are errors that suggest the closest valid key and name the YAML line or the override they came
from; rules across sections are check_config's, applied to a whole run.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from sealrl.config.rollout_backend import check_rollout_backend
from sealrl.config.sections import Config, ConfigError, _check, relative_note
from sealrl.seams import rollout as rollout_seam


def resumable_keys() -> frozenset[tuple[str, str]]:
    """(section, key) of every field declared `resumable` (may differ on resume)."""
    return frozenset((sec, f.name) for sec, cls in _section_types().items()
                     for f in fields(cls) if f.metadata.get("resumable"))


# Keys that were removed, and what replaced them (a config written for an older sealrl says why).
_FAST = "the fast path is the default now; run.exact=true selects the bitwise Hugging Face path"
REMOVED = {
    "actor.lean_forward": _FAST, "actor.share_prompts": _FAST, "actor.pack_sequences": _FAST,
    "actor.fused_adamw": _FAST, "critic.fused_adamw": _FAST,
    "actor.logit_chunk_keep": "the fast path keeps the logits; actor.logit_chunk_tokens > 0 recomputes them",
    "critic.gradient_checkpointing": "the critic follows actor.gradient_checkpointing",
    "critic.warmup_steps": "the critic follows actor.warmup_steps",
    "rollout.continuous_batching": "rows are always admitted as others finish when rollout.max_rows > 0",
    "rollout.vllm.max_num_seqs": "rollout.max_rows bounds vLLM's rows too",
    "run.progress": "the progress bar shows when stderr is a terminal",
    "eval.temperature": "pass@k samples at rollout.temperature",
    "data.num_eval": "a generated task makes eval.num held-out problems",
    **{f"critic.{key}": f"the critic follows actor.{key}"
       for key in ("weight_decay", "adam_eps", "dtype", "device", "lora")},
}


def _unknown(key: str, options: list[str]) -> ConfigError:
    if key in REMOVED:
        return ConfigError(f"config key {key} was removed: {REMOVED[key]}", key)
    return ConfigError(f"unknown config key {key}{_suggest(key.rpartition('.')[2], options)}", key)


def _section_types() -> dict[str, type]:
    return {f.name: get_type_hints(Config)[f.name] for f in fields(Config)}


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Turn a YAML value or a CLI string into the declared type, or say which key is wrong.
    CLI strings are parsed as YAML scalars except for str fields, which are taken verbatim."""
    if dataclasses.is_dataclass(typ):  # a nested section: a mapping of its fields
        return _build_nested(key, raw, typ)
    value = yaml.safe_load(raw) if isinstance(raw, str) and typ is not str else raw
    expected = getattr(typ, "__origin__", None) or typ
    if expected is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is tuple and isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, expected) or (expected in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{key} must be of type {expected.__name__}, got {raw!r}", key)
    return value


def _build_nested(key: str, raw: Any, cls: type) -> Any:
    """A nested section (`actor.lora`) from a mapping; a YAML list is a comma list."""
    hints = get_type_hints(cls)
    _check(isinstance(raw, dict), key, f"a mapping of {', '.join(hints)}", raw)
    for name in (n for n in raw if n not in hints):
        raise _unknown(f"{key}.{name}", list(hints))
    values = {n: _coerce(f"{key}.{n}", ",".join(map(str, v)) if isinstance(v, list) else v, hints[n])
              for n, v in raw.items()}
    try:
        return cls(**values)
    except ConfigError as e:  # LoraConfig's own check names `lora`: say whose
        raise ConfigError(f"{key}{str(e).removeprefix('lora')}", key) from None


def build_config(raw: dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Config from a nested dict (a parsed YAML file) and `section.key=value` overrides."""
    merged: dict[str, dict[str, Any]] = {}
    sections = _section_types()
    for sec, body in (raw or {}).items():
        if sec not in sections:
            raise ConfigError(f"unknown config section {sec!r}{_suggest(sec, list(sections))}", sec)
        if not isinstance(body, dict):
            raise ConfigError(f"config section {sec!r} must be a mapping, got {body!r}", sec)
        merged.setdefault(sec, {}).update(body)
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or "." not in key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        sec, _, name = key.partition(".")
        if sec not in sections:
            raise ConfigError(f"unknown config section {sec!r} in {item!r}{_suggest(sec, list(sections))}")
        name, _, leaf = name.partition(".")  # actor.lora.rank=16: a field of a nested section
        sub = merged.setdefault(sec, {})
        sub[name] = {**(sub[name] if isinstance(sub.get(name), dict) else {}), leaf: value} if leaf else value
    built = {}
    for sec, cls in sections.items():
        hints = get_type_hints(cls)
        kwargs = {}
        for name, value in merged.get(sec, {}).items():
            if name not in hints:
                if f"{sec}.{name}" in REMOVED:
                    raise _unknown(f"{sec}.{name}", [])
                all_keys = [f"{s}.{k}" for s, c in sections.items() for k in get_type_hints(c)]
                raise ConfigError(f"unknown config key {sec}.{name}{_suggest(f'{sec}.{name}', all_keys)}",
                                  f"{sec}.{name}")
            kwargs[name] = _coerce(f"{sec}.{name}", value, hints[name])
        try:
            built[sec] = cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), sec) from None
    return Config(**built)


def check_config(cfg: Config) -> None:
    """Rules across sections, checked for a whole run (load_config, trainer.inputs.check_inputs)
    rather than at construction: unit tests build configs for one role without a consistent run.
    What the rollout can do is not a rule here: the config selects a rollout client and its
    declared capabilities (seams/rollout.py) refuse what it cannot serve."""
    batch = cfg.data.prompts_per_iter * cfg.rollout.n
    for key, mini in (("actor.mini_batch_size", cfg.actor.mini_batch_size),
                      ("critic.mini_batch_size", max(0, cfg.critic.mini_batch_size))):
        if mini and batch % mini:
            raise ConfigError(f"{key}={mini} must divide the batch data.prompts_per_iter * "
                              f"rollout.n = {cfg.data.prompts_per_iter} * {cfg.rollout.n} = {batch}", key)
    a = cfg.algorithm
    if a.old_log_prob == "bypass" and cfg.rollout.dtype != cfg.actor.dtype and not a.mismatch_tol:
        raise ConfigError(f"algorithm.old_log_prob=bypass with rollout.dtype={cfg.rollout.dtype} and actor.dtype="
                          f"{cfg.actor.dtype}: the rollout's log-probs become the PPO anchor although they come from "
                          "another precision; set algorithm.mismatch_tol (e.g. 0.25) to bound the gap, or use "
                          "old_log_prob=recompute", "algorithm.mismatch_tol")
    if cfg.algorithm.name == "optimal_token_baseline" and cfg.env.name != "none":
        raise ConfigError("algorithm.name=optimal_token_baseline with a multi-turn environment (env.name) is not "
                          "built: its per-token baseline aligns rows by index, and observation tokens leave holes "
                          "in the policy mask (docs/from-verl.md)", "algorithm.name")
    if (cfg.algorithm.name == "grpo_passk" or cfg.algorithm.dynamic_sampling) and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.name=grpo_passk and algorithm.dynamic_sampling need rollout.n >= 2 "
                          f"(a group of one has no runner-up and no variance), got {cfg.rollout.n}", "rollout.n")
    if cfg.rollout.max_staleness and cfg.algorithm.old_log_prob != "recompute":   # trainer/pipeline.py
        raise ConfigError("rollout.max_staleness > 0 needs algorithm.old_log_prob=recompute: the trust-region "
                          "anchor must be the actor consuming the samples, not the stale sampler",
                          "algorithm.old_log_prob")
    if cfg.rollout.max_staleness and cfg.algorithm.correction not in ("token_is", "seq_is"):
        raise ConfigError("rollout.max_staleness > 0 needs algorithm.correction=token_is or seq_is: the truncated "
                          "importance weights behaviour -> proximal of the decoupled PPO objective "
                          "(algos/decoupled.py)", "algorithm.correction")
    if cfg.rollout.partial == "switch" and not cfg.rollout.max_staleness:   # rollout/switching.py, docs/async.md
        raise ConfigError("rollout.partial=switch needs rollout.max_staleness >= 1 (at 0 nothing is published while "
                          "generating)", "rollout.partial")
    if cfg.reward.stream and not cfg.reward.num_scorers:   # trainer/variants/streaming.py
        raise ConfigError("reward.stream needs reward.num_scorers >= 1 (inline scoring would run between decode "
                          f"steps: nothing overlaps), got {cfg.reward.num_scorers}", "reward.stream")
    if cfg.reward.stream and cfg.placement.scorers == "ray":
        raise ConfigError("reward.stream is not built for placement.scorers=ray (the samples would have to reach "
                          "the scorers' node one by one); set placement.scorers=driver or reward.stream=false",
                          "reward.stream")
    for key, reason in rollout_seam.refusals(cfg):   # what the selected rollout client cannot do
        raise ConfigError(reason, key)
    check_rollout_backend(cfg)   # rollout.backend=vllm: its sampling filters, and installed (config/rollout_backend.py)


def _yaml_error(path: str, e: yaml.YAMLError) -> ConfigError:
    """PyYAML's message on one line, keeping its line and column (1-based)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}")
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    context = f" ({e.context} from line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
    return ConfigError(f"config file {path} is not valid YAML at {where}: {e.problem or e.context}{context}")


def _key_lines(node, path: str, prefix: str = "", lines: dict | None = None) -> dict[str, int]:
    """The line of every key (`section`, `section.field`, ...); a key given twice in one
    mapping is refused, since YAML would silently keep the last."""
    lines = {} if lines is None else lines
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name = f"{prefix}{k.value}" if isinstance(k, yaml.ScalarNode) else None
            if name is not None and k.tag != "tag:yaml.org,2002:merge":
                if name in seen:
                    raise ConfigError(f"config file {path}, line {k.start_mark.line + 1}: duplicate key "
                                      f"{name} (first at line {seen[name]})", name)
                seen[name] = lines[name] = k.start_mark.line + 1
            _key_lines(v, path, f"{name}." if name else prefix, lines)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            _key_lines(v, path, prefix, lines)
    return lines


def _read_yaml(path: str) -> tuple[Any, dict[str, int]]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist{relative_note(path)}")
    if not p.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines = _key_lines(node, path)
        return (loader.construct_document(node) if node is not None else None), lines
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from None
    finally:
        loader.dispose()


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = (), check_run: bool = True) -> Config:
    """Config from a YAML file and overrides; with check_run, also the rules across sections a
    new run must meet (check_config; off to read a config that an earlier run recorded).
    An error about a value names where it came from: the file and line, or the override."""
    raw, lines = ({}, {})
    if path:
        raw, lines = _read_yaml(path)
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    try:
        cfg = build_config(raw, overrides)
        if check_run:
            check_config(cfg)
        return cfg
    except ConfigError as e:
        given = [o for o in overrides if e.key and (o.partition("=")[0] + ".").startswith(e.key + ".")]
        if given:
            raise ConfigError(f"{e} (from the override {given[-1]})", e.key) from None
        if path and e.key in lines:
            raise ConfigError(f"config file {path}, line {lines[e.key]}: {e}", e.key) from None
        if path:
            raise ConfigError(f"config file {path}: {e}", e.key) from None
        raise


def config_diff(old: dict, new: dict) -> list[str]:
    """Lines `section.key: old -> new` for every changed value."""
    out = []
    for sec in sorted(set(old) | set(new)):
        a, b = old.get(sec, {}), new.get(sec, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{sec}.{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return out


def replace(cfg: Config, **sections: dict) -> Config:
    """A copy with some fields changed, e.g. replace(cfg, run={'iterations': 3})."""
    return Config(**{f.name: dataclasses.replace(getattr(cfg, f.name), **sections.get(f.name, {}))
                     for f in fields(cfg)})
