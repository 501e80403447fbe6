"""User code a config names: `package.module:name` or `path/to/file.py:name` (reward functions,
reward.fn; environments, env.name). This module finds the module; what may be taken from it,
and the errors that name the config key, are each caller's."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def is_file_spec(target: str) -> bool:
    """Whether the part before the colon is a file path rather than a dotted module name."""
    return target.endswith(".py") or "/" in target or "\\" in target


def file_hash(path: str | None) -> str:
    """The first 12 hex digits of the file's SHA-256 ("unversioned" when there is no file)."""
    if not path or not Path(path).is_file():
        return "unversioned"
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module of a .py file, loaded once per process and file content (an edited file loads
    anew) under `prefix` + a digest of its path and bytes; a file that fails to load leaves no
    half-made module behind."""
    name = prefix + hashlib.sha256(f"{path}:{file_hash(str(path))}".encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_source(source: str, path: str, prefix: str) -> ModuleType:
    """The module of a file's `source` text, read elsewhere (on the driver) and shipped here:
    loaded once per process and text under `prefix` + a digest of path and text, its code
    compiled under `path` so tracebacks name the user's file, whether or not it exists here."""
    name = prefix + hashlib.sha256(f"{path}:{source}".encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module = ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    try:
        exec(compile(source, path, "exec"), module.__dict__)   # noqa: S102 - the user's own env, as import would
    except BaseException:
        del sys.modules[name]
        raise
    return module

