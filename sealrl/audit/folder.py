"""A run folder as the audit reads it: the effective config, every experience file (columns and
schema metadata, read raw so that a broken file is a finding, not a crash) and the ledger."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sealrl.config import Config, MissingInputError, load_config
from sealrl.experience.store import read_consumed, read_table

_ITER_FILE = re.compile(r"iter_(\d+)\.parquet")
# what every check may index without asking: the store writes them for every sample (and the
# loader adds `consumed_step` from consumed.jsonl)
REQUIRED_COLUMNS = ("sample_id", "group_id", "prompt_id", "iteration", "policy_version", "prompt_ids",
                    "response_ids", "sampling")


@dataclass(slots=True)
class IterationFile:
    path: Path
    iteration: int                   # from the file name
    meta: dict = field(default_factory=dict)     # the `sealrl` schema metadata
    cols: dict[str, list] = field(default_factory=dict)
    num_rows: int = 0
    error: str = ""                  # why the file could not be read at all
    groups: dict[str, list[int]] = field(default_factory=dict)   # group_id -> row indices
    consumed: list[dict] = field(default_factory=list)           # its lines of consumed.jsonl

    @property
    def readable(self) -> bool:
        return not self.error

    def one(self, column: str):
        """The single value of a column that must be constant within the file, else None."""
        values = set(self.cols.get(column, ()))
        return values.pop() if len(values) == 1 else None


@dataclass(slots=True)
class RunFolder:
    path: Path
    cfg: Config
    run_id: str
    config_hash_line: str            # the hash written on the first line of config.yaml
    config_hash: str                 # the hash of config.yaml's content, as Config.hash() computes it
    run_meta: dict                   # run.json ({} when absent)
    files: list[IterationFile]       # sorted by iteration
    ledger: list[dict]
    ledger_errors: list[str]         # missing file, unparseable lines
    consumed: dict[int, list[dict]] = field(default_factory=dict)   # experience/consumed.jsonl by iteration
    consumed_errors: list[str] = field(default_factory=list)        # its unparseable lines
    # Iterations sealed but not yet consumed when the run stopped (a crash or a kill during their
    # update, or generated ahead by an asynchronous lane): at or past the latest checkpoint, with
    # nothing after them consumed. No checkpoint commits them; resume=auto redoes them.
    in_flight: list[int] = field(default_factory=list)

    def file(self, iteration: int) -> IterationFile | None:
        return next((f for f in self.files if f.iteration == iteration), None)

    @property
    def readable(self) -> list[IterationFile]:
        return [f for f in self.files if f.readable]


def load_run(run_dir: str | Path) -> RunFolder:
    path = Path(run_dir)
    if not path.is_dir():
        raise MissingInputError(f"run folder {path} does not exist")
    config = path / "config.yaml"
    if not config.is_file():
        raise MissingInputError(f"{path} is not a run folder: no config.yaml")
    text = config.read_text()
    cfg = load_config(str(config), check_run=False)
    first = text.splitlines()[0] if text else ""
    hash_line = first.split(":", 1)[1].strip() if first.startswith("# config hash:") else ""
    # Config.hash() of the dict as written; not of the config rebuilt by today's code, whose new
    # keys (with defaults) would change the hash of an older, untouched run.
    content_hash = hashlib.sha256(json.dumps(yaml.safe_load(text), sort_keys=True).encode()).hexdigest()[:16]
    files = [_read_file(p) for p in sorted((path / "experience").glob("iter_*.parquet"))
             if _ITER_FILE.fullmatch(p.name)]
    files.sort(key=lambda f: f.iteration)
    consumed, consumed_errors = read_consumed(path / "experience")
    for f in files:
        _attach_consumption(f, consumed.get(f.iteration, []))
    ledger, errors = _read_ledger(path / "ledger.jsonl")
    meta = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
    return RunFolder(path, cfg, cfg.run.name, hash_line, content_hash, meta, files, ledger, errors,
                     consumed, consumed_errors, _in_flight(path, files, consumed))


def _in_flight(path: Path, files: list[IterationFile], consumed: dict[int, list[dict]]) -> list[int]:
    pointer = path / "checkpoints" / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else ""
    committed = int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else 0
    last_consumed = max(consumed, default=-1)
    return [f.iteration for f in files if f.iteration >= committed and f.iteration > last_consumed]


def _attach_consumption(f: IterationFile, lines: list[dict]) -> None:
    """`consumed_step` as a column of the file's rows, from its one consumption line (None when
    there is not exactly one; check_used_once names why). Runs from before consumed.jsonl
    stored the column in the file itself."""
    f.consumed = lines
    if f.readable and "consumed_step" not in f.cols:
        step = lines[0].get("consumed_step") if len(lines) == 1 else None
        f.cols["consumed_step"] = [step] * f.num_rows


def _read_file(path: Path) -> IterationFile:
    f = IterationFile(path, int(_ITER_FILE.fullmatch(path.name).group(1)))
    try:
        table, f.meta = read_table(path)
    except Exception as e:  # a truncated or foreign file is a finding of the seal check
        f.error = f"cannot read {path.name}: {type(e).__name__}: {e}"
        return f
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        f.error = f"{path.name} lacks the identity columns {missing}"
        return f
    f.cols, f.num_rows = table.to_pydict(), table.num_rows
    for i, g in enumerate(f.cols.get("group_id", ())):
        f.groups.setdefault(g, []).append(i)
    return f


def _read_ledger(path: Path) -> tuple[list[dict], list[str]]:
    if not path.is_file():
        return [], [f"no {path.name}: the outcome of the sampled prompts is not recorded"]
    rows, errors = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"{path.name} line {n} is not JSON: {e}")
            continue
        missing = [k for k in ("iteration", "group_id", "prompt_id", "status") if k not in row]
        if missing:
            errors.append(f"{path.name} line {n} lacks {missing}")
            continue
        rows.append(row)
    return rows, errors
