"""`sealrl report RUN_DIR`: one self-contained HTML page for a run folder.

Reads `metrics.jsonl`, `summary.json` and the last `experience/iter_*.parquet`; writes
`runs/<name>/report.html` with inline SVG plots (reward and held-out accuracy, KL, entropy,
response length, clip fractions, stage times) and a table of sample responses. No script, no
external resource: it opens offline, and its Content-Security-Policy forbids scripts, so model
output (escaped anyway) cannot run in the reader's browser.

x axes are policy versions: the training metrics of iteration i were sampled by version i; an
evaluation logged at iteration i ran after its update, on version i + 1; the evaluation before
training is version 0."""
from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path

from sealrl.config import MissingInputError
from sealrl.obs.episodes_report import conversation_table
from sealrl.obs.metrics import read_metrics
from sealrl.obs.svg import PALETTE, Series, as_float, line_chart, stacked_bars
from sealrl.obs.timeline import mean_stage_shares, stage_breakdown

NUM_SAMPLES = 16
MAX_TEXT = 2000  # characters of a prompt or response shown in the table
MAX_BARS = 300   # stage-time bars; longer runs are averaged in bins of iterations
SAMPLE_COLUMNS = ("sample_id", "group_id", "prompt_text", "response_text", "ground_truth", "reward_status",
                  "reward_total", "reward_message", "advantages", "response_mask", "policy_version", "stop_reason")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{background:#fff;border:1px solid #ddd;font-size:11px}
svg .t{font-size:13px;font-weight:600}svg .g{stroke:#eee}svg .a{stroke:#888}
svg .f{fill:none;stroke:#888}svg text{fill:#333}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f4f4f4;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.text{white-space:pre-wrap;font-family:ui-monospace,monospace;max-width:420px;overflow-wrap:anywhere}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px}
.note{color:#666;font-size:12px}
"""


def load_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl by iteration; a line written again for the same iteration (a redone
    iteration after a resume) replaces the earlier one."""
    by_it = {r["iteration"]: r for r in read_metrics(run_dir) if isinstance(r.get("iteration"), int)}
    return [by_it[i] for i in sorted(by_it)]


def last_experience(run_dir: Path) -> tuple[Path | None, list[dict]]:
    """Rows of the last iteration's experience file, columns limited to what the table shows."""
    files = sorted((run_dir / "experience").glob("iter_*.parquet"))
    if not files:
        return None, []
    import pyarrow.parquet as pq  # only here: the charts need no pyarrow
    names = set(pq.read_schema(files[-1]).names)
    table = pq.read_table(files[-1], columns=[c for c in SAMPLE_COLUMNS if c in names])
    return files[-1], table.to_pylist()


def pick_samples(rows: list[dict], k: int = NUM_SAMPLES) -> list[dict]:
    """k rows spread evenly over the file (rows are grouped by prompt, so this spans groups)."""
    if len(rows) <= k:
        return rows
    return [rows[round(i * (len(rows) - 1) / (k - 1))] for i in range(k)]


def first_advantage(row: dict) -> float | None:
    """Advantage at the first action token (GRPO-style advantages are constant over a response)."""
    adv, mask = row.get("advantages") or [], row.get("response_mask") or []
    for t, a in enumerate(adv):
        if t >= len(mask) or mask[t]:
            return a
    return None


def _series(rows: list[dict], key: str, color: str, label: str | None = None, dashed: bool = False) -> Series:
    return Series(label or key, [r["iteration"] for r in rows], [r.get(key) for r in rows], color, dashed=dashed)


def charts(rows: list[dict], summary: dict) -> list[str]:
    c = PALETTE
    evals = [(r["iteration"] + 1, r["eval/accuracy"]) for r in rows if as_float(r.get("eval/accuracy")) is not None]
    if as_float(summary.get("accuracy_before")) is not None:
        evals.insert(0, (0, summary["accuracy_before"]))
    if as_float(summary.get("accuracy_after")) is not None and rows:
        evals.append((rows[-1]["iteration"] + 1, summary["accuracy_after"]))
    held_out = Series("eval/accuracy (held-out)", [x for x, _ in evals], [y for _, y in evals], c[3], points=True)
    out = [
        line_chart("Reward and held-out accuracy", [_series(rows, "reward/mean", c[0]),
                                                    _series(rows, "reward/accuracy", c[1], dashed=True), held_out]),
        line_chart("KL divergence", [_series(rows, "kl/ref_kl", c[0], "kl/ref_kl (old ‖ ref)"),
                                     _series(rows, "actor/approx_kl", c[1], "actor/approx_kl (old ‖ new)")],
                   "nats / token"),
        line_chart("Policy entropy", [_series(rows, "actor/entropy", c[2])], "nats / token"),
        line_chart("Response length", [_series(rows, "rollout/response_len_mean", c[0], "mean"),
                                       _series(rows, "rollout/response_len_max", c[1], "max")], "tokens"),
        line_chart("Clip fraction", [_series(rows, "actor/clip_frac_upper", c[0], "upper (A > 0)"),
                                     _series(rows, "actor/clip_frac_lower", c[1], "lower (A < 0)"),
                                     _series(rows, "actor/clip_frac_dual", c[4], "dual")], "share of tokens"),
    ]
    if any("logprob/current_vs_rollout_abs_diff_max" in r for r in rows):   # every mode (docs/metrics.md)
        out.append(line_chart("Train vs rollout log-probs (first step)", [
            _series(rows, "logprob/current_vs_rollout_abs_diff_max", c[0], "max |current - rollout|"),
            _series(rows, "logprob/current_vs_rollout_k3", c[1], "k3 (mean)", dashed=True)], "nats / token"))
    if any("staleness/max" in r for r in rows):   # rollout.max_staleness >= 1 (docs/async.md)
        out.append(line_chart("Realised staleness", [_series(rows, "staleness/mean", c[0], "mean"),
                                                     _series(rows, "staleness/max", c[1], "max")],
                              "versions behind the consuming actor"))
    breakdown = [stage_breakdown(r) for r in rows]
    stacks = {stage: [b.get(stage, 0.0) for b in breakdown] for stage in mean_stage_shares(rows)}
    xs, stacks, size = binned([r["iteration"] for r in rows], stacks)
    label = "seconds" if size == 1 else f"seconds (mean of {size} iterations)"
    out.append(stacked_bars("Stage time per iteration", xs, stacks, label))
    return out


def binned(xs: list[int], stacks: dict[str, list[float]], max_bars: int = MAX_BARS):
    """At most max_bars bars: consecutive iterations averaged in bins of equal size (the last
    may be shorter), each drawn at its first iteration. Returns (xs, stacks, bin size)."""
    size = -(-len(xs) // max_bars)
    if size <= 1:
        return xs, stacks, 1
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return (xs[::size], {k: [mean(v[i:i + size]) for i in range(0, len(v), size)] for k, v in stacks.items()},
            size)


def _share_table(rows: list[dict]) -> str:
    shares = mean_stage_shares(rows)
    if not shares:
        return '<p class="note">no time/&lt;stage&gt;_s metrics in this run</p>'
    breakdown = [stage_breakdown(r) for r in rows]
    seconds = {stage: sum(b.get(stage, 0.0) for b in breakdown) for stage in shares}
    body = "".join(f'<tr><td><span class="sw" style="background:{PALETTE[i % len(PALETTE)]}"></span>'
                   f'{escape(stage)}</td><td class="num">{100 * share:.1f}%</td>'
                   f'<td class="num">{seconds[stage]:.2f}</td></tr>' for i, (stage, share) in enumerate(shares.items()))
    return ('<table class="shares"><tr><th>stage</th><th>share of iteration time</th><th>seconds (run)</th></tr>'
            f'{body}</table><p class="note">Stages run one after another, so a share is what the stage costs '
            'on the critical path; "other" is untimed driver work.</p>')


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _cell(v, cls: str = "") -> str:
    if isinstance(v, float):
        return f'<td class="num">{escape(fmt(v))}</td>'
    text = "" if v is None else str(v)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"… [{len(text) - MAX_TEXT} more characters]"
    return f'<td class="{cls}">{escape(text)}</td>' if cls else f"<td>{escape(text)}</td>"


def _sample_table(path: Path | None, rows: list[dict]) -> str:
    if path is None:
        return '<p class="note">no experience files in this run</p>'
    head = ("sample", "prompt", "response", "ground truth", "stop", "reward status", "reward total",
            "advantage (first token)", "policy version")
    lines = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in pick_samples(rows):
        status = r.get("reward_status")
        if r.get("reward_message"):
            status = f"{status}: {r['reward_message']}"
        lines.append("<tr>" + _cell(r.get("sample_id")) + _cell(r.get("prompt_text"), "text")
                     + _cell(r.get("response_text"), "text") + _cell(r.get("ground_truth"), "text")
                     + _cell(r.get("stop_reason")) + _cell(status) + _cell(r.get("reward_total"))
                     + _cell(first_advantage(r)) + _cell(r.get("policy_version")) + "</tr>")
    return (f'<p class="note">{min(len(rows), NUM_SAMPLES)} of {len(rows)} samples of '
            f'{escape(path.name)}, spread evenly over its groups.</p><table class="samples">{"".join(lines)}</table>')


def _summary_table(run_dir: Path, summary: dict, rows: list[dict]) -> str:
    facts = {"run folder": str(run_dir), "iterations logged": len(rows)}
    facts.update({k: v for k, v in summary.items() if isinstance(v, (str, int, float)) and k != "run_dir"})
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th>{_cell(v)}</tr>" for k, v in facts.items()) + "</table>"


def render(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    exp_path, exp_rows = last_experience(run_dir)
    title = f"sealrl run {run_dir.name}"
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">written {time.strftime("%Y-%m-%d %H:%M:%S")} by sealrl report; metric keys are '
        "defined in docs/metrics.md. x axes are policy versions: an evaluation logged after iteration i "
        "is drawn at i + 1, the one before training at 0.</p>",
        _summary_table(run_dir, summary, rows),
        "<h2>Training curves</h2>", '<div class="charts">', *charts(rows, summary), "</div>",
        "<h2>Stage time</h2>", _share_table(rows),
        "<h2>Sample responses (last iteration)</h2>", _sample_table(exp_path, exp_rows),
        conversation_table(run_dir, exp_path),   # multi-turn runs only
        "<h2>Dropped groups</h2>", _quarantine_table(run_dir),
        "</body></html>", ""])


QUARANTINE = "quarantine"   # run folder: dropped groups' content (trainer/quarantine.py)


def read_quarantine(run_dir: Path) -> list[dict]:
    """Every quarantined group of a run folder, in iteration order (unreadable lines skipped)."""
    out = []
    for path in sorted((Path(run_dir) / QUARANTINE).glob("iter_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _quarantine_table(run_dir: Path, limit: int = 20) -> str:
    """Dropped groups (quarantine/): why, and what each candidate was and scored."""
    groups = read_quarantine(run_dir)
    if not groups:
        return "<p>No group was dropped.</p>"
    rows = []
    for q in groups[:limit]:
        for s in q["samples"] or [{"candidate": "-", "response_text": "(nothing generated)", "reward": None}]:
            r = s.get("reward") or {}
            rows.append(f"<tr><td>{q['iteration']}</td><td>{escape(q['group_id'])}</td><td>{escape(q['reason'])}</td>"
                        f"<td>{s['candidate']}</td><td>{escape(str(s.get('response_text')))}</td>"
                        f"<td>{escape(str(r.get('status', '')))} {escape(str(r.get('total', '')))}</td>"
                        f"<td>{escape(str(r.get('message', '')))}</td></tr>")
    more = f"<p>{len(groups) - limit} more groups in quarantine/.</p>" if len(groups) > limit else ""
    return (f"<p>{len(groups)} dropped groups (quarantine/iter_*.jsonl).</p><table><tr><th>iteration</th>"
            "<th>group</th><th>reason</th><th>candidate</th><th>response</th><th>reward</th><th>message</th></tr>"
            + "".join(rows) + "</table>" + more)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise MissingInputError(f"{run_dir} has no metrics.jsonl: not a sealrl run folder")
    out = Path(out) if out is not None else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(run_dir), encoding="utf-8")
    tmp.replace(out)
    return out


def _report(args) -> int:
    print(write_report(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def add_parser(subparsers) -> None:
    """Register `sealrl report RUN_DIR [--out PATH]` on the CLI's subparsers."""
    r = subparsers.add_parser("report", help="write a self-contained HTML report of a run folder",
                              description="Plots of reward, held-out accuracy, KL, entropy, response "
                              "length, clip fractions and stage times, and sample responses of the last "
                              "iteration, as one HTML file that opens offline.")
    r.add_argument("run_dir", help="runs/<name>")
    r.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html)")
    r.set_defaults(fn=_report)
