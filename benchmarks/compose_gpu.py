"""Speed, composed, on one GPU (issue 16): eager, a static cache schedule, compile, fp8 and CUDA
graphs of the computed steps, alone and together, at the FLUX.1-dev shape, with each row's quality
on the reference model. See ``speedsuite.compose`` for the rows and what is measured.

    python3 benchmarks/compose_gpu.py --out OUT                      # one H200, ~6 minutes
    python3 benchmarks/compose_gpu.py --out OUT --tiny --device cpu  # the code path on a CPU
"""

from __future__ import annotations

from speedsuite.compose import main  # the script's folder is on the path; speedsuite adds lib/

if __name__ == "__main__":
    raise SystemExit(main())
