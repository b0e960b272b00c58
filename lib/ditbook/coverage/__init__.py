"""Coverage: every transformer class the installed diffusers exports, integrated the way the
stages integrate a new model, on a tiny random instance. Per class (``check_class``):

1. **build** (``coverage.build``): a tiny instance from the ``__init__`` defaults shrunk by generic
   rules (``shrink_config``: layer counts 2, widths divided by one common factor, ties between
   widths, heads and rotary axes kept); a constructor that fails on a setting left None gets one
   derived from the code (``ctor_repair``). None builds: ``refused``.
2. **inputs** (``coverage.inputs``): candidates by parameter name and config (``make_inputs``);
   when none runs, inputs from the forward's data flow (``coverage.dataflow``, packed joint
   sequences: ``coverage.layout``) repaired from the errors it raises (``coverage.repairs``); an
   error from the instance's own settings rebuilds it (``coverage.reconfig``); required state
   inputs are made where the code says how (``coverage.state``); both noted in the row's ``setup``.
3. **inspection** (``ditbook.inspect``): static report plus a traced call.
4. **cache adapter** and the dbcache strategy (``coverage.check``): caching off equals the plain
   forward (max abs diff <= 1e-5, fp32); caching on, over slowly changing inputs, gives finite
   outputs and really skips block evaluations.
5. **cp** (``coverage.cp``): the CP plan executed on 2 gloo ranks with the sharding check.

Outcomes: ``correct``; ``refused`` (a named reason); ``crash`` (an exception that is not a named
refusal: a bug in ditbook, cache-dit or the probe); ``wrong`` (caching off differs, non-finite
output, or nothing skipped). This package is a probe run by ``benchmarks/coverage.py`` and the
tests: it imports the stage packages, and no stage package imports it.
"""

from .build import Refused, build_tiny, shrink_config, transformer_classes
from .check import STEPS, TOLERANCE, ClassOutcome, check_class, markdown, run_coverage, run_cp, totals
from .inputs import find_inputs, make_inputs, tiny_with_inputs

__all__ = ["ClassOutcome", "Refused", "build_tiny", "check_class", "find_inputs", "make_inputs", "markdown",
           "run_coverage", "run_cp", "shrink_config", "STEPS", "TOLERANCE", "tiny_with_inputs", "totals", "transformer_classes"]
