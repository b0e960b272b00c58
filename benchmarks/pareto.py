"""Equal-quality comparison against the peers (issue 16), the CPU part: quality and counted work of
cache-dit SCM slow/medium/fast, diffusers FirstBlockCache and MagCache and ditbook's static
schedules on the shipped reference model. See ``speedsuite.pareto_quality``.

    python3 benchmarks/pareto.py [--out docs/pareto_quality.json]
"""

from __future__ import annotations

from speedsuite.pareto_quality import main  # the script's folder is on the path; speedsuite adds lib/

if __name__ == "__main__":
    raise SystemExit(main())
