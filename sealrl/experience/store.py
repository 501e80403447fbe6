"""Parquet store of sealed experience: one file per iteration, one row per sample.

Each row answers, for one response: its ids, prompt and response tokens and text, the sampling
contract and the policy version that sampled it, the stop reason, every log-prob field with its
producer and version, the reward record and the derived tensors. Field provenance and the seal
digest live in the file's schema metadata, and `read_iteration` rebuilds an ExperienceBatch
whose digest must equal the stored one. A file is written once, when the batch is sealed and
before any update reads it; which optimizer step then consumed it is an event of its own, one
line per iteration in `consumed.jsonl` next to the files (`append_consumed`, `read_consumed`).

Imported on its own (`sealrl.experience.store`) so that `import sealrl.experience` needs no
pyarrow.
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sealrl.experience.batch import ExperienceBatch, SampleMeta, Versioned, pad_token_rows
from sealrl.experience.episode import EpisodeRecord
from sealrl.experience.fields import FIELDS, Align
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import RewardRecord, Role, SamplingContract, StopReason

_META_KEY = b"sealrl"
_TORCH_TO_ARROW = {torch.float32: pa.float32(), torch.bool: pa.bool_(), torch.int32: pa.int32()}


def iteration_path(folder: str | os.PathLike, iteration: int) -> Path:
    return Path(folder) / f"iter_{iteration:06d}.parquet"


def to_table(batch: ExperienceBatch, extra: dict[str, list] | None = None) -> pa.Table:
    """One row per sample; `extra` columns are stored as `extra.<name>`."""
    if not batch.sealed:
        raise ValueError(f"iteration {batch.iteration}: only sealed experience is stored")
    batch.verify_seal()
    s = batch.samples
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([x.sample_id for x in s], pa.string()),
        "group_id": pa.array([x.group_id for x in s], pa.string()),
        "prompt_id": pa.array([x.prompt_id for x in s], pa.string()),
        "iteration": pa.array([batch.iteration] * len(s), pa.int64()),
        "policy_version": pa.array([x.policy_version for x in s], pa.string()),
        "seed": pa.array([x.seed for x in s], pa.int64()),
        "stop_reason": pa.array([x.stop_reason.value for x in s], pa.string()),
        "prompt_ids": pa.array([list(x.prompt_ids) for x in s], pa.list_(pa.int32())),
        "response_ids": pa.array([list(x.response_ids) for x in s], pa.list_(pa.int32())),
        "prompt_text": pa.array([x.prompt_text for x in s], pa.string()),
        "response_text": pa.array([x.response_text for x in s], pa.string()),
        "data_source": pa.array([x.data_source for x in s], pa.string()),
        "ground_truth": pa.array([x.ground_truth for x in s], pa.string()),
        "sampling": pa.array([batch.contract.to_json()] * len(s), pa.string()),
    }
    # token fields: each row's first len(response) values, as one flat array with row offsets
    mask = batch.token_mask()
    offsets = pa.array([0, *itertools.accumulate(len(x.response_ids) for x in s)], pa.int32())
    order = list(FIELDS)   # the registry's order, not the order the roles wrote them in
    for name in sorted(batch.field_names(), key=order.index):
        spec, value = FIELDS[name], batch.get(name)
        if name == "reward_records":
            cols.update(_reward_columns(value))
        elif name == "episodes":
            cols[name] = pa.array([e.to_json() for e in value], pa.string())
        elif spec.align is Align.TOKEN:
            flat = pa.array(value.detach().cpu()[mask].numpy(), _TORCH_TO_ARROW[spec.dtype])
            cols[name] = pa.ListArray.from_arrays(offsets, flat)
        else:
            cols[name] = pa.array(value.tolist(), _TORCH_TO_ARROW[spec.dtype])
    for name, values in (extra or {}).items():
        cols[f"extra.{name}"] = pa.array(values)
    meta = {
        "run_id": batch.run_id, "iteration": batch.iteration,
        "num_response_tokens": batch.num_response_tokens, "seal_digest": batch.seal_digest,
        "versions": {k: v.to_json() for k, v in batch.versions.items()},
        "fields": {n: {"producer": batch.provenance(n)[0].value, "version": batch.provenance(n)[1]}
                   for n in batch.field_names()},
        **({"row_digests": batch.row_digests()} if batch.sealed else {}),
    }
    table = pa.table(cols)
    return table.replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})


def _reward_columns(records: list[RewardRecord]) -> dict[str, pa.Array]:
    return {
        "reward_status": pa.array([r.status.value for r in records], pa.string()),
        "reward_total": pa.array([r.total for r in records], pa.float64()),
        "reward_components": pa.array([json.dumps(r.components, sort_keys=True) for r in records]),
        "reward_scorer": pa.array([r.scorer for r in records], pa.string()),
        "reward_scorer_version": pa.array([r.scorer_version for r in records], pa.string()),
        "reward_message": pa.array([r.message for r in records], pa.string()),
    }


def write_iteration(folder: str | os.PathLike, batch: ExperienceBatch, extra: dict[str, list] | None = None) -> Path:
    """Write atomically: a temporary file, fsync, then rename over the final name. When this
    returns, the sealed batch is durable."""
    path = iteration_path(folder, batch.iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(to_table(batch, extra), tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


CONSUMED = "consumed.jsonl"


def append_consumed(folder: str | os.PathLike, iteration: int, consumed_step: int, sampled_by: str,
                    committed: str, seal_digest: str = "") -> None:
    """Record that the optimizer, at step `consumed_step` (the committed version `committed`),
    has consumed iteration `iteration`'s sealed batch (`seal_digest`), which `sampled_by`
    generated. The digest is committed again by the next checkpoint (the audit's chain check)."""
    line = json.dumps({"iteration": iteration, "consumed_step": consumed_step, "sampled_by": sampled_by,
                       "committed": committed, "seal_digest": seal_digest})
    with open(Path(folder) / CONSUMED, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_consumed(folder: str | os.PathLike) -> tuple[dict[int, list[dict]], list[str]]:
    """Consumption lines by iteration (a list: an iteration consumed twice is for the audit to
    see), and the lines that could not be read, named."""
    path = Path(folder) / CONSUMED
    by_iteration: dict[int, list[dict]] = {}
    errors: list[str] = []
    if not path.is_file():
        return by_iteration, errors
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_iteration.setdefault(int(row["iteration"]), []).append(row)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            errors.append(f"{CONSUMED} line {n}: {type(e).__name__}: {e}")
    return by_iteration, errors


def read_table(path: str | os.PathLike) -> tuple[pa.Table, dict]:
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(_META_KEY)
    if raw is None:
        raise ValueError(f"{path}: not a sealrl experience file (no '{_META_KEY.decode()}' metadata)")
    return table, json.loads(raw)


def read_iteration(path: str | os.PathLike, verify: bool = True) -> ExperienceBatch:
    """Rebuild the sealed batch; raises if the rebuilt facts do not match the stored digest
    (`verify=False`: not checked, for an audit naming what changed: changed_cells)."""
    table, meta = read_table(path)
    c = table.to_pydict()
    versions = [PolicyVersion.from_json(v) for v in meta["versions"].values()]
    samples = [
        SampleMeta(sample_id=c["sample_id"][i], group_id=c["group_id"][i], prompt_id=c["prompt_id"][i],
                   prompt_ids=tuple(c["prompt_ids"][i]), response_ids=tuple(c["response_ids"][i]),
                   stop_reason=StopReason(c["stop_reason"][i]), policy_version=c["policy_version"][i],
                   seed=c["seed"][i], prompt_text=c["prompt_text"][i], response_text=c["response_text"][i],
                   data_source=c["data_source"][i], ground_truth=c["ground_truth"][i])
        for i in range(table.num_rows)
    ]
    contract = SamplingContract.from_json(c["sampling"][0]) if table.num_rows else SamplingContract()
    batch = ExperienceBatch(meta["run_id"], meta["iteration"], samples, contract, versions)
    batch.num_response_tokens = meta["num_response_tokens"]
    for name, prov in meta["fields"].items():
        spec = FIELDS[name]
        if name == "reward_records":
            value = [RewardRecord(status=c["reward_status"][i], total=c["reward_total"][i],
                                  components=json.loads(c["reward_components"][i]),
                                  scorer=c["reward_scorer"][i], scorer_version=c["reward_scorer_version"][i],
                                  message=c["reward_message"][i]) for i in range(table.num_rows)]
        elif name == "episodes":
            value = [EpisodeRecord.from_json(t) for t in c[name]]
        elif spec.align is Align.TOKEN:
            value = pad_token_rows(c[name], batch.num_response_tokens, spec.dtype)
        else:
            value = torch.tensor(c[name], dtype=spec.dtype)
        batch._fields[name] = Versioned(value, Role(prov["producer"]), prov["version"])
    if meta["seal_digest"] is not None:
        batch._seal_digest = meta["seal_digest"]
        if verify:
            batch.verify_seal()
    return batch


def changed_cells(path: str | os.PathLike, limit: int = 5) -> list[str]:
    """Which rows and fields of a file no longer match the per-row digests stored with its seal:
    "row 3 (sample r/1/p2/1): response_ids", rows moved ("row 0 holds what row 5 held"), rows
    added or removed. Empty when the file stores no row digests (written before they existed)."""
    _, meta = read_table(path)
    stored = meta.get("row_digests")
    if not stored:
        return []
    batch = read_iteration(path, verify=False)   # read once: its digests and its ids
    now, ids = batch.row_digests(), batch.sample_ids
    if len(now["sample"]) != len(stored["sample"]):
        return [f"{len(now['sample'])} rows where {len(stored['sample'])} were sealed"]
    where = {d: i for i, d in enumerate(stored["sample"])}
    moved = [f"row {i} (sample {ids[i]}) holds what row {where[d]} held"
             for i, d in enumerate(now["sample"]) if where.get(d, i) != i]
    if moved:
        return moved[:limit] + ([f"... {len(moved) - limit} more rows moved"] if len(moved) > limit else [])
    cells = [f"row {i} (sample {ids[i]}): {name}" for name in sorted(set(stored) | set(now))
             for i in range(len(ids)) if stored.get(name, [None] * len(ids))[i] != now.get(name, [None] * len(ids))[i]]
    return cells[:limit] + ([f"... {len(cells) - limit} more cells"] if len(cells) > limit else [])

