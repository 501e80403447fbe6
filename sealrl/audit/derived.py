"""Two audit checks on what the seal alone cannot hold to account.

derived  scores, shaped token rewards, advantages and returns are derived fields, outside the
         seal digest (DESIGN section 3): the audit derives them again from the sealed facts with
         the run's own config, by the driver's own function (trainer/offline/recompute.rederived), and
         names each row and field whose stored value differs. A negated advantage is caught here.
chain    every checkpoint commits the seal digest of each iteration consumed before it
         (state.json's `sealed`, covered by the checkpoint's checksums, and each line of
         consumed.jsonl): a file whose facts were edited and sealed again with sealrl's own
         digest code no longer has the digest the run committed.
scorers  with scorer processes (reward.num_scorers > 0), every trained sample's reward was
         answered by one scorer process of its iteration (served.jsonl `scored_by`, joined by
         sample id and request: rewards/pool.py), and none came from an unknown process.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterator

import torch

from sealrl.audit.folder import RunFolder
from sealrl.audit.report import Violation

DERIVED = ("scores", "token_rewards", "advantages", "returns")


def check_derived(run: RunFolder) -> Iterator[Violation]:
    from sealrl.trainer.offline.recompute import rederived
    files = [f for f in run.files if f.readable]
    if not files or [f.iteration for f in files] != list(range(len(files))):
        return   # a missing or unreadable iteration is the seal and used_once checks' finding
    try:
        for _, stored, fresh, _ in rederived([f.path for f in files], run.cfg):
            yield from _compare(stored, fresh)
    except Exception as e:  # noqa: BLE001 - facts that do not rebuild are the seal check's finding
        if "seal" not in str(e) and "digest" not in str(e):
            yield Violation("derived", f"cannot derive the fields again: {type(e).__name__}: {e}")


def _compare(stored, fresh) -> Iterator[Violation]:
    shown = 0
    for name in DERIVED:
        if not fresh.has(name):
            continue
        if not stored.has(name):
            yield Violation("derived", f"{name} is missing", stored.iteration)
            continue
        a, b = stored.get(name), fresh.get(name)
        if a.shape != b.shape:
            yield Violation("derived", f"{name} has shape {tuple(a.shape)}, derived {tuple(b.shape)}", stored.iteration)
            continue
        rows = (a != b).reshape(len(a), -1).any(-1) if len(a) else torch.zeros(0, dtype=torch.bool)
        for i in rows.nonzero().flatten().tolist():
            if shown == 5:
                yield Violation("derived", f"... {int(rows.sum())} rows of {name} and maybe more differ",
                                stored.iteration)
                return
            shown += 1
            got, want = a[i].flatten().tolist(), b[i].flatten().tolist()
            t = next(k for k, (x, y) in enumerate(zip(got, want)) if x != y)
            yield Violation("derived", f"row {i} (sample {stored.sample_ids[i]}): {name}[{t}] is {got[t]!r}, "
                            f"the sealed facts give {want[t]!r}", stored.iteration)


def check_chain(run: RunFolder) -> Iterator[Violation]:
    stored = {f.iteration: f.meta.get("seal_digest") for f in run.files if f.readable}
    for it, lines in run.consumed.items():
        for line in lines:
            digest = line.get("seal_digest")
            if digest and it in stored and digest != stored[it]:
                yield Violation("chain", f"consumed.jsonl committed seal digest {digest[:12]}, the file holds "
                                f"{str(stored[it])[:12]}: the file was sealed again after it was trained", it)
    for folder in sorted((run.path / "checkpoints").glob("step_*")):
        state = _committed_state(folder)
        if state is None:
            continue
        for it, digest in sorted(state.get("sealed", {}).items(), key=lambda kv: int(kv[0])):
            it = int(it)
            if it in stored and digest != stored[it]:
                yield Violation("chain", f"checkpoint {folder.name} committed seal digest {digest[:12]}, the file "
                                f"holds {str(stored[it])[:12]}: the file was sealed again after it was trained", it)


def check_scorers(run: RunFolder) -> Iterator[Violation]:
    if not run.cfg.reward.num_scorers:
        return
    path = run.path / "served.jsonl"
    scored: dict[int, dict[str, int]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        scored.setdefault(row.get("iteration"), {}).update(row.get("scored_by", {}))
    for f in run.readable:
        answered = scored.get(f.iteration, {})
        for sid, status in zip(f.cols.get("sample_id", []), f.cols.get("reward_status", [])):
            if status == "ok" and sid not in answered:
                yield Violation("scorers", f"sample {sid}: reward ok but no scorer process answered it "
                                "(served.jsonl scored_by)", f.iteration)


def _committed_state(folder) -> dict | None:
    """state.json of a committed checkpoint, when its checksum in the marker holds (else None:
    an uncommitted or damaged checkpoint commits nothing)."""
    try:
        marker = json.loads((folder / "COMMITTED").read_text())
        raw = (folder / "state.json").read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(raw).hexdigest() != marker.get("files", {}).get("state.json"):
        return None
    return json.loads(raw)
