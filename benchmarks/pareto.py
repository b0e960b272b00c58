"""Equal-quality comparison against the peers (issue 16), the CPU part: quality and counted work of
cache-dit SCM slow/medium/fast, diffusers FirstBlockCache and MagCache and ditbook's static
schedules on the shipped reference model. See ``speedsuite.pareto_quality``.

    python3 benchmarks/pareto.py [--out docs/pareto_quality.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "benchmarks", ROOT / "lib"):  # appended: a ditbook already on the path (PYTHONPATH) wins
    if str(p) not in sys.path:
        sys.path.append(str(p))

from speedsuite.pareto_quality import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
