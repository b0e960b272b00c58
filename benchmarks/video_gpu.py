"""Speed at a Wan2.1-T2V video shape on one GPU (issue 16, item 5): eager, a static cache schedule,
compile and both, true CFG, the denoising loop timed. See ``speedsuite.video`` for what is measured.

    python3 benchmarks/video_gpu.py --out OUT                         # one H200, Wan 1.3B shape
    python3 benchmarks/video_gpu.py --out OUT --tiny --device cpu    # the code path on a CPU
"""

from __future__ import annotations

from speedsuite.video import main  # the script's folder is on the path; speedsuite adds lib/

if __name__ == "__main__":
    raise SystemExit(main())
