"""The traced pass: a real short generation with hooks on every block and on the transformer, recording block call
conventions, streams, loop work, masks, attention calls, and the CFG style."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch import nn

from .patterns import E, H, match_pattern, signature_params
from .report import ArchReport, CallConvention


def _shape(v) -> list[int] | None:
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def _same(a, b) -> bool:
    """Identical object, or tensors (or tuples of them) with equal values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return all(_same(a[k], b[k]) for k in a)
    return a == b if isinstance(a, (int, float, str, bool, type(None))) else False


class AttentionCallMode(torch.overrides.TorchFunctionMode):
    """Reports query/key/mask of every ``scaled_dot_product_attention`` call to ``record``."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            self.record(q, k, mask, kwargs.get("enable_gqa", False))
        return func(*args, **kwargs)


class _Call:
    def __init__(self, path: str, index: int, bound: dict, positional: list[str], keywords: list[str]):
        self.path, self.index, self.bound = path, index, bound
        self.positional, self.keywords = positional, keywords
        self.outputs: list = []


class Tracer:
    """Hooks on a transformer; use as a context manager around the run."""

    def __init__(self, transformer: nn.Module, block_paths: list[str]):
        self.transformer = transformer
        self.paths = block_paths
        self.handles: list = []
        self.forwards = 0
        self.batches: list[int] = []
        self.guidance = False
        self.transformer_masks: set[str] = set()
        self.calls: list[_Call] = []  # first forward only
        self._pending: dict[int, _Call] = {}
        self.sdpa: list[dict] = []  # first forward only
        self.steps = 0
        self._active: list[tuple[str, int]] = []  # block calls in progress (path, index)
        self.latent_shape: list[int] | None = None  # the transformer's first tensor input, first call
        self._mode = None

    # -- hooks ----------------------------------------------------------------------------
    def _t_pre(self, module, args, kwargs):
        self.forwards += 1
        params = signature_params(module.forward)
        bound = {p.name: a for p, a in zip(params, args)}
        bound.update(kwargs)
        hs = bound.get(H, args[0] if args else None)
        if not isinstance(hs, torch.Tensor):  # the latents under another name: the first tensor argument
            hs = next((v for v in bound.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(hs, torch.Tensor):
            self.batches.append(int(hs.shape[0]))
            if self.forwards == 1:
                self.latent_shape = list(hs.shape)
        if isinstance(bound.get("guidance"), torch.Tensor):
            self.guidance = True
        for k, v in bound.items():
            if "mask" in k and isinstance(v, torch.Tensor):
                self.transformer_masks.add(k)
            if isinstance(v, dict):
                for kk, vv in v.items():
                    if "mask" in kk and isinstance(vv, torch.Tensor):
                        self.transformer_masks.add(f"{k}['{kk}']")

    def _b_pre(self, path, index):
        def hook(module, args, kwargs):
            if self.forwards != 1:
                return
            params = signature_params(module.forward)
            positional = [p.name for p in params[: len(args)]]
            bound = dict(zip(positional, args))
            bound.update(kwargs)
            call = _Call(path, index, bound, positional, list(kwargs))
            call.order = [p.name for p in params]
            self._pending[id(module)] = call
            self.calls.append(call)
            self._active.append((path, index))
        return hook

    def _b_post(self, module, args, kwargs, output):
        if self._active:
            self._active.pop()
        call = self._pending.pop(id(module), None)
        if call is not None:
            call.outputs = list(output) if isinstance(output, (tuple, list)) else [output]
            call.returns_tuple = isinstance(output, (tuple, list))

    def _record_attention(self, query, key, attn_mask=None, enable_gqa=False, via: str = "sdpa") -> None:
        if self.forwards == 1 and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
            self.sdpa.append({"q": list(query.shape), "k": list(key.shape), "mask": attn_mask is not None,
                              "enable_gqa": bool(enable_gqa), "via": via,
                              "block": self._active[-1] if self._active else None})

    def __enter__(self):
        self.handles.append(self.transformer.register_forward_pre_hook(self._t_pre, with_kwargs=True))
        for path in self.paths:
            for i, block in enumerate(self.transformer.get_submodule(path)):
                self.handles.append(block.register_forward_pre_hook(self._b_pre(path, i), with_kwargs=True))
                self.handles.append(block.register_forward_hook(self._b_post, with_kwargs=True))
        # a TorchFunctionMode for the traced call only: nothing in torch is rebound
        self._mode = AttentionCallMode(self._record_attention)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self.handles:
            h.remove()
        self.handles.clear()
        return False


def _flat_outputs(outputs: list) -> list:
    """A block's outputs with a returned dict's values in their place."""
    flat = []
    for o in outputs:
        flat += list(o.values()) if isinstance(o, dict) else [o]
    return flat


def stream_names(calls: list) -> list[str]:
    """Parameters through which a later block receives a value an earlier block returned."""
    names = []
    for prev, nxt in zip(calls, calls[1:]):
        outs = [o for o in _flat_outputs(prev.outputs) if isinstance(o, torch.Tensor)]
        for name in getattr(nxt, "order", nxt.positional):
            v = nxt.bound.get(name)
            if isinstance(v, torch.Tensor) and name not in names and any(_same(v, o) for o in outs):
                names.append(name)
    return names


def _image_tokens(latent_shape: list[int] | None) -> int | None:
    """Image tokens the latents make: N of (B, N, C) tokens, else the spatial size of (B, C, [F,] H, W)."""
    if not latent_shape or len(latent_shape) < 3:
        return None
    return latent_shape[1] if len(latent_shape) == 3 else math.prod(latent_shape[2:])


def _is_image_stream(value, spatial: int | None, tokens: bool) -> bool:
    if not isinstance(value, torch.Tensor) or value.ndim != 3 or spatial is None:
        return False
    n = int(value.shape[1])
    if tokens:
        return n == spatial
    return n > 0 and spatial % n == 0 and round((spatial // n) ** 0.5) ** 2 == spatial // n


def image_text_names(calls: list, latent_shape: list[int] | None) -> tuple[str | None, str | None]:
    """(image, text) stream parameter names; the image is the stream whose length the latents make."""
    first = calls[0]
    if H in first.bound:
        return H, (E if isinstance(first.bound.get(E), torch.Tensor) else None)
    names = stream_names(calls) or [n for n in getattr(first, "order", first.positional)
                                    if isinstance(first.bound.get(n), torch.Tensor)][:1]
    if len(names) < 2:
        return (names[0] if names else None), None
    spatial = _image_tokens(latent_shape)
    tokens = bool(latent_shape) and len(latent_shape) == 3
    images = [n for n in names[:2] if _is_image_stream(first.bound[n], spatial, tokens)]
    image = images[0] if len(images) == 1 else names[0]
    text = next(n for n in names[:2] if n != image)
    return image, text


def _streams(call: _Call):
    """(image-stream input, text-stream input) of a block call."""
    names = getattr(call, "stream_names", None)
    if names is not None:
        h, e = (call.bound.get(n) if n else None for n in names)
        return h, (e if isinstance(e, torch.Tensor) else None)
    h = call.bound.get(H)
    if h is None:  # the image stream under another name: the first tensor parameter
        h = next((call.bound[n] for n in getattr(call, "order", call.positional)
                  if isinstance(call.bound.get(n), torch.Tensor)), None)
    e = call.bound.get(E)
    return h, (e if isinstance(e, torch.Tensor) else None)


def _roles(call: _Call) -> list[str]:
    h, e = _streams(call)
    roles = []
    for out in _flat_outputs(call.outputs):
        if not isinstance(out, torch.Tensor) or not isinstance(h, torch.Tensor):
            roles.append("other")
            continue
        fits_h = out.shape == h.shape
        fits_e = e is not None and out.shape == e.shape
        if fits_h and fits_e:  # same shapes: the closer input wins
            dh = (out.float() - h.float()).abs().mean().item()
            de = (out.float() - e.float()).abs().mean().item()
            roles.append(H if dh <= de else E)
        elif fits_h:
            roles.append(H)
        elif fits_e:
            roles.append(E)
        else:
            roles.append("other")
    if roles.count(H) > 1 and len(roles) == 2 and E not in roles:
        roles = [H, "other"]
    return roles


def _out(call: _Call, role: str):
    return next((o for r, o in zip(_roles(call), _flat_outputs(call.outputs)) if r == role), None)


def analyse_calls(tracer: Tracer, transformer: nn.Module, report: ArchReport) -> None:
    """Fill the report's block lists, loop work and attention facts from the recorded calls."""
    outputs_seen: dict[int, tuple[str, int]] = {}
    for call in tracer.calls:
        for o in call.outputs:
            if isinstance(o, torch.Tensor):
                outputs_seen.setdefault(id(o), (call.path, call.index))
    # the block call just before each one, across lists: a chain, not a skip
    previous = {id(c): (p.path, p.index) for p, c in zip(tracer.calls, tracer.calls[1:])}
    reasons: list[str] = []
    masks: set[str] = {f"transformer.{m}" for m in tracer.transformer_masks}
    for b in report.block_lists:
        calls = [c for c in tracer.calls if c.path == b.path]
        if not calls:
            b.pattern_reason += "; the traced run never called these blocks"
            continue
        first = calls[0]
        image, text = image_text_names(calls, tracer.latent_shape)
        for c in calls:
            c.stream_names = (image, text)
        roles = _roles(first)
        h, e = _streams(first)
        varying = _varying_arguments(b.path, calls, reasons, set(stream_names(calls)) | {image, text})
        _masks_and_skip_connections(b.path, calls, outputs_seen, masks, reasons, previous)
        _work_between_calls(b.path, calls, reasons)
        block = transformer.get_submodule(b.path)[0]
        renamed = {H: image, E: text} if image and image != H else None
        match = match_pattern(block, roles, receives_encoder=e is not None, renamed=renamed)
        b.forward_pattern, b.compatible_patterns, b.pattern_reason = match.pattern, match.compatible, match.reason
        b.pattern_source = "traced"
        b.call = CallConvention(
            positional=list(first.positional), keywords=list(first.keywords), outputs=len(first.outputs),
            returns_tuple=bool(getattr(first, "returns_tuple", False)),
            output_roles=roles,
            input_shapes={k: _shape(v) for k, v in first.bound.items() if isinstance(v, torch.Tensor)},
            output_shapes=[_shape(o) or [] for o in first.outputs], calls_per_forward=len(calls),
            varying_arguments=varying)
        if b is report.block_lists[0]:
            if isinstance(h, torch.Tensor) and h.ndim == 3:
                report.attention.image_seq_len = int(h.shape[1])
            if e is not None and e.ndim == 3:
                report.attention.text_seq_len = int(e.shape[1])
    report.loop_extra_work_reasons = list(dict.fromkeys(reasons + report.loop_extra_work_reasons))
    report.loop_extra_work = bool(report.loop_extra_work_reasons)
    _sdpa_facts(tracer, report.attention, masks)
    _rope_tensors(tracer, report)
    report.attention.masks = sorted(masks)


