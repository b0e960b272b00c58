"""Regional ``torch.compile``: the transformer's repeated blocks compiled in place, optionally the image
decoder too; the one compile every stage uses, configured by ``runtime.compile`` (:class:`CompileSettings`).

diffusers' ``ModelMixin.compile_repeated_blocks`` where the class names its ``_repeated_blocks``,
else ``nn.Module.compile`` of every block of the block lists. Both set each block's
``_compiled_call_impl``; the undo puts back exactly what every module held. ``decoder``:
``pipe.vae.decoder`` compiled the same way (a pipeline without one keeps its blocks compiled).

The record (:class:`CompileRecord`) holds the one-time compile cost: the first call's time above
the median of the next ``probe_calls`` (later calls far above it: ``slow_later_calls``,
recompiles), plus the decoder's, timed at its first decode. Each application resets dynamo's
caches first (process-wide), so every configuration reports its own compile cost and none hits the
recompile limit an earlier one left (past it torch silently runs the blocks eagerly).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ..settings import boolean, integer, optional, setting, text
from . import register
from .technique import Handle, NothingDone, PipelineTechnique, Record

_MISSING = object()


@dataclass
class CompileSettings:
    """``runtime.compile`` as a mapping (``true``: these defaults; a string: the backend)."""

    backend: str = setting("inductor", text(), "torch.compile backend (aot_eager: traced without kernels, a CPU check)")
    mode: str | None = setting(None, optional(text()), "torch.compile mode (null: torch's default)")
    fullgraph: bool = setting(False, boolean(), "one graph per block, or an error")
    dynamic: bool | None = setting(None, optional(boolean()), "dynamic shapes (null: torch's default)")
    decoder: bool = setting(False, boolean(), "compile the image decoder too (pipe.vae.decoder)")
    probe_calls: int = setting(6, integer(2, 1000), "transformer calls timed after compiling (the one-time cost)")


@dataclass
class CompileRecord(Record):
    method: str = ""  # compile_repeated_blocks, or the block lists compiled
    regions: int = 0  # modules compiled
    backend: str = "inductor"
    decoder: dict = field(default_factory=dict)  # {compiled, module | reason, compile_s, ...}
    compile_s: float | None = None  # one-time cost: blocks (+ decoder)
    blocks_compile_s: float | None = None
    first_call_s: float | None = None
    steady_call_s: float | None = None
    probe_calls: int = 0
    slow_later_calls: int = 0


def compile_regions(transformer, *, backend: str = "inductor", mode: str | None = None,
                    fullgraph: bool = False, dynamic: bool | None = None) -> tuple[Callable[[], None], str, int]:
    """Compile the transformer's repeated blocks in place; returns (undo, method, regions)."""
    kwargs = _compile_kwargs(backend, mode, dynamic, fullgraph=fullgraph)
    saved, undo = _saved_compiled_state(transformer)
    try:
        if getattr(transformer, "_repeated_blocks", None) and hasattr(transformer, "compile_repeated_blocks"):
            transformer.compile_repeated_blocks(**kwargs)
            method = "compile_repeated_blocks"
        else:
            from ..arch.static import find_block_lists

            lists, _ = find_block_lists(transformer)
            if not lists:
                raise ValueError(f"{type(transformer).__name__} has no block lists to compile regionally")
            for _, blocks in lists:
                for block in blocks:
                    block.compile(**kwargs)
            method = "block lists: " + ", ".join(name for name, _ in lists)
    except BaseException:
        undo()
        raise
    regions = sum(1 for m, before in saved
                  if m.__dict__.get("_compiled_call_impl") is not None and before in (_MISSING, None))
    return undo, method, regions


def _compile_kwargs(backend, mode, dynamic, **extra) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": backend, **extra}
    if mode is not None:
        kwargs["mode"] = mode
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    return kwargs


