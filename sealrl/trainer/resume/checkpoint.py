"""Checkpoint = training position (DESIGN section 6), written atomically.

A checkpoint is a folder `checkpoints/step_N/` holding named parts: safetensors files for every
tensor (weights, optimizer moments, RNG state) and one `state.json` for everything else. It is
written into `step_N.tmp/`, every file fsynced, a `COMMITTED` marker holding each file's sha256
is written last, the folder is renamed into place, and only then does the `latest` pointer move
(itself replaced atomically). Only folders with a valid marker load; a missing or corrupted part
refuses to resume and names the part. Nothing is unpickled: no torch.load, no pickle.

A part too large to hold in the driver at once (a data-parallel role's optimizer state,
gathered from its ranks a bucket at a time: placement/train_group.py) is a `StreamedPart`: each
chunk is written as it comes, as shards `<part>-00000.safetensors`, `<part>-00001...`, and
`load_checkpoint` reads the shards back as one part.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sealrl import faults
from sealrl.config import UserError

MARKER = "COMMITTED"
LATEST = "latest"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the part."""


class StreamedPart:
    """A part whose tensors come in chunks ({key: tensor} each, at least one), written one at a time."""

    def __init__(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        self.chunks = chunks


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    state: dict[str, Any], folders: dict[str, Callable[[Path], object]] | None = None,
                    ) -> Path:
    """Commit checkpoint `step` under `root` (= run/checkpoints).

    tensors: part name -> flat {key: tensor}, saved as `<part>.safetensors`.
    state: JSON-able training position (versions, sampler, controllers, hashes...).
    folders: part name -> a function that writes that folder (e.g. the policy as an HF model
    folder), called with `<tmp>/<part>` so that it is checksummed and committed with the rest.
    """
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_parts(tmp, step, tensors, state, folders or {})
    except (OSError, SafetensorError) as e:   # a full disk: nothing partial beside the intact checkpoints
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(root) if (root / LATEST).is_file() else None
        intact = f"the previous checkpoint {previous.name} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(f"cannot write checkpoint {final.name} in {root} ({getattr(e, 'strerror', None) or e}); "
                              f"nothing of it was kept and {intact}: free space, then resume=auto "
                              "continues from it") from e
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    faults.point("checkpoint_after_marker", step)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name)
    fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    return final


def _write_parts(tmp: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
                 folders: dict[str, Callable[[Path], object]]) -> None:
    """Every part into `tmp`, fsynced, then the marker (written last) and the folder fsynced."""
    tmp.mkdir()
    for part, flat in tensors.items():
        if isinstance(flat, StreamedPart):
            for i, chunk in enumerate(flat.chunks):
                _save(chunk, tmp / f"{part}-{i:05d}.safetensors")
        else:
            _save(flat, tmp / f"{part}.safetensors")
    (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, indent=1))
    for part, write in folders.items():
        write(tmp / part)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        fsync_file(p)
    faults.point("checkpoint_before_marker", step)
    marker = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
    (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True, indent=1))  # written last
    fsync_file(tmp / MARKER)
    _fsync_dir(tmp)


def _save(flat: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in flat.items()}, str(path))


def latest_checkpoint(root: Path) -> Path | None:
    """The folder `latest` points to, or None when no checkpoint was ever committed."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name.startswith("step_") or "/" in name or ".." in name:
        raise CheckpointError(f"{pointer}: does not name a checkpoint folder ({name!r})")
    return root / name


def resume_checkpoint(root: Path) -> Path | None:
    """The checkpoint a resume loads: the one `latest` names if it verifies, else the newest
    committed one that does, said on stderr (a corrupted latest checkpoint, or a `latest`
    pointer lost). None only when no checkpoint folder exists at all; CheckpointError when
    folders exist and none of them verifies."""
    steps = _step_folders(root)
    pointer = root / LATEST
    named = latest_checkpoint(root) if pointer.is_file() else None
    if named is None and not steps:
        return None
    why, candidates = "", steps
    if named is not None:
        try:
            verify_checkpoint(named)
            return named
        except CheckpointError as e:
            why = str(e)
        candidates = [p for p in steps if int(p.name[5:]) < int(named.name[5:])]
    else:
        why = f"{pointer} is missing"
    for folder in candidates:
        try:
            verify_checkpoint(folder)
        except CheckpointError:
            continue
        print(f"sealrl: {why}; resuming from {folder.name}, the newest intact checkpoint", file=sys.stderr,
              flush=True)
        return folder
    raise CheckpointError(f"{why}; and no earlier checkpoint in {root} is intact")


def _step_folders(root: Path) -> list[Path]:
    """The `step_N` folders under `root`, newest (largest N) first."""
    return sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]), reverse=True)


def prune_checkpoints(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` committed checkpoints (the one `latest` names is always
    kept); `keep` 0 keeps every one. Returns the names deleted."""
    if keep <= 0:
        return []
    latest = latest_checkpoint(root)
    steps = [p for p in _step_folders(root) if (p / MARKER).is_file()]
    gone = [p for p in steps[keep:] if p != latest]
    for p in gone:
        shutil.rmtree(p)
    if gone:
        _fsync_dir(root)
    return [p.name for p in gone]


def verify_checkpoint(folder: Path) -> dict:
    """Check the marker and every file's checksum; return the marker."""
    marker_path = folder / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"{folder}: not committed (no {MARKER} marker); refusing to load it")
    marker = json.loads(marker_path.read_text())
    for rel, digest in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{folder}: part {rel} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"{folder}: part {rel} is corrupted (checksum mismatch)")
    return marker


def load_checkpoint(folder: Path, parts: list[str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Verified tensors of the named parts and the JSON state."""
    verify_checkpoint(folder)
    tensors = {}
    for part in parts:
        path = folder / f"{part}.safetensors"
        shards = [path] if path.is_file() else sorted(folder.glob(f"{part}-[0-9][0-9][0-9][0-9][0-9].safetensors"))
        if not shards:
            raise CheckpointError(f"{folder}: part {part} is missing")
        tensors[part] = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    return tensors, json.loads((folder / "state.json").read_text())


# ---- flattening of optimizer and RNG state into tensors + JSON ------------------------------

def rng_to_flat() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def rng_from_flat(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
