"""Equal-quality comparison against the peers (issue 16), the GPU part: every peer point and every
dominating ditbook point of docs/pareto_quality.json timed at the FLUX.1-dev shape in one process.
See ``speedsuite.pareto_speed``.

    python3 benchmarks/pareto_gpu.py --out OUT --compile            # one H200, 1024², 28 steps, bf16
    python3 benchmarks/pareto_gpu.py --out OUT --tiny --device cpu  # the same code on a CPU
"""

from __future__ import annotations

from speedsuite.pareto_speed import main  # the script's folder is on the path; speedsuite adds lib/

if __name__ == "__main__":
    raise SystemExit(main())
