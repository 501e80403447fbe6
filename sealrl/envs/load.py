"""Choosing an environment by config: a built-in name, `package.module:Class` or
`path/to/file.py:Class`. Errors name the key and the value."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from sealrl.envs.calc import CalcEnv
from sealrl.envs.guess import GuessEnv
from sealrl.plugins import import_file, import_source

BUILTIN = {"calc": CalcEnv, "guess": GuessEnv}


class EnvLoadError(ValueError):
    """env.name names nothing loadable."""


def env_class(name: str, source: str = "") -> type:
    """The class `name` names; a file env with `source` (its text, shipped from the driver) is
    built from that text, not from whatever file this process's node has at that path."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise EnvLoadError(f"env.name={name!r}: not a built-in ({', '.join(sorted(BUILTIN))}) "
                           "and not module:Class or file.py:Class")
    where, cls_name = name.rsplit(":", 1)
    if where.endswith(".py") and source:
        module = import_source(source, where, "sealrl_user_env_")
    elif where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise EnvLoadError(f"env.name={name!r}: no file {path}")
        module = import_file(path.resolve(), "sealrl_user_env_")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise EnvLoadError(f"env.name={name!r}: cannot import {where}: {e}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise EnvLoadError(f"env.name={name!r}: {where} has no {cls_name}")
    return cls


def resolved_name(name: str) -> str:
    """`name` with a file path made absolute against this process's working directory, so that
    a worker elsewhere (a Ray replica runs in its own folder) loads the same file; other names
    unchanged. Resolved once, on the driver."""
    where, sep, cls_name = name.rpartition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).resolve()}:{cls_name}"
    return name


def env_source(name: str) -> str:
    """The text of a file env's file (read once, on the driver, to ship to every worker); "" for
    built-in and module envs."""
    where, sep, _ = name.rpartition(":")
    return Path(where).read_text() if sep and where.endswith(".py") and Path(where).is_file() else ""


def make_env(name: str, tool_timeout_s: float = 2.0, source: str = ""):
    """A fresh environment; `tool_timeout_s` reaches classes whose constructor takes `timeout_s`;
    `source`: a file env's shipped text (env_class)."""
    cls = env_class(name, source)
    params = inspect.signature(cls).parameters
    env = cls(timeout_s=tool_timeout_s) if "timeout_s" in params else cls()
    for attr in ("name", "version", "stops", "reset", "step", "close"):
        if not hasattr(env, attr):
            raise EnvLoadError(f"env.name={name!r}: {cls.__name__} lacks {attr!r} (see sealrl/envs/base.py)")
    return env
