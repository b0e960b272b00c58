"""Coverage: every transformer class the installed diffusers exports, integrated the way the
stages integrate a new model, on a tiny random instance.

Per class (``check_class``):

1. **build** a tiny instance from its ``__init__`` defaults shrunk by generic rules
   (``shrink_config``): int parameters that count layers/blocks/depth become 2, every other int
   (and int tuple) of 32 or more is divided by one common factor (8, then 4, then 2), so the
   ratios between widths, head dims and RoPE axes stay what the class expects; layer-index
   lists keep their places among 2 layers; rotary axes that sum to the head dim keep doing so
   under a head cap, and axes left None become two halves of it. A constructor that fails on a
   parameter left None (``ctor_repair``, from the traceback's ``__init__`` frame) gets a value
   derived from the code: a tuple where it is subscripted by an int, else the value of the most
   similarly named parameter. A submodule the forward always calls but the defaults leave None
   gets the constructor flag that builds it; rotary axes stay even and keep their share of the
   head dim; when no rung runs, a model width the defaults leave unequal to heads x head dim is
   tied to it. A class that no factor builds is ``refused`` with the error.
2. **inputs** from the forward signature (``make_inputs``): the parameters are matched by name
   to tensors whose shapes come from the config (image latents as 4-D, 5-D or packed 3-D,
   text states with the width of a text/caption/joint/cross config entry, pooled vectors,
   timesteps, position ids); the first combination whose forward runs is kept. When none runs,
   ``find_inputs`` rebuilds each from the forward's data flow (``coverage.dataflow.forward_needs``:
   the first submodule each parameter reaches, how its shape is unpacked, its documented shape,
   its annotation) and repairs it from the errors the forward raises (a None parameter the code
   reads, a matrix product's width, index/mask dtypes, a rank, a text length or frame count a
   positional table fixes, a token grid too small, a named feature the forward reads from its dict
   input; see ``coverage.dataflow`` and ``coverage.repairs`` for the full list, with
   inputs built as diffusers' own pipeline builds them), a bounded number of times. A forward that
   takes one packed joint sequence described by its parts (an int total length, index tensors of
   each part's positions, per-item latents with a companion list of token grids) first gets
   inputs laid out consistently from its signature (``coverage.layout``). An error that
   comes from the instance's own settings (an optional dependency used only under a config flag,
   a list setting left None, rotary axes indexed past their end) rebuilds the class with the
   setting changed (``coverage.reconfig``); required state inputs of a running pipeline (a cache
   object, its mode string) are made where the code says how (``coverage.state``); both are
   recorded in the row's ``setup`` note (shown in the table's reason column). None runs:
   ``refused`` with the errors (the data-flow attempts' first), or with the optional dependency
   the forward lacks, or with the kv cache every diffusers pipeline passes this class.
3. **inspection** (``ditbook.inspect``): static report plus a traced call.
4. **cache adapter** (``build_cache_adapter``) and the dbcache strategy with caching off: every
   step's output equal to the plain forward (max abs diff <= 1e-5, fp32); then with caching on,
   several steps with slowly changing inputs: finite outputs and block evaluations really
   skipped (counted on the original blocks).
5. **cp**: ``coverage.cp.coverage_cp(transformer, args, kwargs)``: the CP plan executed on 2 gloo
   ranks with the sharding check ("not run" when it does not import).

Outcomes: ``correct``; ``refused`` (a named reason: ditbook declined to integrate); ``crash``
(an exception that is not a named refusal: a bug in ditbook, cache-dit or the probe);
``wrong`` (caching off differs from the plain forward, non-finite output, or nothing skipped).

Modules: ``build`` (step 1), ``inputs`` (step 2), ``dataflow`` (what the forward's code says about
its inputs), ``layout`` (packed joint sequences), ``repairs`` (one registered function per error kind), ``reconfig`` (constructor
settings per error kind), ``state`` (state inputs), ``check`` (steps 3-4, the table),
``cp`` (step 5). This package is a probe run by ``benchmarks/coverage.py`` and the tests: it
imports the stage packages, and no stage package imports it.
"""

from .build import Refused, build_tiny, shrink_config, transformer_classes
from .check import STEPS, TOLERANCE, ClassOutcome, check_class, markdown, run_coverage, run_cp, totals
from .inputs import find_inputs, make_inputs, tiny_with_inputs

__all__ = ["ClassOutcome", "Refused", "build_tiny", "check_class", "find_inputs", "make_inputs", "markdown",
           "run_coverage", "run_cp", "shrink_config", "STEPS", "TOLERANCE", "tiny_with_inputs", "totals", "transformer_classes"]
