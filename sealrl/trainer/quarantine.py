"""The quarantine: what a dropped group held, kept for inspection instead of thrown away.

A group dropped by the ledger (generation failed past its retries, a reward error under
drop_group, no ReMax baseline, ...) trains nothing and is recorded in ledger.jsonl with a reason.
Its content goes to `quarantine/iter_NNNNNN.jsonl`, one line per dropped group: the reason, the
prompt, what the scorer received (prompt text, response text, ground truth, data source) and
returned (status, total, message, scorer) for every candidate that was generated. Written before
the iteration's seal (and before a run stops because every group was dropped), atomically and
whole, so a resumed run writes the same file again. Not a fact: nothing here is sealed or trained;
`sealrl report` lists it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from sealrl.obs.report import QUARANTINE as FOLDER


def quarantine(run_dir: Path, it: int, produced) -> int:
    """Write iteration `it`'s dropped groups (a pipeline.Produced); returns how many."""
    lines = [_group(it, row, produced) for row in produced.ledger.rows() if row["status"] == "dropped"]
    if not lines:
        return 0
    folder = Path(run_dir) / FOLDER
    folder.mkdir(exist_ok=True)
    path = folder / f"iter_{it:06d}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines)


def quarantine_dropped(run_dir: Path, it: int, produced) -> None:
    """Quarantine iteration `it`'s dropped groups; when none is left to train, the ledger says
    why each went and the run stops naming the first (StageFailed)."""
    from sealrl.trainer.prepare import append_lines
    from sealrl.trainer.state import StageFailed
    quarantine(run_dir, it, produced)
    if not produced.kept:
        append_lines(Path(run_dir) / "ledger.jsonl", produced.ledger.rows())
        raise StageFailed(f"iteration {it}: every group was dropped ({produced.ledger.rows()[0]['reason']})")


def _group(it: int, row: dict, produced) -> dict:
    g = row["group_id"]
    prompt = produced.prompt_of(g)
    samples = produced.groups.get(g, [])
    return {"iteration": it, "group_id": g, "prompt_id": row["prompt_id"], "reason": row["reason"],
            "prompt": prompt.text, "ground_truth": prompt.ground_truth, "data_source": prompt.data_source,
            "samples": [_sample(s, produced) for s in sorted(samples, key=lambda s: s.candidate)]}


def _sample(s, produced) -> dict:
    record = produced.records.get(s.sample_id)
    reward = None if record is None else {"status": record.status.value, "total": record.total,
                                           "message": record.message, "scorer": record.scorer,
                                           "scorer_version": record.scorer_version}
    return {"sample_id": s.sample_id, "candidate": s.candidate, "policy_version": s.policy_version.id,
            "stop_reason": s.stop_reason.value, "response_ids": list(s.response_ids),
            "response_text": produced.texts.get(s.sample_id), "reward": reward}