def _saved_compiled_state(root) -> tuple[list, Callable[[], None]]:
    """What every module under ``root`` holds as ``_compiled_call_impl`` now, and the undo that
    puts exactly that back."""
    saved = [(m, m.__dict__.get("_compiled_call_impl", _MISSING)) for m in root.modules()]

    def undo() -> None:
        for m, before in saved:
            if before is _MISSING:
                m.__dict__.pop("_compiled_call_impl", None)
            else:
                m._compiled_call_impl = before

    return saved, undo


class DecoderUnavailable(RuntimeError):
    """The pipeline has no decoder module to compile (the reason is the message)."""


def decoder_module(pipe):
    """``pipe.vae.decoder`` when it is a module, else raise :class:`DecoderUnavailable` naming what is missing."""
    import torch

    vae = getattr(pipe, "vae", None)
    if not isinstance(vae, torch.nn.Module):
        raise DecoderUnavailable(f"{type(pipe).__name__} has no vae module, so there is no decoder to compile")
    dec = getattr(vae, "decoder", None)
    if not isinstance(dec, torch.nn.Module):
        raise DecoderUnavailable(f"{type(vae).__name__} has no decoder module to compile")
    return dec


def compile_decoder(pipe, *, backend: str = "inductor", mode: str | None = None,
                    dynamic: bool | None = None) -> tuple[Callable[[], None], str]:
    """Compile ``pipe.vae.decoder`` in place (``nn.Module.compile``); returns (undo, what). The
    undo puts back exactly what every module of the decoder held."""
    dec = decoder_module(pipe)
    _, undo = _saved_compiled_state(dec)
    try:
        dec.compile(**_compile_kwargs(backend, mode, dynamic))
    except BaseException:
        undo()
        raise
    return undo, f"{type(pipe.vae).__name__}.decoder"


@dataclass
class CompileProbe:
    """Synchronized times of the first calls after compiling."""

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


def compile_settings(value) -> CompileSettings | None:
    """``runtime.compile`` read: false/null -> None (off), true -> defaults, a string -> that backend,
    a mapping -> those settings; an unknown key or a wrong value raises ``ValueError`` naming it."""
    from ..settings import parse_section

    if not value:
        return None
    if isinstance(value, CompileSettings):
        return value
    if value is True:
        return CompileSettings()
    if isinstance(value, str):
        return CompileSettings(backend=value)
    settings, problems = parse_section(CompileSettings, value, "runtime.compile")
    if problems:
        raise ValueError("; ".join(f"{k}: {m}" for k, m in problems))
    return settings


