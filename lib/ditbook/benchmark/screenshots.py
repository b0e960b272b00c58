"""The README's screenshots of ``report.html``, taken from a run by a command, with a manifest that
says what they show (``ditbook screenshots [--run RUN_DIR]``, ``make screenshots``).

Headless Chromium shoots the run's ``report.html``: its first screen at 1280x800 and 1024x768, the
plot (``#plot``) and the grid (``#grid``) alone, into ``docs/`` with ``docs/screenshots.json`` (the
run, each PNG's sha256 and the first screen as read from the DOM). ``staleness`` compares a manifest
with the files, the README and what the current report code renders.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..runs import RunFolder

WINDOW = (1280, 800)
NARROW = (1024, 768)  # a smaller laptop screen: the first screen must read there too
SHOTS = {"report_first_screen.png": None, "report_first_screen_1024.png": None, "report_plot.png": "plot",
         "report_grid.png": "grid"}
WINDOWS = {"report_first_screen_1024.png": NARROW}  # the others: WINDOW
MANIFEST = "screenshots.json"
MAX_HEIGHT = 2400  # px: a part alone is shot whole up to this height

# runs after load: the first screen as text, written into the DOM for --dump-dom
SCREEN_PROBE = """<script>
window.addEventListener('load', function () {
  function text(sel) { var el = document.querySelector(sel); return el ? el.textContent.trim() : null; }
  var rows = Array.prototype.map.call(document.querySelectorAll('#checklist tbody tr'), function (tr) {
    return Array.prototype.map.call(tr.cells, function (td) { return td.textContent.trim(); });
  });
  var H = window.innerHeight, ids = [];
  Array.prototype.forEach.call(document.querySelectorAll('[id]'), function (el) {
    var r = el.getBoundingClientRect();
    if (r.height > 0 && r.top < H && el.id !== 'ditbook-screen') ids.push(el.id);
  });
  var heights = {};  // each part's height: from its heading to the next heading
  Array.prototype.forEach.call(document.querySelectorAll('body > h2[id]'), function (h) {
    var next = h.nextElementSibling;
    while (next && next.tagName !== 'H2') next = next.nextElementSibling;
    var end = next ? next.getBoundingClientRect().top : document.body.getBoundingClientRect().bottom;
    heights[h.id] = Math.ceil(end - h.getBoundingClientRect().top);
  });
  var out = document.createElement('pre');
  out.id = 'ditbook-screen';
  out.textContent = JSON.stringify({verdict: text('#verdict b'), gates: text('#gates'), rule: text('#rule'),
                                    checklist: rows, ids: ids, heights: heights});
  document.body.appendChild(out);
});
</script>"""

# runs after load, on a copy: only one part of the page is left (its heading up to the next
# heading), so it is what the first screen shows (a headless screenshot is of the page's top)
ONLY_PART = """<script>
window.addEventListener('load', function () {
  var el = document.getElementById(%s);
  if (!el) return;
  while (el.parentElement !== document.body) el = el.parentElement;
  while (el.previousElementSibling) el.previousElementSibling.remove();
  var next = el.nextElementSibling;
  while (next && next.tagName !== 'H2') next = next.nextElementSibling;
  while (next) { var after = next.nextElementSibling; next.remove(); next = after; }
});
</script>"""


class ScreenshotError(RuntimeError):
    """No finished run, no report, or Chromium missing or failing."""


def find_chromium() -> str | None:
    """``$CHROMIUM``, else ``chromium`` on the PATH, else Debian's ``/usr/bin/chromium``."""
    found = os.environ.get("CHROMIUM") or shutil.which("chromium")
    return found or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


def chromium(args: list[str], page: Path, profile: Path, size=WINDOW, timeout: float = 120) -> str:
    """Run headless Chromium on ``page`` with ``args`` (``--dump-dom``, ``--screenshot=...``); its stdout."""
    binary = find_chromium()
    if binary is None:
        raise ScreenshotError("chromium is not installed (make chromium)")
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--window-size={size[0]},{size[1]}", f"--user-data-dir={profile}",
           "--virtual-time-budget=5000", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ScreenshotError(f"chromium failed on {page}: {proc.stderr[-1500:]}")
    return proc.stdout


def _with_script(html_text: str, script: str, path: Path) -> Path:
    path.write_text(html_text.replace("</body>", script + "</body>", 1))
    return path


