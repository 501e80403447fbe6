"""ExperienceBatch: the only currency between roles (DESIGN section 3).

A batch holds B samples. Identity and tokens are fixed at construction from the rollout; every
other field is declared in `fields.FIELDS` and carries the role and model version that produced
it. Facts are write-once; `seal()` freezes them and records a digest, so any later change to a
fact is detectable (`verify_seal`). Reading a field checks its producer and version, so writing
`ref` into the `old` slot, or consuming log-probs of another policy version, fails before the
loss with an error that names the field.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sealrl.experience.episode import EpisodeRecord
from sealrl.experience.fields import FIELDS, Align, FieldSpec, Kind
from sealrl.experience.ids import PolicyVersion
from sealrl.experience.records import Role, SamplingContract, StopReason


class ExperienceError(ValueError):
    """A field was written, read or versioned against the contract."""


@dataclass(frozen=True, slots=True)
class Versioned:
    value: Any
    producer: Role
    version: str


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """Per-sample facts fixed at construction (from the rollout and the dataset)."""

    sample_id: str
    group_id: str
    prompt_id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    stop_reason: StopReason
    policy_version: str     # PolicyVersion.id of the weights that sampled it
    seed: int
    prompt_text: str = ""
    response_text: str = ""
    data_source: str = ""
    ground_truth: str = ""   # JSON text


class ExperienceBatch:
    def __init__(self, run_id: str, iteration: int, samples: Sequence[SampleMeta],
                 contract: SamplingContract, versions: Sequence[PolicyVersion]):
        ids = [s.sample_id for s in samples]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ExperienceError(f"duplicate sample id {dup!r} in one batch")
        self.run_id = run_id
        self.iteration = iteration
        self.samples: tuple[SampleMeta, ...] = tuple(samples)
        self.contract = contract
        self.versions: dict[str, PolicyVersion] = {v.id: v for v in versions}
        for s in self.samples:
            if s.policy_version not in self.versions:
                raise ExperienceError(f"sample {s.sample_id}: policy version {s.policy_version} "
                                      "is not among the batch's declared versions")
        self.num_response_tokens = max((len(s.response_ids) for s in self.samples), default=0)
        self._fields: dict[str, Versioned] = {}
        self._seal_digest: str | None = None

    # ---- shape -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.samples)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]

    @property
    def group_ids(self) -> list[str]:
        return [s.group_id for s in self.samples]

    @property
    def sealed(self) -> bool:
        return self._seal_digest is not None

    @property
    def seal_digest(self) -> str | None:
        return self._seal_digest

    # ---- write / read ------------------------------------------------------------------
    def put(self, name: str, value: Any, producer: Role, version: str) -> None:
        """Write a field once. Checks that it is declared, that `producer` may write it, and
        its dtype and shape."""
        spec = _spec_of(name)
        if Role(producer) not in spec.producers:
            raise ExperienceError(f"field {name!r} is produced by "
                                  f"{'/'.join(r.value for r in spec.producers)}, not {Role(producer).value}")
        if name in self._fields:
            raise ExperienceError(f"field {name!r} is already written (by {self._fields[name].producer.value} "
                                  f"version {self._fields[name].version}); facts are write-once")
        if self.sealed and spec.kind is Kind.FACT:
            raise ExperienceError(f"field {name!r} is a fact and the batch is sealed")
        self._check_value(spec, value)
        self._fields[name] = Versioned(value, Role(producer), str(version))

    def get(self, name: str, version: str | None = None, producer: Role | None = None) -> Any:
        """Read a field; with `version` (or `producer`) given, refuse any other."""
        spec = _spec_of(name)
        if name not in self._fields:
            want = f" of version {version}" if version else ""
            raise ExperienceError(f"field {name!r}{want} is absent (declared: {spec.doc})")
        item = self._fields[name]
        if version is not None and item.version != str(version):
            raise ExperienceError(f"field {name!r}: expected version {version}, found {item.version} "
                                  f"(produced by {item.producer.value})")
        if producer is not None and item.producer is not Role(producer):
            raise ExperienceError(f"field {name!r}: expected producer {Role(producer).value}, "
                                  f"found {item.producer.value}")
        return item.value

    def has(self, name: str) -> bool:
        return name in self._fields

    def provenance(self, name: str) -> tuple[Role, str]:
        item = self._fields[name]
        return item.producer, item.version

    def field_names(self) -> list[str]:
        return list(self._fields)

    # ---- sealing -----------------------------------------------------------------------
    def seal(self, required: Sequence[str] = ("response_mask", "rollout_log_probs")) -> str:
        """Freeze the facts: every required fact must be present; returns the digest."""
        missing = [n for n in required if n not in self._fields]
        if missing:
            raise ExperienceError(f"cannot seal iteration {self.iteration}: missing facts {missing}")
        self._seal_digest = self._digest()
        return self._seal_digest

    def verify_seal(self) -> None:
        if not self.sealed:
            raise ExperienceError("batch is not sealed")
        now = self._digest()
        if now != self._seal_digest:
            raise ExperienceError(f"sealed facts of iteration {self.iteration} changed after sealing "
                                  f"(digest {self._seal_digest} -> {now})")

    def _digest(self) -> str:
        h = hashlib.sha256()
        h.update(repr((self.run_id, self.iteration, self.contract.to_json())).encode())
        for s in self.samples:
            h.update(repr(s).encode())
        for name in sorted(self._fields):
            item = self._fields[name]
            if FIELDS[name].kind is not Kind.FACT:
                continue
            h.update(f"{name}|{item.producer.value}|{item.version}".encode())
            if isinstance(item.value, torch.Tensor):
                h.update(item.value.detach().cpu().contiguous().numpy().tobytes())
            else:
                h.update(repr([_record_key(v) for v in item.value]).encode())
        return h.hexdigest()

    def row_digests(self) -> dict[str, list[str]]:
        """Per row, a short digest of its sample identity ("sample") and of each fact: stored
        beside the seal so that an audit of a changed file can name the row and the field (the
        seal digest itself covers all of it at once)."""
        def short(data: bytes) -> str:
            return hashlib.sha256(data).hexdigest()[:16]
        out = {"sample": [short(repr(s).encode()) for s in self.samples]}
        for name in sorted(self._fields):
            item = self._fields[name]
            if FIELDS[name].kind is not Kind.FACT:
                continue
            if isinstance(item.value, torch.Tensor):
                rows = item.value.detach().cpu().contiguous().numpy()
                out[name] = [short(row.tobytes()) for row in rows]
            else:
                out[name] = [short(repr(_record_key(v)).encode()) for v in item.value]
        return out

    # ---- views -------------------------------------------------------------------------
    def select(self, indices: Sequence[int], derived: bool = True, without: Sequence[str] = ()) -> "ExperienceBatch":
        """A sub-batch (micro-batch, data-parallel shard) that keeps every field's provenance.
        Token fields keep the parent's response width so shards line up column by column.
        `derived=False`: the facts only, the derived fields left to be derived again over it;
        `without`: fields left out (to be written anew, e.g. a probe's own old log-probs)."""
        idx = list(indices)
        sub = ExperienceBatch.__new__(ExperienceBatch)
        sub.run_id, sub.iteration, sub.contract = self.run_id, self.iteration, self.contract
        sub.samples = tuple(self.samples[i] for i in idx)
        sub.versions = dict(self.versions)
        sub.num_response_tokens = self.num_response_tokens
        index = torch.tensor(idx, dtype=torch.long)
        sub._fields = {}
        for name, item in self._fields.items():
            if name in without or (not derived and FIELDS[name].kind is Kind.DERIVED):
                continue
            if isinstance(item.value, torch.Tensor):
                value = item.value.index_select(0, index.to(item.value.device))
            else:
                value = [item.value[i] for i in idx]
            sub._fields[name] = Versioned(value, item.producer, item.version)
        sub._seal_digest = sub._digest() if self.sealed else None
        return sub

    def select_ids(self, sample_ids: Sequence[str]) -> "ExperienceBatch":
        pos = {sid: i for i, sid in enumerate(self.sample_ids)}
        unknown = [s for s in sample_ids if s not in pos]
        if unknown:
            raise ExperienceError(f"unknown sample ids {unknown[:3]}")
        return self.select([pos[s] for s in sample_ids])

    # ---- helpers -----------------------------------------------------------------------
    def _check_value(self, spec: FieldSpec, value: Any) -> None:
        b, r = len(self), self.num_response_tokens
        if spec.dtype is None:
            if not isinstance(value, (list, tuple)) or len(value) != b:
                raise ExperienceError(f"field {spec.name!r}: expected a list of {b} records")
            return
        if not isinstance(value, torch.Tensor):
            raise ExperienceError(f"field {spec.name!r}: expected a tensor, got {type(value).__name__}")
        if value.dtype != spec.dtype:
            raise ExperienceError(f"field {spec.name!r}: dtype {value.dtype}, declared {spec.dtype}")
        shape = (b,) if spec.align is Align.SAMPLE else (b, r)
        if tuple(value.shape) != shape:
            raise ExperienceError(f"field {spec.name!r}: shape {tuple(value.shape)}, expected {shape} "
                                  f"({spec.align.value}-aligned)")
        if spec.align is Align.TOKEN and r and bool((value[~self.token_mask().to(value.device)] != 0).any()):
            raise ExperienceError(f"field {spec.name!r}: non-zero values past a response's end; "
                                  "padding must be 0 so that it never contributes")

    def token_mask(self) -> torch.Tensor:
        """(B, R) bool: True on every position that holds a response token (action or not)."""
        lengths = torch.tensor([len(s.response_ids) for s in self.samples], dtype=torch.long)
        return torch.arange(self.num_response_tokens)[None, :] < lengths[:, None]


def _spec_of(name: str) -> FieldSpec:
    if name not in FIELDS:
        raise ExperienceError(f"unknown experience field {name!r}; declared: {sorted(FIELDS)}")
    return FIELDS[name]


def pad_token_rows(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype,
                   fill: float = 0) -> torch.Tensor:
    """Right-pad per-sample token lists into a (B, width) tensor."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    flat = [v for row in rows for v in row]
    if flat:  # row-major boolean indexing fills row 0's first len(row 0) slots, then row 1's, ...
        out[torch.arange(width)[None, :] < lengths[:, None]] = torch.tensor(flat, dtype=dtype)
    return out


def _record_key(record) -> tuple:
    """What the seal digest covers of a per-sample record (a RewardRecord): every field, the
    components in name order. A plain tuple: repr of the dataclass with its enum costs 8x.
    An EpisodeRecord is covered by its canonical JSON."""
    if isinstance(record, EpisodeRecord):
        return (record.to_json(),)
    return (record.status.value, record.total, sorted(record.components.items()), record.scorer,
            record.scorer_version, record.message)
