"""Small static SVG charts for the run report: line charts and stacked bars, drawn in Python so
the report needs no JavaScript, no plotting package and no network.

Each chart is one `<svg class="chart">`; each data series is one `<g class="series"
data-label=...>` whose polylines, circles or rects are the drawn data (the browser test
measures them). Missing values (None, NaN, "nan" strings from metrics.jsonl) break a line
rather than being drawn as zero."""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

PALETTE = ("#1f6fb4", "#e0701b", "#2b9a3e", "#c8322f", "#7f5bb5", "#8a5a44", "#d45fb0", "#6f6f6f",
           "#a8a820", "#17a2b5", "#283c8c", "#b5651d")
WIDTH, HEIGHT = 460, 270
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 30, 62  # margins: y labels, -, title, x labels + legend


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    xs: list[float]
    ys: list                 # float | None per x
    color: str
    points: bool = False     # markers only (sparse series such as eval/accuracy)
    dashed: bool = False     # tells apart a line that often lies on another one


def as_float(v) -> float | None:
    """A finite float, or None for missing / non-finite / non-numeric values."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    span = hi - lo
    raw = span / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


class _Frame:
    """Maps data coordinates to pixels and draws axes, grid, title and legend."""

    def __init__(self, title: str, x_range: tuple[float, float], y_range: tuple[float, float], y_label: str):
        self.title, self.y_label = title, y_label
        x0, x1 = x_range
        y0, y1 = y_range
        self.x0, self.x1 = (x0 - 0.5, x1 + 0.5) if x0 == x1 else (x0, x1)
        self.y0, self.y1 = (y0 - 1, y1 + 1) if y0 == y1 else (y0, y1)
        self.pw, self.ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * self.pw

    def py(self, y: float) -> float:
        return TOP + (1 - (y - self.y0) / (self.y1 - self.y0)) * self.ph

    def svg(self, body: list[str], legend: list[tuple[str, str]]) -> str:
        out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
               f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(self.title)}">',
               f'<title>{escape(self.title)}</title>',
               f'<text x="{LEFT}" y="18" class="t">{escape(self.title)}</text>']
        bottom = TOP + self.ph
        for t in nice_ticks(self.y0, self.y1):
            y = self.py(t)
            out.append(f'<line x1="{LEFT}" x2="{LEFT + self.pw}" y1="{y:.1f}" y2="{y:.1f}" class="g"/>'
                       f'<text x="{LEFT - 4}" y="{y + 3.5:.1f}" text-anchor="end">{t:.3g}</text>')
        for t in nice_ticks(self.x0, self.x1, 6):
            if t == int(t):  # iterations are integers
                x = self.px(t)
                out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" class="a"/>'
                           f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{int(t)}</text>')
        out.append(f'<rect x="{LEFT}" y="{TOP}" width="{self.pw}" height="{self.ph}" class="f"/>')
        out.append(f'<text x="{LEFT + self.pw / 2}" y="{bottom + 29}" text-anchor="middle">iteration</text>')
        if self.y_label:
            out.append(f'<text transform="translate(11 {TOP + self.ph / 2}) rotate(-90)" '
                       f'text-anchor="middle">{escape(self.y_label)}</text>')
        out += body
        x, y = LEFT, HEIGHT - 10
        for label, color in legend:
            w = 24 + 6.2 * len(label)
            if x + w > WIDTH and x > LEFT:  # wrap the legend; the chart grows to fit
                x, y = LEFT, y + 15
            out.append(f'<rect x="{x}" y="{y - 8}" width="10" height="10" fill="{color}"/>'
                       f'<text x="{x + 14}" y="{y + 1}">{escape(label)}</text>')
            x += w
        height = y + 10
        out[0] = out[0].replace(f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}"',
                                f'height="{height}" viewBox="0 0 {WIDTH} {height}"')
        out.append("</svg>")
        return "\n".join(out)


def _no_data(title: str) -> str:
    return (f'<svg class="chart empty" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">'
            f'<title>{escape(title)}</title><text x="{LEFT}" y="18" class="t">{escape(title)}</text>'
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data in this run</text></svg>')


def line_chart(title: str, series: list[Series], y_label: str = "",
               y_range: tuple[float, float] | None = None) -> str:
    pts = [[(x, as_float(y)) for x, y in zip(s.xs, s.ys)] for s in series]
    values = [(x, y) for p in pts for x, y in p if y is not None]
    if not values:
        return _no_data(title)
    xs, ys = [x for x, _ in values], [y for _, y in values]
    if y_range is None:
        lo, hi = min(ys), max(ys)
        pad = 0.06 * (hi - lo) if hi > lo else max(abs(hi) * 0.1, 1e-3)
        y_range = (lo - pad if lo < 0 or lo - pad >= 0 else 0.0, hi + pad)
    frame = _Frame(title, (min(xs), max(xs)), y_range, y_label)
    body, legend = [], []
    for s, p in zip(series, pts):
        if not any(y is not None for _, y in p):
            continue
        legend.append((s.label, s.color))
        body.append(f'<g class="series" data-label="{escape(s.label)}" stroke="{s.color}" fill="{s.color}">')
        runs, run = [], []
        for x, y in p:
            if y is None:
                runs, run = runs + [run] if run else runs, []
            else:
                run.append((frame.px(x), frame.py(y)))
        runs += [run] if run else []
        for r in runs:
            if s.points or len(r) == 1:
                body += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5"/>' for x, y in r]
            else:
                coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in r)
                dash = ' stroke-dasharray="5 3"' if s.dashed else ""
                body.append(f'<polyline points="{coords}" fill="none" stroke-width="1.6"{dash}/>')
        body.append("</g>")
    return frame.svg(body, legend)


def stacked_bars(title: str, xs: list[float], stacks: dict[str, list], y_label: str = "") -> str:
    """One bar per x, one coloured segment per stack (missing values count as 0)."""
    rows = {k: [as_float(v) or 0.0 for v in vs] for k, vs in stacks.items()}
    totals = [sum(col) for col in zip(*rows.values())] if rows else []
    if not xs or not totals or max(totals) <= 0:
        return _no_data(title)
    frame = _Frame(title, (min(xs), max(xs)), (0.0, max(totals) * 1.05), y_label)
    bar = 20.0
    if len(xs) > 1:  # bars 0.8 of the x spacing wide, with room for half a bar at both ends
        step = min(b - a for a, b in zip(xs, xs[1:]))
        frame.x0, frame.x1 = min(xs) - 0.6 * step, max(xs) + 0.6 * step
        bar = 0.8 * (frame.px(step) - frame.px(0))
    base = [0.0] * len(xs)
    body, legend = [], []
    for i, (label, vs) in enumerate(rows.items()):
        color = PALETTE[i % len(PALETTE)]
        legend.append((label, color))
        body.append(f'<g class="series" data-label="{escape(label)}" fill="{color}">')
        for j, (x, v) in enumerate(zip(xs, vs)):
            if v > 0:
                y_top, y_bot = frame.py(base[j] + v), frame.py(base[j])
                body.append(f'<rect x="{frame.px(x) - bar / 2:.1f}" y="{y_top:.1f}" width="{bar:.1f}" '
                            f'height="{max(y_bot - y_top, 0.3):.1f}"/>')
            base[j] += v
        body.append("</g>")
    return frame.svg(body, legend)
