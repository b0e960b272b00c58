"""Configurations measured compiled: regional ``torch.compile`` of the transformer's repeated
blocks on top of any configuration, with the one-time compile cost recorded beside its timing.

Regional compilation is ``ditbook.accel.compile.compile_regions`` (re-exported here), the one helper the
parallel stage's ``+compile`` uses too: diffusers' ``compile_repeated_blocks`` where the class names
its repeated blocks, else every block of the inspected block lists; the undo is exact.

``compiled_config(cfg)`` wraps a :class:`~ditbook.configuration.Config`: its ``apply`` first applies
``cfg`` (a cache, an attention backend, ...), then compiles the blocks, then times the first
``probe_calls`` transformer calls (synchronized): the one-time compile cost is the first call's
time above the median of the others (a cache's cheap steps make a minimum too low); later calls
far above that median are counted as ``slow_later_calls`` (recompiles).
The figures land in ``params["compile"]`` (filled in place while the configuration runs, so the
benchmark's result row carries them). ``decoder=True`` compiles the pipeline's image decoder too
(``ditbook.accel.compile.compile_decoder``): with a cache that computes few steps, the decode is a
visible share of the run (about 8% of a cached FLUX.1-dev image on an H200). A pipeline without a
decoder module keeps its blocks compiled and records why in ``params["compile"]["decoder"]``. The
decoder compiles at its first decode, so its cost is timed there (a probe on ``vae.decode``) and
added to ``compile_s`` (``blocks_compile_s`` and ``decoder.compile_s`` keep the parts).

Each apply resets dynamo's caches first (``torch._dynamo.reset()``, process-wide): every compiled
configuration pays, and reports, its own compile cost, and no configuration can hit the
recompile limit left by an earlier one (past it torch silently runs the blocks eagerly).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from .compile import DecoderUnavailable, compile_decoder, compile_regions  # (also the parallel stage's +compile)


@dataclass
class CompileProbe:
    """Synchronized times of the first transformer calls after compiling."""

    calls: int
    cuda: bool

    def __post_init__(self):
        self.times: list[float] = []

    def __call__(self, original, *args, **kwargs):
        if len(self.times) >= self.calls:
            return original(*args, **kwargs)
        self._sync()
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        self._sync()
        self.times.append(time.perf_counter() - t0)
        return out

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def summary(self) -> dict:
        if not self.times:
            return {"compile_s": None, "first_call_s": None, "steady_call_s": None, "probe_calls": 0}
        rest = self.times[1:] or self.times
        steady = statistics.median(rest)
        return {"compile_s": round(max(0.0, self.times[0] - steady), 4), "first_call_s": round(self.times[0], 4),
                "steady_call_s": round(steady, 5), "probe_calls": len(self.times),
                # later calls far above the steady time: recompiles (their cost is not in compile_s)
                "slow_later_calls": sum(1 for t in self.times[1:] if t > 3 * steady)}


def compiled_config(cfg, *, backend: str = "inductor", mode: str | None = None, fullgraph: bool = False,
                    dynamic: bool | None = None, probe_calls: int = 6, reset: bool = True, decoder: bool = False):
    """``cfg`` with its transformer blocks compiled (name ``<cfg.name>+compile``, same family and
    gates; the bare baseline's twin is family ``compile``); ``decoder``: the image decoder too."""
    # long: apply and its undo share the compile handles and both probes; kept together so each undo sits by its apply
    import torch

    from ..configuration import Config
    from ..hooks import wrap_method

    stats: dict = {"backend": backend if isinstance(backend, str) else type(backend).__name__, "mode": mode,
                   "fullgraph": fullgraph}
    if decoder:
        stats["decoder"] = {"compiled": False, "reason": "not applied yet"}

    def apply(pipe):
        undo_cfg = cfg.apply(pipe)
        undo_compile = wrap = undo_decoder = decode_wrap = decode_probe = None
        try:
            if reset:
                torch._dynamo.reset()
            tr = pipe.transformer
            t0 = time.perf_counter()
            undo_compile, method, regions = compile_regions(tr, backend=backend, mode=mode, fullgraph=fullgraph,
                                                            dynamic=dynamic)
            if decoder:
                try:
                    undo_decoder, what = compile_decoder(pipe, backend=backend, mode=mode, dynamic=dynamic)
                    stats["decoder"] = {"compiled": True, "module": what}
                except DecoderUnavailable as e:
                    stats["decoder"] = {"compiled": False, "reason": str(e)}
            stats.update(method=method, regions=regions, wrap_s=round(time.perf_counter() - t0, 4))
            p = next(tr.parameters(), None)
            cuda = p is not None and p.device.type == "cuda"
            probe = CompileProbe(probe_calls, cuda)
            wrap = wrap_method(tr, "compile-cost-probe", probe)
            if undo_decoder is not None:  # the decoder compiles at its first decode: timed there, outside its graph
                decode_probe = CompileProbe(probe_calls, cuda)
                decode_wrap = wrap_method(pipe.vae, "decoder-compile-cost-probe", decode_probe, attr="decode")
        except BaseException:
            if wrap is not None:
                wrap.remove()
            if undo_decoder is not None:
                undo_decoder()
            if undo_compile is not None:
                undo_compile()
            if undo_cfg is not None:
                undo_cfg()
            raise

        def undo():
            blocks = probe.summary()
            stats.update(blocks)
            if decode_probe is not None:
                dec = decode_probe.summary()
                stats["decoder"].update(compile_s=dec["compile_s"], first_decode_s=dec["first_call_s"],
                                        steady_decode_s=dec["steady_call_s"])
                decode_wrap.remove()
                if blocks["compile_s"] is not None and dec["compile_s"] is not None:
                    # the configuration's one-time cost: blocks and decoder
                    stats.update(blocks_compile_s=blocks["compile_s"],
                                 compile_s=round(blocks["compile_s"] + dec["compile_s"], 4))
            wrap.remove()
            if undo_decoder is not None:
                undo_decoder()
            undo_compile()
            if undo_cfg is not None:
                undo_cfg()
        return undo

    family = "compile" if cfg.family == "baseline" else cfg.family
    gates = cfg.gates  # None: the family's gates (compile alone: the parallel gates, see settings.FAMILY_SECTION)
    return Config(f"{cfg.name}+compile", family, apply, params={**cfg.params, "compile": stats}, gates=gates,
                  notes=(cfg.notes + "; " if cfg.notes else "") + "repeated blocks compiled (regional torch.compile)"
                  + ("; the image decoder compiled" if decoder else ""))


def compile_options(value) -> dict | None:
    """The benchmark section's ``compile`` key: false/None (off), true (inductor), a backend name,
    or a mapping of ``compiled_config`` keywords (backend, mode, fullgraph, dynamic, probe_calls, decoder)."""
    if not value:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        return {"backend": value}
    if isinstance(value, dict):
        allowed = {"backend", "mode", "fullgraph", "dynamic", "probe_calls", "decoder"}
        bad = set(value) - allowed
        if bad:
            raise ValueError(f"benchmark.compile: unknown keys {sorted(bad)} (allowed: {sorted(allowed)})")
        return dict(value)
    raise ValueError(f"benchmark.compile: expected a bool, a backend name or a mapping, got {value!r}")


__all__ = ["CompileProbe", "compile_options", "compile_regions", "compiled_config"]
