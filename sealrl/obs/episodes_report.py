"""The report's conversation table for multi-turn runs: a few episodes of the last iteration,
turn by turn, with what was trained (policy tokens) set apart from what was not (observations).
Texts are decoded with the run's own tokenizer (run_dir/model); without it the ids are shown."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

NUM_EPISODES = 6


def _decoder(run_dir: Path):
    if not (run_dir / "model" / "tokenizer_config.json").is_file():
        return lambda ids: " ".join(map(str, ids))
    from transformers import AutoTokenizer  # only here: the charts need no transformers
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def conversation_table(run_dir: Path, path: Path | None) -> str:
    """'' for a single-turn run (no episodes column)."""
    if path is None:
        return ""
    import pyarrow.parquet as pq
    if "episodes" not in pq.read_schema(path).names:
        return ""
    rows = pq.read_table(path, columns=["sample_id", "reward_status", "reward_total", "episodes"]).to_pylist()
    multi = [r for r in rows if len(json.loads(r["episodes"])["turns"]) > 1] or rows
    decode = _decoder(Path(run_dir))
    lines = ["<tr><th>sample</th><th>turn</th><th>policy (trained)</th><th>stop</th><th>observation (not trained)</th>"
             "<th>tool status</th><th>reward</th></tr>"]
    for r in multi[:NUM_EPISODES]:
        ep = json.loads(r["episodes"])
        reward = f"{r['reward_status']} {r['reward_total'] if r['reward_total'] is not None else ''}".strip()
        for k, t in enumerate(ep["turns"]):
            obs = decode(t["observation_ids"]) + (" [truncated]" if t["obs_truncated"] else "")
            status = t["status"] + (f": {t['message']}" if t["message"] else "")
            lines.append(f"<tr><td>{escape(r['sample_id']) if k == 0 else ''}</td><td>{k}</td>"
                         f'<td class="text" style="background:#e8f5e9">{escape(decode(t["ids"]))}</td>'
                         f"<td>{escape(t['stop_reason'])}</td>"
                         f'<td class="text" style="background:#f4f4f4">{escape(obs)}</td>'
                         f"<td>{escape(status)}</td><td>{escape(reward) if k == len(ep['turns']) - 1 else ''}"
                         "</td></tr>")
    return ("<h2>Episodes (last iteration)</h2>"
            f'<p class="note">{min(len(multi), NUM_EPISODES)} episodes of {escape(path.name)}; green: policy tokens '
            "(response_mask 1, trained), grey: observation tokens (holes: no loss, KL or entropy).</p>"
            f'<table class="samples">{"".join(lines)}</table>')