def _varying_arguments(path: str, calls: list, reasons: list, streams: set | None = None) -> list[str]:
    """Non-stream block arguments missing from some calls or new per call."""
    varying: list[str] = []
    names_all = set().union(*(set(c.bound) for c in calls))
    for name in sorted(names_all - {H, E} - (streams or set())):
        present = [c.index for c in calls if name in c.bound]
        if len(present) != len(calls):
            varying.append(name)
            reasons.append(f"{path}: argument '{name}' is passed to blocks {present} only (per-index term)")
            continue
        vals = [c.bound[name] for c in calls]
        if not all(_same(vals[0], v) for v in vals[1:]):
            varying.append(name)
            reasons.append(f"{path}: argument '{name}' takes a new value per block (per-index term)")
    return varying


def _masks_and_skip_connections(path: str, calls: list, outputs_seen: dict, masks: set, reasons: list,
                                previous: dict | None = None) -> None:
    """Mask arguments, and arguments that are an earlier (not the preceding) call's output."""
    for c in calls:
        for name, v in c.bound.items():
            if "mask" in name and isinstance(v, torch.Tensor):
                masks.add(f"{path}.{name}")
            if isinstance(v, dict):
                masks.update(f"{path}.{name}['{k}']" for k, vv in v.items()
                             if "mask" in k and isinstance(vv, torch.Tensor))
            if name not in (H, E) and isinstance(v, torch.Tensor) and id(v) in outputs_seen:
                src = outputs_seen[id(v)]
                if src != (c.path, c.index - 1) and src != (previous or {}).get(id(c)):
                    reasons.append(f"{path}[{c.index}]: argument '{name}' is the output of {src[0]}[{src[1]}] "
                                   f"(skip connection)")


