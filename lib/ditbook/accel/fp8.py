"""fp8 as a measured configuration: torchao's float8 dynamic activation + float8 weight
quantization (e4m3, per-row scales, ``torch._scaled_mm``, through ``torchao.quantization.quantize_``)
of the ``nn.Linear`` layers inside the transformer's repeated blocks whose features are multiples of
16; the embedders and the final projection stay in the model's dtype (small, and the most sensitive
to precision). ``apply_fp8(..., layers=...)`` quantizes only some, chosen by
:func:`layer_sensitivity` on the model itself, never by name.

Undo, exactly: each chosen layer's instance ``__dict__`` and ``_parameters`` are copied (shallow)
before quantizing and put back, so the original Parameter objects return untouched. Where fp8
cannot run it is refused before anything changes (:func:`fp8_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import register
from ._forecast import main_tensor
from .technique import Handle, NothingDone, PipelineTechnique, Record

FP8_MIN_CAPABILITY = (8, 9)
TORCHAO_VERSION = "0.18.0"  # the version pinned in pyproject.toml, and the GPU wheel bundle's


class Fp8Refused(RuntimeError):
    """fp8 cannot run here (the message says why)."""


def fp8_refusal(device: torch.device | str, *, capability: tuple[int, int] | None = None) -> str | None:
    """Why fp8 linear layers cannot run on ``device`` (None when they can). ``capability``
    stands in for the GPU's (tests)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"fp8 needs a CUDA GPU of compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                f"(fp8 tensor cores: Ada, Hopper or newer); the transformer is on {dev.type}")
    if capability is None:
        if not torch.cuda.is_available():
            return "fp8 needs CUDA, and torch sees no CUDA device"
        capability = torch.cuda.get_device_capability(dev)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return (f"fp8 needs compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}; this GPU has "
                f"{capability[0]}.{capability[1]}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        return f"torchao is not installed (pip install torchao=={TORCHAO_VERSION})"
    return None


def fp8_refusal_for(module: torch.nn.Module) -> str | None:
    """:func:`fp8_refusal` for the device ``module``'s parameters are on (a module without any: the CPU)."""
    p = next(module.parameters(), None)
    return fp8_refusal(p.device if p is not None else "cpu")


def fp8_layers(transformer: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names of the linear layers fp8 applies to, names left out because of their shape)."""
    from ..arch.static import find_block_lists

    lists, _ = find_block_lists(transformer)
    roots = [name for name, _ in lists] if lists else [""]
    chosen, odd = [], []
    for name, m in transformer.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if not any(name == r or name.startswith(r + ".") or r == "" for r in roots):
            continue
        (chosen if m.in_features % 16 == 0 and m.out_features % 16 == 0 else odd).append(name)
    return chosen, odd


def float8_config():
    """torchao's float8 dynamic-activation, float8-weight config (per-row scales, e4m3)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    from torchao.quantization.quantize_.common import KernelPreference

    return Float8DynamicActivationFloat8WeightConfig(activation_dtype=torch.float8_e4m3fn,
                                                     weight_dtype=torch.float8_e4m3fn,
                                                     granularity=(PerRow(), PerRow()),
                                                     kernel_preference=KernelPreference.TORCH)


def apply_fp8(transformer: torch.nn.Module, *, config: Any = None, check_device: bool = True,
              layers: Iterable[str] | None = None) -> tuple[Callable[[], None], dict]:
    """Quantize the chosen linear layers in place; returns (undo, record). ``layers``: only these of
    :func:`fp8_layers`' choice (another name is an error); None: all. ``config``: another torchao
    config (tests on the CPU use one); ``check_device=False`` only with such a config."""
    if check_device:
        why = fp8_refusal_for(transformer)
        if why:
            raise Fp8Refused(why)
    all_chosen, odd = fp8_layers(transformer)
    chosen = all_chosen if layers is None else [n for n in all_chosen if n in set(layers)]
    if layers is not None and (unknown := sorted(set(layers) - set(all_chosen))):
        raise ValueError(f"fp8: not block linears fp8 can take: {', '.join(unknown[:5])}")
    if not chosen and layers is None:
        raise Fp8Refused(f"fp8: {type(transformer).__name__} has no linear layer in its blocks whose features are "
                         "multiples of 16")
    from torchao.quantization import quantize_

    modules = dict(transformer.named_modules())
    saved = {n: (dict(modules[n].__dict__), dict(modules[n]._parameters)) for n in chosen}
    wanted = set(chosen)

    def undo() -> None:
        for n, (attrs, params) in saved.items():
            m = modules[n]
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._parameters.clear()
            m._parameters.update(params)

    cfg = config if config is not None else float8_config()
    try:
        quantize_(transformer, cfg, filter_fn=lambda m, fqn: fqn in wanted)
    except BaseException:
        undo()
        raise
    changed = sum(1 for n in chosen if modules[n].weight is not saved[n][1]["weight"])
    record = {"library": "torchao", "config": type(cfg).__name__, "layers": len(chosen), "quantized": changed,
              "left_out": odd, "scope": "linear layers of the block lists"}
    if layers is not None:
        record["kept"] = [n for n in all_chosen if n not in set(chosen)]
    return undo, record


def capture_calls(transformer: torch.nn.Module, run: Callable[[], Any], every: int = 1) -> list[dict]:
    """The transformer's inputs (keyword form, tensors detached and copied) at every ``every``-th
    of its calls while ``run()`` runs: the inputs a sensitivity measurement replays."""
    import inspect

    names = list(inspect.signature(transformer.forward).parameters)
    calls: list[dict] = []
    seen = [0]

    def keep(v):
        return v.detach().clone() if torch.is_tensor(v) else v

    def hook(module, args, kwargs):
        if seen[0] % every == 0:
            calls.append({**{n: keep(a) for n, a in zip(names, args)}, **{k: keep(v) for k, v in kwargs.items()}})
        seen[0] += 1

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls


def layer_sensitivity(transformer: torch.nn.Module, calls: list[dict], layers: list[str],
                      quantize: Callable[[str], Callable[[], None]]) -> list[dict]:
    """How much each layer alone changes the transformer's output: ``quantize(name)`` (returning its
    undo) puts that one layer in low precision, the recorded ``calls`` (:func:`capture_calls`) are
    rerun, and the error is the output's relative L2 distance to the unquantized output, the worst
    over the calls. One record per layer, most sensitive first."""
    with torch.inference_mode():
        ref = [main_tensor(transformer(**c)).float() for c in calls]
        out = []
        for name in layers:
            undo = quantize(name)
            try:
                errs = [float((main_tensor(transformer(**c)).float() - r).norm() / r.norm().clamp_min(1e-12))
                        for c, r in zip(calls, ref)]
            finally:
                undo()
            out.append({"layer": name, "rel_error": max(errs), "mean_rel_error": sum(errs) / len(errs)})
    return sorted(out, key=lambda r: -r["rel_error"])


@dataclass
class Fp8Settings:
    layers: list | None = None  # these block linears only (None: every one fp8 can take)


@dataclass
class Fp8Record(Record):
    library: str = "torchao"
    config: str = ""
    candidates: int = 0  # block linears fp8 can take
    quantized: int = 0  # whose weight was replaced by an fp8 tensor
    left_out: list = field(default_factory=list)  # by shape (features not multiples of 16)
    kept: list = field(default_factory=list)  # candidates left in the model's dtype (a ``layers`` subset)


@register
class Fp8(PipelineTechnique):
    """torchao float8 (e4m3, per-row scales) on the block linears; refused where fp8 cannot run."""

    name = "fp8"
    kind = "quantize"
    family = "fp8 block linears (torchao float8)"
    Settings = Fp8Settings
    order = 20  # after the attention backend, before compile (a compiled twin fuses the quantization)

    @classmethod
    def applicable(cls, facts) -> str | None:
        """``facts``: the transformer (its device decides)."""
        return fp8_refusal_for(facts)

    @classmethod
    def apply(cls, pipe, settings: Fp8Settings, *, config: Any = None) -> Handle:
        undo, rec = apply_fp8(pipe.transformer, config=config, check_device=config is None, layers=settings.layers)
        record = Fp8Record(cls.name, config=rec["config"], candidates=rec["layers"] + len(rec.get("kept", [])),
                           quantized=rec["quantized"], left_out=list(rec["left_out"]), kept=list(rec.get("kept", [])))
        return Handle(undo, lambda: record)

    @classmethod
    def check(cls, record: Fp8Record | None) -> None:
        """Fails when no block linear was quantized."""
        if record is None or record.quantized == 0:
            raise NothingDone("fp8: no block linear was quantized")

    @classmethod
    def requested(cls, card) -> Fp8Settings | None:
        return Fp8Settings() if card.benchmark.fp8 else None

    @classmethod
    def variants(cls, ctx, pipe, configs: list, settings: Fp8Settings, log=print, **_) -> list:
        """fp8 twins of the baseline and of every configuration not already in fp8; where fp8 cannot
        run, one ``fp8`` row refused with the reason (so the table records it)."""
        from ..configuration import Config, baseline_config

        why = fp8_refusal_for(pipe.transformer)
        if why:
            log(f"fp8: refused: {why}")

            def refuse(_pipe):
                raise Fp8Refused(why)
            return [Config("fp8", "fp8", refuse, params={"fp8": {"refused": why}}, notes="refused on this device",
                           refused=why)]
        return [fp8_config(c) for c in [baseline_config()] + list(configs) if "fp8" not in c.params]


def fp8_config(cfg=None):
    """A benchmark :class:`~ditbook.configuration.Config`: ``cfg`` (default: the baseline) with the
    transformer's block linears in fp8 (name ``<cfg.name>+fp8``; gates: the family's, fp8 alone
    is judged like a cache, by the cache gates, since it changes the result by design)."""
    from ..configuration import Config, baseline_config

    inner = cfg or baseline_config()
    record: dict = {}

    def apply(pipe):
        why = fp8_refusal_for(pipe.transformer)
        if why:
            raise Fp8Refused(why)
        undo_inner = inner.apply(pipe)
        try:
            undo_fp8, rec = apply_fp8(pipe.transformer, check_device=False)
        except BaseException:
            if undo_inner is not None:
                undo_inner()
            raise
        record.update(rec)

        def undo():
            undo_fp8()
            if undo_inner is not None:
                undo_inner()
        return undo

    family = "fp8" if inner.family == "baseline" else inner.family
    return Config(f"{inner.name}+fp8" if inner.name != "baseline" else "fp8", family, apply,
                  params={**inner.params, "fp8": record}, gates=inner.gates,
                  notes=(inner.notes + "; " if inner.notes else "") + "block linears in fp8 (torchao float8)")


__all__ = ["FP8_MIN_CAPABILITY", "Fp8Refused", "apply_fp8", "capture_calls", "float8_config", "fp8_config",
           "fp8_layers", "fp8_refusal", "fp8_refusal_for",
           "layer_sensitivity"]