@register
class Compile(PipelineTechnique):
    name = "compile"
    kind = "compile"
    family = "regional torch.compile"
    Settings = CompileSettings
    order = 30  # last: its twins compile every configuration before it, fp8 ones included

    @classmethod
    def applicable(cls, facts) -> str | None:
        if not getattr(facts, "block_lists", None):
            return "no block lists to compile regionally"
        return None

    @classmethod
    def apply(cls, pipe, settings: CompileSettings, *, reset: bool = True, probe: bool = True) -> Handle:
        # long: the compile, its cost probes and their undo share state; kept together so each undo sits by its apply
        import torch

        from ..hooks import wrap_method

        rec = CompileRecord(cls.name, backend=str(settings.backend))
        if settings.decoder:
            rec.decoder = {"compiled": False, "reason": "not applied yet"}
        if reset:
            torch._dynamo.reset()
        tr = pipe.transformer
        undo_blocks, rec.method, rec.regions = compile_regions(tr, backend=settings.backend, mode=settings.mode,
                                                                fullgraph=settings.fullgraph, dynamic=settings.dynamic)
        undos: list[Callable[[], None]] = [undo_blocks]
        probes: dict = {}
        try:
            if settings.decoder:
                try:
                    undo_dec, what = compile_decoder(pipe, backend=settings.backend, mode=settings.mode,
                                                     dynamic=settings.dynamic)
                    undos.append(undo_dec)
                    rec.decoder = {"compiled": True, "module": what}
                except DecoderUnavailable as e:
                    rec.decoder = {"compiled": False, "reason": str(e)}
            if probe:
                p = next(tr.parameters(), None)
                cuda = p is not None and p.device.type == "cuda"
                probes["blocks"] = CompileProbe(settings.probe_calls, cuda)
                undos.append(wrap_method(tr, "compile-cost-probe", probes["blocks"]).remove)
                if rec.decoder.get("compiled"):  # the decoder compiles at its first decode: timed there
                    probes["decoder"] = CompileProbe(settings.probe_calls, cuda)
                    undos.append(wrap_method(pipe.vae, "decoder-compile-cost-probe", probes["decoder"],
                                             attr="decode").remove)
        except BaseException:
            _undo_all(undos)
            raise

        def record() -> CompileRecord:
            if "blocks" in probes:  # the summary's keys are the record's fields
                vars(rec).update({"slow_later_calls": 0, **probes["blocks"].summary()})
            if "decoder" in probes:
                dec = probes["decoder"].summary()
                rec.decoder.update(compile_s=dec["compile_s"], first_decode_s=dec["first_call_s"],
                                   steady_decode_s=dec["steady_call_s"])
                if rec.compile_s is not None and dec["compile_s"] is not None:
                    rec.blocks_compile_s = rec.compile_s
                    rec.compile_s = round(rec.compile_s + dec["compile_s"], 4)
            return rec

        return Handle(lambda: _undo_all(undos), record)

    @classmethod
    def check(cls, record: CompileRecord | None) -> None:
        """Fails when no module was compiled."""
        if record is None or record.regions == 0:
            raise NothingDone("compile: no module was compiled")

    @classmethod
    def requested(cls, card) -> CompileSettings | None:
        return compile_settings(card.runtime.compile)

    @classmethod
    def variants(cls, ctx, pipe, configs: list, settings: CompileSettings, log=print, **_) -> list:
        """A compiled twin of the baseline and of every configuration (one refused with its reason
        gets none)."""
        from ..configuration import baseline_config

        return [compiled_config(c, settings) for c in [baseline_config()] + list(configs) if not c.refused]


def _undo_all(undos: list) -> None:
    for undo in reversed(undos):
        undo()


def compiled_config(cfg, settings: CompileSettings | None = None, *, reset: bool = True, **values):
    """``cfg`` with its transformer blocks compiled (name ``<cfg.name>+compile``, same family and
    gates; the bare baseline's twin is family ``compile``), its record filled into
    ``params["compile"]`` as it runs. ``values``: :class:`CompileSettings` fields, for ``settings``."""
    from ..configuration import Config

    settings = settings or Compile.settings(**values)
    stats: dict = {"backend": str(settings.backend), "mode": settings.mode, "fullgraph": settings.fullgraph}

    def apply(pipe):
        undo_cfg = cfg.apply(pipe)
        try:
            handle = Compile.apply(pipe, settings, reset=reset)
        except BaseException:
            if undo_cfg is not None:
                undo_cfg()
            raise

        def undo():
            stats.update({k: v for k, v in handle.record().to_dict().items() if k != "technique"})
            handle.undo()
            if undo_cfg is not None:
                undo_cfg()
        return undo

    family = "compile" if cfg.family == "baseline" else cfg.family
    return Config(f"{cfg.name}+compile", family, apply, params={**cfg.params, "compile": stats}, gates=cfg.gates,
                  notes=(cfg.notes + "; " if cfg.notes else "") + "repeated blocks compiled (regional torch.compile)"
                  + ("; the image decoder compiled" if settings.decoder else ""))


__all__ = ["Compile", "CompileProbe", "CompileRecord", "CompileSettings", "DecoderUnavailable", "compile_decoder",
           "compile_regions", "compile_settings", "compiled_config", "decoder_module"]
