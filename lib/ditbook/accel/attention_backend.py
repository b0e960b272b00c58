"""The attention backend per model and device: measure what diffusers' dispatcher offers, keep
the correct ones, apply the fastest (with an exact undo of each processor's ``_attention_backend``).

1. diffusers' own checks say whether each registered backend can run here (package requirements,
   its constraints on sample q/k/v of this model's shapes, dtype and device); hub kernels
   (``*_hub``) download code and are not tried unless ``allow_hub=True``;
2. each backend that passed is checked against the default one on one attention call (where a
   wrong kernel shows at once) and on the whole transformer output (PSNR), then timed on one
   transformer call; a backend that fails either check, or raises, is rejected with the reason;
3. a second, interleaved timing round of the correct backends confirms the pick.

A model whose attention does not go through the dispatcher (it calls
``scaled_dot_product_attention`` itself) gets ``applicable=False`` with the reason.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..settings import FAMILY_SECTION, SECTIONS, Gates, ParallelSettings
from ..timing import Clock
from . import register
from ._forecast import main_tensor
from .technique import Handle, NothingDone, PipelineTechnique, Record

# another backend must not change the result: both checks default to the parallel gates' PSNR
# (bf16 kernels agree to > 50 dB; zeros or swapped heads give < 20 dB); the benchmark passes the card's
DEFAULT_OUTPUT_PSNR = ParallelSettings().gates.psnr
DEFAULT_KERNEL_PSNR = ParallelSettings().gates.psnr


# -- which modules go through the dispatcher ---------------------------------------------------
def _attention_modules(transformer) -> list[tuple[str, Any]]:
    """Modules that hold an attention processor (diffusers' ``Attention`` / ``AttentionModuleMixin``)."""
    return [(n, m) for n, m in transformer.named_modules() if getattr(m, "processor", None) is not None]


def dispatch_processors(transformer) -> list[tuple[str, Any]]:
    """(module name, processor) of every processor that reads ``_attention_backend``."""
    return [(n, m.processor) for n, m in _attention_modules(transformer) if hasattr(m.processor, "_attention_backend")]


def direct_sdpa_modules(transformer) -> list[str]:
    """Modules outside the dispatcher whose class code calls ``scaled_dot_product_attention``."""
    from ..cp.attention import _calls_sdpa, _dispatch_aware

    return [n for n, m in transformer.named_modules()
            if n and not _dispatch_aware(m) and _calls_sdpa(m)
            and not any(_calls_sdpa(c) for c in m.children())]


def applicability(transformer) -> tuple[bool, str]:
    """Whether choosing a dispatcher backend changes this model's attention, and why (not)."""
    aware = dispatch_processors(transformer)
    direct = direct_sdpa_modules(transformer)
    if not aware:
        if direct:
            return False, (f"not applicable: the model calls SDPA directly ({len(direct)} modules, e.g. "
                           f"{direct[0]}); diffusers' dispatcher never sees its attention")
        return False, "not applicable: no attention module goes through diffusers' dispatcher"
    if direct:
        return True, (f"{len(aware)} processors use the dispatcher; {len(direct)} modules call SDPA directly "
                      "and keep their own kernel")
    return True, f"{len(aware)} processors use the dispatcher"


# -- which backends can run here ---------------------------------------------------------------
def _registry():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return AttentionBackendName, _AttentionBackendRegistry


def default_backend() -> str:
    """The backend a processor with ``_attention_backend=None`` uses (the registry's active one)."""
    _, reg = _registry()
    active = reg._active_backend
    return getattr(active, "value", str(active))


def _backend_in_effect(transformer) -> str:
    """The backend this model's processors use now: one set on all of them, else the registry's."""
    current = {getattr(p._attention_backend, "value", p._attention_backend) for _, p in dispatch_processors(transformer)}
    if len(current) == 1 and None not in current:
        return str(next(iter(current)))
    return default_backend()


def sample_qkv(heads: int, kv_heads: int, head_dim: int, device, dtype, seq_len: int = 16, seed: int = 0):
    """Random query/key/value in the dispatcher's layout (batch, seq, heads, head_dim)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, seq_len, h, head_dim, generator=g, device="cpu").to(device, dtype)
                 for h in (heads, kv_heads, kv_heads))


def kernel_output(name: str, q, k, v) -> torch.Tensor:
    """One attention call through diffusers' dispatcher with backend ``name``."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(q, k, v, backend=name, enable_gqa=k.shape[2] != q.shape[2])


def backend_problem(name: str, q, k, v, *, allow_hub: bool = False) -> str | None:
    """Why backend ``name`` cannot run on these tensors (None: diffusers' checks pass)."""
    from diffusers.models.attention_dispatch import _check_attention_backend_requirements

    names, reg = _registry()
    member = names(name)
    if member.value.endswith("_hub") and not allow_hub:
        return "hub kernel: downloads code at first use; not tried (allow_hub=False)"
    try:
        _check_attention_backend_requirements(member)
    except Exception as exc:  # noqa: BLE001 - the package check's message is the reason
        return f"{type(exc).__name__}: {exc}"
    for check in reg._constraints.get(member, []):
        try:
            check(query=q, key=k, value=v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None)
        except Exception as exc:  # noqa: BLE001
            return f"constraint {getattr(check, '__name__', 'check')}: {exc}"
    return None


def model_heads(transformer, report=None) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) from the inspection's facts, else the attention modules."""
    if report is not None and report.attention.heads and report.attention.head_dim:
        a = report.attention
        return int(a.heads), int(a.kv_heads or a.heads), int(a.head_dim)
    for _, m in _attention_modules(transformer):
        heads = getattr(m, "heads", None)
        inner = getattr(getattr(m, "to_q", None), "out_features", None)
        kv_inner = getattr(getattr(m, "to_k", None), "out_features", None)
        if heads and inner:
            hd = inner // heads
            return int(heads), int((kv_inner or inner) // hd), int(hd)
    raise ValueError("cannot tell the attention heads: no inspection report and no diffusers attention module")


# -- applying a backend with an exact undo -----------------------------------------------------
def apply_backend(transformer, name: str) -> Callable[[], None]:
    """Set ``name`` on every dispatch-aware processor of this transformer (diffusers'
    ``set_attention_backend``); the returned undo restores each processor's previous value and the
    registry's active backend (``set_attention_backend`` also sets that one, process-wide)."""
    _, reg = _registry()
    saved = [(p, p._attention_backend) for _, p in dispatch_processors(transformer)]
    if not saved:
        raise ValueError("no processor of this model reads _attention_backend: " + applicability(transformer)[1])
    active = reg._active_backend

    def undo() -> None:
        for proc, before in saved:
            proc._attention_backend = before
        reg.set_active_backend(active)

    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # set_attention_backend warns "experimental" on every call
    try:
        transformer.set_attention_backend(name)
    except BaseException:
        undo()
        raise
    finally:
        quiet.setLevel(level)
    return undo


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class OutputAgreement:
    psnr: float  # dB over the reference's value range
    max_abs: float
    rel_err: float  # ||out - ref|| / ||ref||
    finite: bool

    def passes(self, min_psnr: float) -> bool:
        return self.finite and self.psnr >= min_psnr


def output_agreement(out: torch.Tensor, ref: torch.Tensor) -> OutputAgreement:
    a, b = out.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != b.shape:
        return OutputAgreement(float("-inf"), float("inf"), float("inf"), False)
    finite = bool(torch.isfinite(a).all())
    span = float(b.max() - b.min()) or 1.0
    mse = float(((a - b) ** 2).mean())
    psnr = 200.0 if mse == 0 else min(200.0, 10 * math.log10(span * span / mse))
    if not finite:
        psnr = float("-inf")
    rel = float((a - b).norm() / max(float(b.norm()), 1e-30))
    return OutputAgreement(round(psnr, 2), float((a - b).abs().max()), rel, finite)


@dataclass
class BackendRow:
    name: str
    status: str  # "correct", "rejected" (wrong output), "error" (raised), "unavailable", "default"
    reason: str = ""
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    confirm_median_s: float | None = None
    psnr: float | None = None
    max_abs: float | None = None
    rel_err: float | None = None
    kernel_psnr: float | None = None  # one attention call against the default backend's
    kernel_rel_err: float | None = None


@dataclass
class BackendTable:
    device: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    applicable: bool
    reason: str
    default: str
    min_psnr: float
    min_kernel_psnr: float
    kernel_seq_len: int
    rows: list[BackendRow] = field(default_factory=list)
    pick: str | None = None  # fastest correct backend in the selection round
    fastest_confirmed: str | None = None  # fastest correct backend in the confirmation round
    pick_over_fastest: float | None = None  # confirmation time of the pick / of the fastest
    speedup_vs_default: float | None = None  # confirmation time of the default / of the pick
    confirm_tolerance: float = 0.03  # the pick must be within this of the confirmation's fastest
    confirmed: bool = False  # the confirmation round agrees with the pick (else nothing is applied)
    noise_floor: dict | None = None  # the default backend run twice
    gqa: dict | None = None  # GQA paths (SDPA enable_gqa vs repeated K/V) where the model has GQA

    def row(self, name: str) -> BackendRow:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict:
        return asdict(self)


def _time_calls(call: Callable[[], Any], clock: Clock, n: int) -> list[float]:
    out = []
    for _ in range(n):
        a = clock.mark()
        call()
        b = clock.mark()
        clock.sync()
        out.append(clock.seconds(a, b))
    return out


def _empty_table(transformer, report, seq_len: int | None, min_psnr: float, min_kernel_psnr: float,
                 confirm_tolerance: float) -> BackendTable:
    """The table before any measurement: device, dtype, head shapes, applicability, backend in effect."""
    p = next(transformer.parameters())
    device, dtype = p.device, p.dtype
    ok, why = applicability(transformer)
    try:
        heads, kv_heads, head_dim = model_heads(transformer, report)
    except ValueError:
        if ok:
            raise
        heads = kv_heads = head_dim = 0  # not applicable: nothing is measured at these shapes
    if seq_len is None and report is not None and report.attention.image_seq_len:
        seq_len = report.attention.image_seq_len + (report.attention.text_seq_len or 0)
    seq_len = int(seq_len or 256)
    return BackendTable(str(device), str(dtype).replace("torch.", ""), heads, kv_heads, head_dim, ok, why,
                        _backend_in_effect(transformer), min_psnr, min_kernel_psnr, seq_len,
                        confirm_tolerance=confirm_tolerance)


def _backends_to_try(table: BackendTable, backends: list[str] | None, reg) -> list[str]:
    """The backends to measure, the default one first."""
    todo = [b.value if hasattr(b, "value") else str(b) for b in (backends or reg.list_backends())]
    if table.default in todo:
        todo.remove(table.default)
    return [table.default] + todo


def _judge_agreement(row: BackendRow, kagree, agree, min_kernel_psnr: float, min_psnr: float) -> None:
    """Reject a backend whose attention output or transformer output differs from the default's."""
    if not kagree.passes(min_kernel_psnr):
        row.status = "rejected"
        row.reason = (f"attention output differs from the default backend's on the same inputs: "
                      f"PSNR {kagree.psnr} dB < {min_kernel_psnr} dB" if kagree.finite
                      else "attention output holds NaN/Inf")
    elif not agree.passes(min_psnr):
        row.status = "rejected"
        row.reason = (f"transformer output differs from the default backend's: PSNR {agree.psnr} dB "
                      f"< {min_psnr} dB" if agree.finite else "transformer output holds NaN/Inf")


def _measure_backend(transformer, row: BackendRow, call: Callable[[], Any], qkv, kernel_ref, ref, clock: Clock, *,
                     allow_hub: bool, warmup: int, repeats: int, min_psnr: float, min_kernel_psnr: float) -> bool:
    """Fill ``row``: unavailable, an error, rejected, or correct with its times (then True)."""
    name = row.name
    q, k, v = qkv
    problem = backend_problem(name, q, k, v, allow_hub=allow_hub)
    if problem:
        row.reason = problem
        return False
    try:
        undo = apply_backend(transformer, name)
    except Exception as exc:  # noqa: BLE001
        row.status, row.reason = "error", f"set_attention_backend: {type(exc).__name__}: {exc}"
        return False
    correct = False
    try:
        kagree = output_agreement(kernel_output(name, q, k, v), kernel_ref)
        row.kernel_psnr, row.kernel_rel_err = kagree.psnr, kagree.rel_err
        out = main_tensor(call())
        agree = output_agreement(out, ref)
        row.psnr, row.max_abs, row.rel_err = agree.psnr, agree.max_abs, agree.rel_err
        _judge_agreement(row, kagree, agree, min_kernel_psnr, min_psnr)
        for _ in range(max(warmup - 1, 0)):
            call()
        ts = _time_calls(call, clock, repeats)
        row.median_s, row.min_s, row.max_s = statistics.median(ts), min(ts), max(ts)
        if row.status != "rejected":
            row.status = "correct"
            correct = True
    except Exception as exc:  # noqa: BLE001 - a backend that raises is a finding
        row.status, row.reason = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        undo()
    return correct


def _confirm_pick(transformer, table: BackendTable, runnable: list[str], call: Callable[[], Any], clock: Clock,
                  rounds: int, confirm_tolerance: float) -> None:
    """An independent, interleaved confirmation round: is the pick still the fastest?"""
    times: dict[str, list[float]] = {n: [] for n in runnable}
    for _ in range(rounds):
        for name in runnable:
            undo = apply_backend(transformer, name)
            try:
                call()  # settle after the switch
                times[name] += _time_calls(call, clock, 1)
            finally:
                undo()
    for name in runnable:
        table.row(name).confirm_median_s = statistics.median(times[name])
    conf = {n: table.row(n).confirm_median_s for n in runnable}
    table.fastest_confirmed = min(conf, key=conf.get)
    fastest = conf[table.fastest_confirmed]
    table.pick_over_fastest = round(conf[table.pick] / fastest, 4) if fastest > 0 else 1.0
    if table.default in conf:
        table.speedup_vs_default = round(conf[table.default] / conf[table.pick], 4) if conf[table.pick] > 0 \
            else None
    table.confirmed = table.pick_over_fastest <= 1.0 + confirm_tolerance


def measure_backends(transformer, call: Callable[[], Any], *, report=None, backends: list[str] | None = None,
                     warmup: int = 2, repeats: int = 5, confirm_repeats: int | None = None,
                     min_psnr: float = DEFAULT_OUTPUT_PSNR, min_kernel_psnr: float = DEFAULT_KERNEL_PSNR,
                     seq_len: int | None = None, allow_hub: bool = False, gqa: bool = True,
                     confirm_tolerance: float = 0.03, clock: Clock | None = None, log: Callable[[str], None] = print) -> BackendTable:
    """Time ``call()`` (one transformer call) under each backend diffusers offers here, check each
    output against the default backend's, pick the fastest correct one (not applied). ``clock``:
    ``mark()``, ``sync()``, ``seconds(a, b)`` (default: CUDA events on a GPU, else ``perf_counter``).
    The pick is ``confirmed`` only when the confirmation round finds it within ``confirm_tolerance``
    of the fastest correct backend; otherwise the device is too noisy and nothing is applied."""
    table = _empty_table(transformer, report, seq_len, min_psnr, min_kernel_psnr, confirm_tolerance)
    if not table.applicable:
        log(f"attention backends: {table.reason}")
        return table
    p = next(transformer.parameters())
    device, dtype = p.device, p.dtype
    heads, kv_heads, head_dim, seq_len = table.heads, table.kv_heads, table.head_dim, table.kernel_seq_len
    clock = clock or Clock(device.type == "cuda")
    names, reg = _registry()
    q, k, v = sample_qkv(heads, kv_heads, head_dim, device, dtype, seq_len)
    todo = _backends_to_try(table, backends, reg)

    with torch.inference_mode():
        ref = main_tensor(call()).clone()
        again = main_tensor(call())
        table.noise_floor = asdict(output_agreement(again, ref))
        kernel_ref = kernel_output(table.default, q, k, v).clone()
        runnable: list[str] = []
        for name in todo:
            row = BackendRow(name, "unavailable")
            table.rows.append(row)
            if _measure_backend(transformer, row, call, (q, k, v), kernel_ref, ref, clock, allow_hub=allow_hub,
                                warmup=warmup, repeats=repeats, min_psnr=min_psnr, min_kernel_psnr=min_kernel_psnr):
                runnable.append(name)
            log(f"  {name:24s} {row.status:10s} "
                f"{'' if row.median_s is None else f'{row.median_s * 1e3:9.3f} ms'} {row.reason}")
        if runnable:
            table.pick = min(runnable, key=lambda n: table.row(n).median_s)
            log(f"attention backends: selection picks {table.pick}; confirming")
            rounds = confirm_repeats if confirm_repeats is not None else repeats
            _confirm_pick(transformer, table, runnable, call, clock, rounds, confirm_tolerance)
    if gqa and kv_heads != heads:
        from ..cp.attention import time_gqa

        table.gqa = time_gqa(heads, kv_heads, head_dim, seq_len, device=str(device), dtype=table.dtype,
                             repeats=repeats, warmup=warmup).to_dict()
    log(f"attention backends: pick {table.pick} (confirmation: fastest {table.fastest_confirmed}, "
        f"pick/fastest {table.pick_over_fastest}, {'confirmed' if table.confirmed else 'NOT confirmed'})")
    return table


# -- the pipeline side: one captured transformer call, and a benchmark configuration -------------
def capture_transformer_call(pipe, run: Callable[[], Any], index: int = 0) -> tuple[tuple, dict]:
    """The positional and keyword arguments of the ``index``-th transformer call of ``run()``."""
    from ..hooks import wrap_method

    seen: list[tuple[tuple, dict]] = []

    def record(original, *args, **kwargs):
        if len(seen) <= index:
            seen.append((args, dict(kwargs)))
        return original(*args, **kwargs)

    with torch.inference_mode(), wrap_method(pipe.transformer, "capture-call", record):
        run()
    if len(seen) <= index:
        raise RuntimeError(f"the pipeline called the transformer {len(seen)} times; asked for call {index}")
    return seen[index]


def measure_pipeline_backends(pipe, run: Callable[[], Any], *, report=None, **kw) -> BackendTable:
    """:func:`measure_backends` on the transformer call a pipeline run makes first."""
    args, kwargs = capture_transformer_call(pipe, run)
    tr = pipe.transformer
    return measure_backends(tr, lambda: tr(*args, **kwargs), report=report, **kw)


def backend_config(name: str, table: BackendTable | None = None):
    """The picked backend as a benchmark configuration (family ``attention``; judged by the same
    image gates as every other row)."""
    from ..configuration import Config

    params = {"backend": name}
    if table is not None:
        params.update(pick_over_fastest=table.pick_over_fastest, speedup_vs_default=table.speedup_vs_default)
    return Config(f"attention:{name}", "attention", lambda pipe: apply_backend(pipe.transformer, name),
                  params=params, gates=None,  # the "attention" family: parallel gates
                  notes="fastest correct attention backend of diffusers' dispatcher on this device")


BACKENDS_FILE = "attention_backends.json"  # the measured table, in the benchmark's folder


def backend_gate(card) -> Gates:
    """The gates that judge another attention backend: the card's section for the ``attention``
    family (``settings.FAMILY_SECTION``); that section's defaults without a card."""
    name = FAMILY_SECTION["attention"]
    section = getattr(card, name, None) if card is not None else None
    return section.gates if section is not None else SECTIONS[name]().gates


@dataclass
class AttentionBackendSettings:
    backend: str = "auto"  # "auto": measured here, the fastest correct one; or a backend name


@dataclass
class AttentionBackendRecord(Record):
    backend: str = ""
    processors: int = 0  # dispatch-aware processors whose backend was set


@register
class AttentionBackend(PipelineTechnique):
    """diffusers' attention dispatcher set per processor to one backend (card ``benchmark.attention_backend``)."""

    name = "attention_backend"
    kind = "attention"
    family = "attention backend (diffusers dispatcher)"
    Settings = AttentionBackendSettings
    order = 10  # first: fp8 and compiled twins are made of its row too

    @classmethod
    def applicable(cls, facts) -> str | None:
        """``facts``: the transformer."""
        ok, why = applicability(facts)
        return None if ok else why

    @classmethod
    def apply(cls, pipe, settings: AttentionBackendSettings) -> Handle:
        undo = apply_backend(pipe.transformer, settings.backend)
        record = AttentionBackendRecord(cls.name, backend=settings.backend,
                                        processors=len(dispatch_processors(pipe.transformer)))
        return Handle(undo, lambda: record)

    @classmethod
    def check(cls, record: AttentionBackendRecord | None) -> None:
        """Fails when no attention processor goes through diffusers' dispatcher."""
        if record is None or record.processors == 0:
            raise NothingDone("attention backend: no processor goes through diffusers' dispatcher")

    @classmethod
    def requested(cls, card) -> AttentionBackendSettings | None:
        value = card.benchmark.attention_backend
        return AttentionBackendSettings(str(value)) if value else None

    @classmethod
    def variants(cls, ctx, pipe, configs: list, settings: AttentionBackendSettings, log=print, **measure_kw) -> list:
        """A named backend: its row. ``auto``: the backends measured on the pipeline's first
        transformer call (written to ``benchmark/attention_backends.json``); the fastest correct one
        gets a row when the confirmation round agrees with the pick and it is not the default."""
        if settings.backend != "auto":
            return [backend_config(settings.backend)]
        from ..render import call_kwargs, cases, make_generator

        _, prompt, seed = cases(ctx.card)[0]
        kwargs = call_kwargs(pipe, ctx.card)
        psnr = backend_gate(ctx.card).psnr  # the card's gates, not the default ones
        measure_kw = {"min_psnr": psnr, "min_kernel_psnr": psnr, **measure_kw}
        table = measure_pipeline_backends(pipe, lambda: pipe(prompt=prompt, generator=make_generator(seed), **kwargs),
                                          log=log, **measure_kw)
        data = table.to_dict()
        path = ctx.run.stage_dir("benchmark") / BACKENDS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        if not table.applicable:
            log(f"attention backend: {table.reason}")
            return []
        if table.pick is not None and not table.confirmed:
            log(f"attention backend: not applied: the confirmation round puts the pick {table.pick} at "
                f"{table.pick_over_fastest}x the fastest ({table.fastest_confirmed}), beyond "
                f"{table.confirm_tolerance:.0%}: timings on this device are not stable enough to choose")
            return []
        if table.pick is None or table.pick == table.default:
            log(f"attention backend: the default ({table.default}) is the fastest correct one; nothing to add")
            return []
        return [backend_config(table.pick, table)]


__all__ = ["AttentionBackend", "AttentionBackendRecord", "AttentionBackendSettings", "BACKENDS_FILE", "backend_gate",
           "DEFAULT_KERNEL_PSNR", "DEFAULT_OUTPUT_PSNR", "BackendRow", "BackendTable", "OutputAgreement", "applicability", "apply_backend",
           "backend_config", "backend_problem", "capture_transformer_call", "default_backend", "direct_sdpa_modules",
           "dispatch_processors", "measure_backends", "measure_pipeline_backends", "output_agreement"]
