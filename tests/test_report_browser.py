"""report.html opened in headless Chromium: every image renders and the summary table is there.

Skipped only when chromium is absent outside CI; in CI (``CI`` set) a missing chromium fails."""

import os
import re
import shutil
import subprocess

import pytest

from ditbook.benchmark.report import build_report
from ditbook.benchmark.synthetic import make_synthetic_run

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)

# runs after load: writes each image's natural size and the summary rows into the DOM
PROBE = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = imgs.map(function (im, i) { return 'IMG ' + i + ' ' + im.naturalWidth + 'x' + im.naturalHeight; }).join('\\n')
    + '\\nIMAGES ' + imgs.length
    + '\\nSUMMARY_ROWS ' + (document.querySelectorAll('#summary-table tbody tr').length);
  document.body.appendChild(out);
});
</script>"""


def chromium_or_skip():
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed; in CI the Makefile must install Debian's chromium package")
    pytest.skip("chromium is not installed (apt-get install chromium); this test is required in CI")


def dump_dom(chromium: str, html_path, profile) -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", html_path.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_report_renders_in_headless_chromium(tmp_path):
    chromium = chromium_or_skip()
    run = make_synthetic_run(tmp_path, failed_stage="cache")
    report = build_report(run)
    text = report.read_text()
    n_img = len(re.findall(r"<img\b", text))
    assert n_img >= 7  # 4 plots, 2 sheets, and the notebooks' image outputs
    probed = tmp_path / "probed.html"
    probed.write_text(text.replace("</body>", PROBE + "</body>"))
    dom = dump_dom(chromium, probed, tmp_path / "profile")
    sizes = re.findall(r"IMG (\d+) (\d+)x(\d+)", dom)
    assert len(sizes) == n_img, dom[-2000:]
    broken = [i for i, w, h in sizes if int(w) == 0 or int(h) == 0]
    assert not broken, f"images that did not render: {broken}"
    rows = int(re.search(r"SUMMARY_ROWS (\d+)", dom).group(1))
    assert rows >= 4  # baseline, measured configurations, recorded rows
    assert 'id="summary-table"' in dom and 'id="failed-cache"' in dom


def test_probe_detects_a_broken_image(tmp_path):
    """The check can fail: an image that cannot load reports natural width 0."""
    chromium = chromium_or_skip()
    page = tmp_path / "broken.html"
    page.write_text('<html><body><img src="data:image/png;base64,AAAA"><table id="summary-table"><tbody>'
                    "<tr><td>x</td></tr></tbody></table>" + PROBE + "</body></html>")
    dom = dump_dom(chromium, page, tmp_path / "profile")
    assert re.search(r"IMG 0 0x0", dom)