def _work_between_calls(path: str, calls: list, reasons: list) -> None:
    """Streams that change between consecutive block calls: the loop does work in between."""
    for prev, nxt in zip(calls, calls[1:]):
        if nxt.index != prev.index + 1:
            continue
        nh, ne = _streams(nxt)
        ph_out = _out(prev, H)
        if ph_out is not None and nh is not None and not _same(ph_out, nh):
            reasons.append(f"{path}: hidden_states changed between block {prev.index} and {nxt.index}: "
                           f"the loop does work between the calls")
        pe_out = _out(prev, E) if E in _roles(prev) else _streams(prev)[1]
        if pe_out is not None and ne is not None and not _same(pe_out, ne):
            reasons.append(f"{path}: encoder_hidden_states changed between block {prev.index} and {nxt.index}")


def _sdpa_facts(tracer: Tracer, att, masks: set) -> None:
    """Attention facts from the recorded scaled-dot-product calls: count, GQA, heads, kind, mask."""
    att.sdpa_calls = len(tracer.sdpa)
    if tracer.sdpa:
        if any(s["mask"] for s in tracer.sdpa):
            masks.add("scaled_dot_product_attention.attn_mask")
        q, k = tracer.sdpa[0]["q"], tracer.sdpa[0]["k"]
        if len(q) == 4 and len(k) == 4:
            att.native_gqa = any(s["k"][1] < s["q"][1] or s["enable_gqa"] for s in tracer.sdpa)
            if att.native_gqa:
                att.kv_heads = min(s["k"][1] for s in tracer.sdpa)
                att.heads = max(s["q"][1] for s in tracer.sdpa)
            lens = {(s["q"][2], s["k"][2]) for s in tracer.sdpa}
            img, txt = att.image_seq_len, att.text_seq_len
            cross = [lk for lq, lk in lens if lq != lk]
            if cross:
                att.cross_attention_len = cross[0]
            if img and txt and any(lq == lk == img + txt for lq, lk in lens):
                att.kind = "joint"
            elif cross and att.kind != "joint":
                att.kind = "cross"
            elif att.kind == "unknown" and any(lq == lk for lq, lk in lens):
                att.kind = "self"
            # no attention module to read them from: the traced call's query says
            att.heads = att.heads or q[1]
            att.head_dim = att.head_dim or q[3]
        if att.heads and att.kv_heads:
            att.gqa_ratio = round(att.heads / att.kv_heads, 3)


