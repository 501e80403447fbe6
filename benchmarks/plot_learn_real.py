"""The learning curves of benchmarks/learn_real.py as one standalone SVG: held-out greedy accuracy
after each evaluated step, sealrl against TRL, the mean over seeds as a line and each seed as
points.

    .venv/bin/python benchmarks/learn_real.py --threads 2 | tee learn_real.log
    .venv/bin/python benchmarks/plot_learn_real.py learn_real.log docs/learn_real.svg

The input is a file whose last line is learn_real.py's JSON report (its log as written above, or
what `learn_real.py --merge` prints for several runs' seeds together).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sealrl.obs.report import CSS
from sealrl.obs.svg import PALETTE, Series, line_chart

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the sibling learn_real.py, also when imported
from learn_real import final_report as report_of  # noqa: E402


def chart(report: dict) -> str:
    a = report["args"]
    per_step = a["prompts"] * a["n"]
    series = []
    for i, side in enumerate(s for s in ("sealrl", "trl") if s in report):
        color = PALETTE[i]
        mean = report[side]["mean"]["curve"]
        series.append(Series(f"{side}, mean of {len(report[side]['seeds'])} seeds",
                             [x / per_step for x, _ in mean], [y for _, y in mean], color))
        points = [p for seed in report[side]["seeds"] for p in seed["curve"]]
        series.append(Series(f"{side}, each seed", [x / per_step for x, _ in points], [y for _, y in points],
                             color, points=True))
    title = f"SmolLM2-135M-Instruct, {a['prompts']}x{a['n']} samples a step"
    svg = line_chart(title, series, "held-out greedy accuracy")
    head, _, rest = svg.partition(">")   # the run report's style, which a lone SVG does not inherit
    return f"{head}><style>{CSS}</style>{rest}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="learn_real.py's output (its last line is the JSON report)")
    ap.add_argument("out", type=Path, help="the SVG to write")
    args = ap.parse_args()
    args.out.write_text(chart(report_of(args.log)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
