"""Kill-and-resume against a straight run, shared by the resume tests of full and LoRA runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sealrl.config import build_config
from sealrl.trainer.driver import train
from sealrl.trainer.iteration_metrics import is_wall_clock


def straight_and_resumed(tmp_path: Path, args: list[str]) -> tuple[Path, Path]:
    """Train `args` (with run.name=r) straight in this process into tmp_path/a while a CLI copy
    into tmp_path/b is killed by the fault plan right after checkpoint 3, then resume b with
    resume=auto. The killed run (a new interpreter: seconds of imports) goes on while the
    straight one trains. Returns the two run folders (a/r, b/r)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cmd = [sys.executable, "-m", "sealrl.cli", "train", str(empty), *args, f"run.output_dir={tmp_path / 'b'}"]
    env = dict(os.environ, SEALRL_FAULTS="after_checkpoint@3:kill")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        train(build_config(None, args + [f"run.output_dir={tmp_path / 'a'}"]))
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -9, stderr[-2000:]
    b = tmp_path / "b" / "r"
    assert (b / "checkpoints" / "latest").read_text() == "step_3"
    assert not (b / "summary.json").exists()
    train(build_config(None, args + [f"run.output_dir={tmp_path / 'b'}", "run.resume=auto"]))
    return tmp_path / "a" / "r", b


def learned_metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures (stage times, latencies, throughputs), which
    differ between any two runs; everything else is bitwise."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]
