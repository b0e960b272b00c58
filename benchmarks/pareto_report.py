"""Equal-quality comparison against the peers (issue 16), the table "peer point -> dominating ditbook point" and the Pareto plot (PNG) from the quality and speed files.
See ``speedsuite.pareto_report``.

    python3 benchmarks/pareto_report.py --speed OUT/pareto_speed.json   # writes OUT/pareto.md, OUT/pareto.png
"""

from __future__ import annotations

from speedsuite.pareto_report import main  # the script's folder is on the path; speedsuite adds lib/

if __name__ == "__main__":
    raise SystemExit(main())