def _promote_attention_lists(tracer: Tracer, transformer: nn.Module, report: ArchReport, candidates: list[str]) -> None:
    """Lists whose blocks called attention in the traced run are block lists, whatever the attention is made of."""
    from .static import add_block_lists

    called = {s["block"][0] for s in tracer.sdpa if s.get("block")}
    found = [p for p in candidates if p in called]
    add_block_lists(transformer, report, found, "block list by its traced attention calls "
                                               "(scaled_dot_product_attention inside every block call)")
    tracer.calls = [c for c in tracer.calls if c.path not in set(candidates) - set(found)]


def _position_table(v, lengths: set[int], head_dim: int) -> bool:
    """A precomputed rotary table: an axis of an attention's length followed by one of head_dim (/ 2)."""
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_position_table(x, lengths, head_dim) for x in v)
    if not isinstance(v, torch.Tensor) or v.ndim < 2 or not v.is_floating_point():
        return False
    dims = list(v.shape)
    return any(d in lengths and any(e in (head_dim, head_dim // 2) for e in dims[i + 1:])
               for i, d in enumerate(dims))


def _rope_tensors(tracer: Tracer, report: ArchReport) -> None:
    """RoPE passed to the blocks as a precomputed per-token table, the same for every block."""
    att = report.attention
    if att.rope or not tracer.sdpa or len(tracer.sdpa[0]["q"]) != 4:
        return
    head_dim = tracer.sdpa[0]["q"][3]
    lengths = {s["q"][2] for s in tracer.sdpa if len(s["q"]) == 4}
    for b in report.block_lists:
        calls = [c for c in tracer.calls if c.path == b.path]
        if not calls:
            continue
        streams = set(getattr(calls[0], "stream_names", ()) or ()) | set(stream_names(calls)) | {H, E}
        for name, v in calls[0].bound.items():
            if name in streams or not all(name in c.bound and _same(c.bound[name], v) for c in calls):
                continue
            if _position_table(v, lengths, head_dim):
                att.rope = True
                report.notes.append(f"RoPE: {b.path} blocks receive the precomputed table '{name}' "
                                    f"({_table_text(v if isinstance(v, torch.Tensor) else v[0])})")
                return


def _table_text(v) -> str:
    return f"tensor{_shape(v)}" if isinstance(v, torch.Tensor) else type(v).__name__


def trace_calls(transformer: nn.Module, run: Callable[[], Any], report: ArchReport | None = None,
                scheduler=None, steps: int | None = None) -> ArchReport:
    """Run ``run()`` with hooks on ``transformer`` and fold what it saw into ``report``."""
    if report is None:
        from .static import inspect_transformer

        report = inspect_transformer(transformer)
    from .static import candidate_lists

    known = [b.path for b in report.block_lists]
    candidates = [p for p, _ in candidate_lists(transformer, known)]
    tracer = Tracer(transformer, known + candidates)
    counting = None
    if scheduler is not None:
        from ..hooks import wrap_method

        def counting_step(original, *a, **kw):
            tracer.steps += 1
            return original(*a, **kw)

        counting = wrap_method(scheduler, "count-steps", counting_step, attr="step")  # this instance; removed below
    try:
        with tracer, torch.no_grad():
            run()
    finally:
        if counting is not None:
            counting.remove()
    _promote_attention_lists(tracer, transformer, report, candidates)
    analyse_calls(tracer, transformer, report)
    cfg = report.cfg
    cfg.transformer_calls = tracer.forwards
    cfg.batch_per_call = max(tracer.batches) if tracer.batches else None
    if not tracer.steps and steps:  # no scheduler step to count (an own loop): the call's steps
        tracer.steps = int(steps)
    if tracer.steps:
        cfg.steps_traced = tracer.steps
        cfg.calls_per_step = round(tracer.forwards / tracer.steps, 3)
        if cfg.calls_per_step >= 2:
            cfg.style = "separate"
        elif cfg.batch_per_call and cfg.batch_per_call >= 2:
            cfg.style = "batched"
        elif tracer.guidance:
            cfg.style = "distilled"
        else:
            cfg.style = "none"
    report.traced = True
    tracer.calls.clear()
    return report


def trace_pipeline(pipe, card, steps: int = 2, size: int | None = None, report: ArchReport | None = None) -> ArchReport:
    """Static inspection plus a real ``steps``-step generation with the card's first prompt and seed."""
    from ..render import render_one

    if report is None:
        from .static import inspect_transformer

        report = inspect_transformer(pipe.transformer, type(pipe).__name__)
    gen = card.generation
    overrides: dict = {"num_inference_steps": int(steps)}
    if size:
        overrides.update(height=int(size), width=int(size))
    prompt = gen.prompts[0] if gen.prompts else "a photo"
    seed = gen.seeds[0] if gen.seeds else 0
    report = trace_calls(pipe.transformer, lambda: render_one(pipe, card, prompt, seed, **overrides),
                         report=report, scheduler=getattr(pipe, "scheduler", None), steps=steps)
    report.cfg.cache_dit_separate_cfg = cache_dit_separate_cfg(pipe)
    return report


def cache_dit_separate_cfg(pipe) -> bool | None:
    try:
        from cache_dit.caching.block_adapters import BlockAdapterRegister

        return bool(BlockAdapterRegister.has_separate_cfg(pipe))
    except Exception:
        return None
