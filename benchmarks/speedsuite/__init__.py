"""The GPU speed suite used by the scripts in benchmarks/ (not part of the ditbook package).

Importing it makes ``ditbook`` importable from the repository's ``lib/`` when it is not installed
(a GPU host where only the wheels were staged); a ditbook already on the path wins."""
import sys
from pathlib import Path

_LIB = str(Path(__file__).resolve().parents[2] / "lib")
if _LIB not in sys.path:
    sys.path.append(_LIB)