def first_screen(report: Path, work: Path) -> dict:
    """The first screen of ``report`` at 1280x800 as Chromium's DOM has it (``SCREEN_PROBE``)."""
    page = _with_script(Path(report).read_text(), SCREEN_PROBE, work / "probe.html")
    dom = chromium(["--dump-dom"], page, work / "profile")
    found = re.search(r'<pre id="ditbook-screen">(.*?)</pre>', dom, re.S)
    if found is None:
        raise ScreenshotError(f"the first-screen probe wrote nothing into {report}'s DOM")
    import html

    return json.loads(html.unescape(found.group(1)))


def structure(screen: dict) -> dict:
    """What the report code decides about the first screen, whatever the run's figures: the
    checklist's row labels, and the ids of the parts that start inside it, in page order, up to
    the checklist (what follows it moves with the length of the run's verdict text)."""
    ids = list(screen.get("ids", []))
    return {"checklist": [row[0] for row in screen.get("checklist", [])],
            "ids": ids[:ids.index("checklist") + 1] if "checklist" in ids else ids}


def newest_finished_run(outputs_root: str | Path) -> RunFolder:
    """The finished run created last under ``outputs_root`` (any model)."""
    runs = []
    for meta in Path(outputs_root).glob("*/*/run.json"):
        run = RunFolder(meta.parent)
        try:
            m = run.read_meta()
        except Exception:  # noqa: BLE001 - an unreadable run.json never hides the others
            continue
        if m.get("status") == "finished":
            runs.append((m.get("created", ""), meta.parent.name, run))
    if not runs:
        raise ScreenshotError(f"no finished run under {outputs_root} (make demo)")
    return sorted(runs, key=lambda r: r[:2])[-1][2]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _relative(path: str | None, cwd: str | None) -> str | None:
    """``path`` as the run's command named it from its working folder (``models/x.yaml``)."""
    try:
        return Path(path).relative_to(cwd).as_posix() if path and cwd else path
    except ValueError:
        return path


def take(run_dir: str | Path, docs: str | Path) -> dict:
    """The three screenshots of ``run_dir``'s ``report.html`` and their manifest, into ``docs``."""
    run = RunFolder(run_dir)
    report = run.path / "report.html"
    if not report.is_file():
        raise ScreenshotError(f"{report} is missing (ditbook report {run.path})")
    docs = Path(docs)
    docs.mkdir(parents=True, exist_ok=True)
    text = report.read_text()
    with tempfile.TemporaryDirectory(prefix="ditbook_shots_") as tmp:
        work = Path(tmp)
        screen = first_screen(report, work)
        heights = screen.pop("heights", {})
        for name, part in SHOTS.items():
            page = report if part is None else _with_script(text, ONLY_PART % json.dumps(part), work / f"{part}.html")
            # a part alone gets a window tall enough for all of it (the first screens are 1280x800, 1024x768)
            size = WINDOWS.get(name, WINDOW) if part is None else \
                (WINDOW[0], min(MAX_HEIGHT, max(WINDOW[1], heights.get(part, 0) + 80)))
            chromium([f"--screenshot={docs / name}"], page, work / f"profile-{part}", size=size)
    meta = run.read_meta()
    manifest = {"run": meta.get("run_id", run.path.name), "model": meta.get("model"),
                "card": _relative(meta.get("card_path"), meta.get("cwd")), "revision": (meta.get("source") or {}).get("revision"),
                "run_created": meta.get("created"), "taken": _dt.date.today().isoformat(),
                "window": list(WINDOW), "windows": {n: list(WINDOWS.get(n, WINDOW)) for n in SHOTS},
                "command": "ditbook screenshots",
                "files": {name: sha256(docs / name) for name in SHOTS}, "first_screen": screen}
    (docs / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def staleness(manifest: dict, docs: Path, readme: str, current: dict) -> list[str]:
    """Why the screenshots in ``docs`` are not current, or []: a PNG whose hash is not the
    manifest's, a README caption that does not name the manifest's run, or a first screen whose
    structure (``structure``) is not what the report code renders now (``current``)."""
    out = [f"{name}: its sha256 is not the manifest's (regenerate: ditbook screenshots)"
           for name, digest in manifest.get("files", {}).items()
           if not (docs / name).is_file() or sha256(docs / name) != digest]
    if set(manifest.get("files", {})) != set(SHOTS):
        out.append(f"the manifest lists {sorted(manifest.get('files', {}))}, not {sorted(SHOTS)}")
    if not re.search(rf"\brun {re.escape(str(manifest.get('run')))}\b", readme):
        out.append(f"the README's caption does not name run {manifest.get('run')}")
    shown, now = structure(manifest.get("first_screen", {})), structure(current)
    for key in ("checklist", "ids"):
        if shown[key] != now[key]:
            out.append(f"first screen {key}: the screenshot shows {shown[key]}, the report code renders {now[key]}")
    return out
