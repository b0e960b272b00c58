"""Equal-quality comparison against the peers (issue 16), the table "peer point -> dominating ditbook point" and the Pareto plot (PNG) from the quality and speed files.
See ``speedsuite.pareto_report``.

    python3 benchmarks/pareto_report.py --speed OUT/pareto_speed.json   # writes OUT/pareto.md, OUT/pareto.png
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "benchmarks", ROOT / "lib"):  # appended: a ditbook already on the path (PYTHONPATH) wins
    if str(p) not in sys.path:
        sys.path.append(str(p))

from speedsuite.pareto_report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
