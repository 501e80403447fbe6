"""Inputs checked before a run creates anything, and the record of the rows it dropped.

`check_inputs(cfg)` runs the checks that cost no model load and no data pass: the rules across
config sections, the model folder (exists, holds config.json, a tokenizer and safetensors
weights) and the data files (exist, are files, readable, hold rows: a Parquet footer, or the
first non-blank byte of a JSONL file), and the reward (sealrl.rewards.from_config: a user's
reward file is loaded and its function's signature checked; nothing is scored). Each failure
is one ConfigError naming the config key. Row-level problems are found later, by the loader
(sealrl.data.dataset), and name file and row.

Relative paths (model.path, data.train_file, data.eval_file, run.output_dir, reward files and
reward.model_path) are resolved against the working directory of the process, not against the
config file's folder.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable

from sealrl.config import Config, ConfigError, check_config, relative_note
from sealrl.data.dataset import DataFileError, PromptSet, has_rows
from sealrl.models.precision import role_devices
from sealrl.rewards.from_config import build_reward

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_folder(path: str, key: str = "model.path") -> None:
    if not str(path).strip():
        raise ConfigError(f"{key} is empty: give a Hugging Face model folder (or leave the key out for the "
                          "embedded model)", key)
    folder = Path(path)
    if not folder.exists():
        raise ConfigError(f"{key}: {folder} does not exist{relative_note(folder)}", key)
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder (a Hugging Face model folder is expected)", key)
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}: {folder} is not a Hugging Face model folder (no config.json)", key)
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: {config} cannot be read as JSON ({e})", key) from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})", key)
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{key}: {folder} has no *.safetensors weights (only safetensors are loaded)", key)


def check_data_files(cfg: Config) -> None:
    if cfg.data.task != "file":
        return
    for key in ("train_file", "eval_file"):
        path = getattr(cfg.data, key)
        if not path:
            continue
        try:
            if not has_rows(path):
                raise ConfigError(f"data.{key}: {path} has no rows", f"data.{key}")
        except DataFileError as e:
            raise ConfigError(f"data.{key}: {e}", f"data.{key}") from None


def check_inputs(cfg: Config) -> None:
    """Every input that can be checked cheaply, before a run folder, lock or model exists.
    Raises ConfigError naming the config key and the problem."""
    check_config(cfg)
    role_devices(cfg)   # cuda asked for where torch sees none: named by its key
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir: {out} exists and is not a folder", "run.output_dir")
    if (out / cfg.run.name).exists() and not (out / cfg.run.name).is_dir():
        raise ConfigError(f"run.name: {out / cfg.run.name} exists and is not a folder", "run.name")
    check_model_folder(cfg.model.path)
    check_data_files(cfg)
    build_reward(cfg.reward, cfg.data.task)   # a user's reward file, function and signature; the RM folder


def write_dropped_rows(run_dir: str | Path, prompt_sets: Iterable[PromptSet]) -> int:
    """run_dir/dropped_rows.jsonl: one line per row dropped under data.on_bad_row=drop
    ({"file", "row", "field", "reason", "message"}), replaced whole (a resumed run drops the
    same rows). Nothing is written when no row was dropped. Returns the number of rows."""
    rows = [{"file": d.source, "row": d.row, "field": d.field, "reason": d.reason, "message": d.message}
            for ps in prompt_sets for d in ps.dropped_rows]
    if not rows:
        return 0
    path = Path(run_dir) / "dropped_rows.jsonl"
    reasons = Counter(r["reason"] for r in rows)
    print(f"sealrl: data.on_bad_row=drop skipped {len(rows)} rows ("
          f"{', '.join(f'{n} {reason}' for reason, n in reasons.most_common())}); each is listed in {path}",
          file=sys.stderr, flush=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(rows)
