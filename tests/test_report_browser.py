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


def dump_dom(chromium: str, html_path, profile, size=(1280, 800)) -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--window-size={size[0]},{size[1]}",
           f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", html_path.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# runs after load, at 1280x800: where the verdict and the gates end, and every table whose
# visible box (the table, or the scrolling box around it) runs past the page width
LAYOUT_PROBE = """<script>
window.addEventListener('load', function () {
  var W = window.innerWidth, H = window.innerHeight, lines = ['VIEWPORT ' + W + 'x' + H];
  ['verdict', 'gates', 'checklist'].forEach(function (id) {
    var el = document.getElementById(id);
    lines.push('BOTTOM ' + id + ' ' + (el ? Math.round(el.getBoundingClientRect().bottom) : -1));
  });
  lines.push('PAGE_WIDTH ' + document.documentElement.scrollWidth);
  Array.prototype.forEach.call(document.querySelectorAll('table'), function (t, i) {
    var box = t, p = t.parentElement;
    while (p && p !== document.body) {
      var ov = getComputedStyle(p).overflowX;
      if (ov === 'auto' || ov === 'scroll' || ov === 'hidden') { box = p; break; }
      p = p.parentElement;
    }
    var right = Math.round(box.getBoundingClientRect().right);
    if (right > W) lines.push('OVERFLOW table ' + i + ' ' + (t.id || '') + ' right ' + right);
  });
  var out = document.createElement('pre'); out.id = 'layout'; out.textContent = lines.join('\\n');
  document.body.appendChild(out);
});
</script>"""


def layout(chromium, page, tmp_path) -> dict:
    dom = dump_dom(chromium, page, tmp_path / "profile")
    text = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S).group(1)
    return {"bottom": {k: int(v) for k, v in re.findall(r"BOTTOM (\w+) (-?\d+)", text)},
            "page_width": int(re.search(r"PAGE_WIDTH (\d+)", text).group(1)),
            "viewport": tuple(int(x) for x in re.search(r"VIEWPORT (\d+)x(\d+)", text).groups()),
            "overflow": re.findall(r"OVERFLOW .*", text)}


def with_probe(text: str, probe: str, path):
    path.write_text(text.replace("</body>", probe + "</body>"))
    return path


def test_report_renders_in_headless_chromium(tmp_path):
    chromium = chromium_or_skip()
    run = make_synthetic_run(tmp_path, failed_stage="cache")
    report = build_report(run)
    text = report.read_text()
    n_img = len(re.findall(r"<img\b", text))
    assert n_img >= 4  # the plot, the grid, the residual and scaling plots (notebook images link to them)
    dom = dump_dom(chromium, with_probe(text, PROBE, tmp_path / "probed.html"), tmp_path / "profile")
    sizes = re.findall(r"IMG (\d+) (\d+)x(\d+)", dom)
    assert len(sizes) == n_img, dom[-2000:]
    broken = [i for i, w, h in sizes if int(w) == 0 or int(h) == 0]
    assert not broken, f"images that did not render: {broken}"
    rows = int(re.search(r"SUMMARY_ROWS (\d+)", dom).group(1))
    assert rows >= 4  # baseline, measured configurations, recorded rows
    assert 'id="summary-table"' in dom and 'id="failed-cache"' in dom


def test_first_screen_has_the_verdict_and_gates_and_no_table_overflows(tmp_path):
    """At 1280x800 the verdict, the gates and the checklist end inside the first screen, the
    page does not scroll sideways, and no table runs past the page width."""
    chromium = chromium_or_skip()
    run = make_synthetic_run(tmp_path)
    text = build_report(run).read_text()
    got = layout(chromium, with_probe(text, LAYOUT_PROBE, tmp_path / "layout.html"), tmp_path)
    w, h = got["viewport"]
    # headless Chromium gives the page the window's width; its height may be less than the
    # window's (browser frame), which does not change the layout: the first screen is 800 px
    assert w == 1280 and h <= 800, got
    for item in ("verdict", "gates", "checklist"):
        assert 0 < got["bottom"][item] <= 800, (item, got)
    assert got["page_width"] <= w, got
    assert got["overflow"] == [], got


def test_layout_probe_sees_a_buried_verdict_and_a_wide_table(tmp_path):
    """The check can fail: a verdict below a tall block, and a wide table outside any scrolling
    box, are both reported."""
    chromium = chromium_or_skip()
    cells = "".join(f"<td>configuration_with_a_long_name_{i}</td>" for i in range(40))
    page = ("<html><body><div style='height:1200px'>stages first</div><div id='verdict'>Ship x</div>"
            "<span id='gates'>gates</span><table id='checklist'><tr><td>c</td></tr></table>"
            f"<table id='wide'><tr>{cells}</tr></table></body></html>")
    got = layout(chromium, with_probe(page, LAYOUT_PROBE, tmp_path / "bad.html"), tmp_path)
    assert got["bottom"]["verdict"] > 800
    assert any("wide" in o for o in got["overflow"]) and got["page_width"] > 1280


def test_probe_detects_a_broken_image(tmp_path):
    """The check can fail: an image that cannot load reports natural width 0."""
    chromium = chromium_or_skip()
    page = tmp_path / "broken.html"
    page.write_text('<html><body><img src="data:image/png;base64,AAAA"><table id="summary-table"><tbody>'
                    "<tr><td>x</td></tr></tbody></table>" + PROBE + "</body></html>")
    dom = dump_dom(chromium, page, tmp_path / "profile")
    assert re.search(r"IMG 0 0x0", dom)
