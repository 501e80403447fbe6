"""Model folders for benchmarks/vs_trl.py --shape: the embedded model (tiny), the random-init
mid layout (sealrl/models/synthetic.py, written to a work folder), or the converted
SmolLM2-135M-Instruct folder (None when it is absent)."""
from __future__ import annotations

from pathlib import Path

from sealrl.models.synthetic import save_mid

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "sealrl" / "assets" / "arith-tiny"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def model_folder(shape: str, workdir: Path, smollm2: Path | None = None) -> Path | None:
    if shape == "tiny":
        return TINY
    if shape == "mid":
        return save_mid(workdir / "mid-model")
    path = smollm2 or SMOLLM2
    return path if (path / "config.json").is_file() else None
