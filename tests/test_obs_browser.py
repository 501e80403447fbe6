"""The report in a real headless Chromium: every chart lays out and draws its data, model output
stays text, and the screenshot shows the plot colours. Chromium comes from Debian's package
(`make test` runs `make browser`, which installs it when it can); without it these tests skip."""
import html
import json
import os
import re
import shutil
import subprocess

import pytest

from sealrl.obs.report import write_report
from sealrl.obs.svg import HEIGHT, LEFT, PALETTE, RIGHT, WIDTH
from tests.test_obs_report import PAYLOAD, make_run

CHROMIUM = os.environ.get("SEALRL_CHROMIUM") or shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium: `make browser` installs it with apt-get (needs root and "
    "Debian/Ubuntu), or set SEALRL_CHROMIUM to a Chromium/Chrome binary")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]

# Measures what the browser laid out; appended to a copy of the report (the report itself
# carries no script and its Content-Security-Policy would block this one).
PROBE = """<script>
const charts = [...document.querySelectorAll('svg.chart')].map(svg => {
  const r = svg.getBoundingClientRect();
  return {title: svg.getAttribute('aria-label'), w: r.width, h: r.height,
          series: [...svg.querySelectorAll('g.series')].map(g => {
            const b = g.getBBox(); return {label: g.dataset.label, w: b.width, h: b.height, x: b.x};})};
});
const responses = [...document.querySelectorAll('table.samples tr')].slice(1).map(tr => tr.children[2].textContent);
const pre = document.createElement('pre'); pre.id = 'probe';
pre.textContent = JSON.stringify({charts, responses, title: document.title,
                                  images: document.images.length});
document.body.appendChild(pre);
</script>"""


def _chromium(tmp_path, *args):
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return write_report(make_run(tmp_path_factory.mktemp("browser") / "run"))


def test_charts_render_and_output_stays_text(report, tmp_path):
    page = report.read_text()
    csp = re.search(r'<meta http-equiv="Content-Security-Policy"[^>]*>', page).group(0)
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace(csp, "").replace("</body>", PROBE + "</body>"))
    dom = _chromium(tmp_path, "--dump-dom", probed.as_uri())
    result = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))

    assert [c["title"] for c in result["charts"]] == ["Reward and held-out accuracy", "KL divergence",
                                                     "Policy entropy", "Response length", "Clip fraction",
                                                     "Stage time per iteration"]
    plot_width = WIDTH - LEFT - RIGHT
    for chart in result["charts"]:
        assert chart["w"] >= WIDTH and chart["h"] >= HEIGHT, chart  # + the 1 px border
        assert chart["series"], f"{chart['title']}: nothing drawn"
        for s in chart["series"]:
            # each series spans the iterations it has data for: most of the plot's width
            assert s["w"] > 0.8 * plot_width and s["x"] >= LEFT - 5, (chart["title"], s)
    reward = {s["label"]: s for s in result["charts"][0]["series"]}
    assert reward["reward/mean"]["h"] > 50  # rises from 0.2 to 0.75: a visible slope
    stages = {s["label"] for s in result["charts"][-1]["series"]}
    assert stages == {"actor_update", "generate", "reward", "other"}

    # the script/img payload in a response was shown as text and never ran (no CSP in this copy)
    assert result["title"] == "sealrl run run" and result["images"] == 0
    assert result["responses"][0] == PAYLOAD and len(result["responses"]) == 16


def test_screenshot_shows_the_plots(report, tmp_path):
    from PIL import Image  # Pillow comes with tensorboard
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "--window-size=1300,1400", f"--screenshot={shot}", report.as_uri())
    img = Image.open(shot).convert("RGB")
    assert img.size == (1300, 1400)
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50, "a blank or near-blank page"

    def pixels_near(hex_colour, tol=40):
        ref = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
        return sum(n for n, c in colours if all(abs(a - b) <= tol for a, b in zip(c, ref)))

    # lines and bars painted in the first palette colours (blue lines/bars, orange, green)
    for colour in PALETTE[:3]:
        assert pixels_near(colour) > 300, colour
