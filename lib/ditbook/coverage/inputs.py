"""Keyword inputs that run a tiny instance's forward (``make_inputs``, ``find_inputs``,
``tiny_with_inputs``): step 2 of the coverage probe. Candidates from the config first; else
inputs from the forward's data flow (``coverage.dataflow``) repaired from the errors the forward
raises (``coverage.repairs``)."""

from __future__ import annotations

import contextlib
import inspect
import io
import math

import torch

from . import dataflow as ci
from . import layout, reconfig, repairs, state
from .config import config_ints as _ints
from .build import LADDER, Refused, _summary, _tied_width_instance, tiny_instances

# --- inputs ------------------------------------------------------------------------------------

def tiny_with_inputs(cls: type, ladder=LADDER):
    """(instance, factor, keyword inputs): the first rung whose instance runs, the class rebuilt
    with the settings the forward asks for (``reconfig.Reconfigure``, at most ``RECONFIGURES`` times)."""
    overrides: dict = {}
    notes: list = []
    for _ in range(reconfig.RECONFIGURES + 1):
        try:
            return _first_running(cls, ladder, overrides, notes)
        except reconfig.Reconfigure as exc:
            overrides.update(exc.changes)
            notes.append(exc.note)
    raise Refused("; ".join(notes))


def _first_running(cls: type, ladder, overrides: dict, notes: list):
    """(instance, factor, inputs) of the first rung whose forward runs, else of the tied-width instance."""
    last = None
    for model, f in tiny_instances(cls, ladder, overrides):
        try:
            return _running(model, f, notes)
        except reconfig.Reconfigure:
            raise
        except Refused as exc:
            last = exc
    tied = _tied_width_instance(cls, ladder)
    try:
        if tied is not None:
            return _running(*tied, notes)
    except Refused as exc:
        if isinstance(exc, reconfig.Reconfigure):
            raise
    raise Refused(f"{last}")


def _running(model, f: int, notes: list):
    kwargs, cand = find_inputs(model)
    model.coverage_setup = "; ".join(notes + cand.get("setup", []))
    return model, f, kwargs


def _config(model) -> dict:
    cfg = getattr(model, "config", None)
    return dict(cfg) if cfg is not None else {}


def _patch(cfg: dict) -> tuple[int, int]:
    """(spatial, temporal) patch sizes from the config (1 when absent)."""
    p = cfg.get("patch_size") or 1
    if isinstance(p, (tuple, list)):
        t, s = (p[0], p[-1]) if len(p) == 3 else (1, p[-1])
    else:
        t, s = cfg.get("patch_size_t") or 1, p
    return int(s or 1), int(t or 1)


def _in_channels(cfg: dict) -> int:
    return (_ints(cfg, "in_channels", "in_dim", "in_chans", "latent_channels", "input_dim")[:1] or [4])[0]


def _rotary_axes(cfg: dict) -> int:
    """The number of rotary position axes (the length of a config's axes tuple; 3 without one)."""
    axes = next((v for k, v in cfg.items() if "axes" in k.lower() and isinstance(v, (tuple, list))), None)
    return len(axes) if axes else 3


def input_candidates(model) -> list[dict]:
    """Combinations of shapes to try, most likely first."""
    cfg = _config(model)
    s, t = _patch(cfg)
    side = 4 * s
    frames = max(2, t) if t > 1 else 2
    c = _in_channels(cfg)
    text_dims = _ints(cfg, "text", "caption", "joint", "cross", "context", "encoder", "prompt",
                      exclude=("layer", "len", "head", "num_", "seq", "max", "vocab"))
    hs = [("4d", (1, c, side, side)), ("5d", (1, c, frames, side, side)), ("5d-fc", (1, frames, c, side, side)),
          ("3d", (1, 16, c))]
    return [{"hidden": h, "text_dim": td} for h in hs for td in (text_dims or [None])[:3]]


def _tokens(hidden: tuple, cfg: dict) -> int:
    s, t = _patch(cfg)
    if len(hidden) == 3:
        return hidden[1]
    if len(hidden) == 4:
        return (hidden[2] // s) * (hidden[3] // s)
    f = hidden[2] if hidden[1] not in (2,) or hidden[2] == hidden[3] else hidden[1]
    return max(1, f // t) * (hidden[-2] // s) * (hidden[-1] // s)


_NO_INPUT = object()  # a parameter left out of the keyword inputs (distinct from a None value)


def make_inputs(model, cand: dict, text_len: int = 8, seed: int = 0) -> dict:
    """Keyword inputs for ``model.forward`` by parameter name (generic rules, no class names)."""
    cfg = _config(model)
    g = torch.Generator().manual_seed(seed)
    hidden = cand["hidden"][1]
    td = cand["text_dim"]
    kwargs: dict = {}
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.name != "self"]
    first = True
    n_axes = _rotary_axes(cfg)
    for p in params:
        n = p.name.lower()
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if first or n in ("hidden_states", "x", "sample", "latents", "img"):
            kwargs[p.name] = torch.randn(hidden, generator=g)
            first = False
            continue
        if "mask" in n and p.default is inspect.Parameter.empty:
            kwargs[p.name] = torch.ones(1, text_len if ("encoder" in n or "text" in n) else _tokens(hidden, cfg))
            continue
        if "mask" in n or "rotary" in n or "rope" in n or n.startswith("return") or "kwargs" in n \
                or "controlnet" in n or "cache" in n:
            continue
        value = _conditioning_input(p, cfg, g, hidden, td, text_len, n_axes)
        if value is not _NO_INPUT:
            kwargs[p.name] = value
    if "return_dict" in {p.name for p in params}:
        kwargs["return_dict"] = False
    return kwargs


def _conditioning_input(p, cfg: dict, g, hidden: tuple, td, text_len: int, n_axes: int):
    """The input for one conditioning parameter by its name, or ``_NO_INPUT`` to leave it out."""
    n = p.name.lower()
    required = p.default is inspect.Parameter.empty
    if (n in ("encoder_hidden_states", "context", "txt", "text_states", "prompt_embeds", "y")
            or (required and ("encoder_hidden" in n or ("text" in n and "emb" in n)))) and td:
        return torch.randn((1, text_len, td), generator=g)
    elif n in ("timestep", "timesteps", "t", "time", "sigma", "sigmas") or (required and "timestep" in n):
        return torch.full((1,), 500.0)
    elif required and ("text" in n or "context" in n or "encoder" in n) and "len" not in n and td:
        return torch.randn((1, text_len, td), generator=g)
    elif "label" in n or n in ("class_labels", "classes"):
        return torch.zeros(1, dtype=torch.long)
    elif required and ("len" in n):
        return torch.full((1,), text_len, dtype=torch.long)
    elif required and ("size" in n or "coord" in n):
        # image-size conditioning (original/target size, crop corner): pixels of the latent grid
        full = 8 * hidden[-1] if len(hidden) >= 4 else 64
        return torch.zeros(1, 2) if "coord" in n else torch.full((1, 2), float(full))
    elif "pooled" in n:
        dims = _ints(cfg, "pooled") or ([td] if td else [])
        if dims:
            return torch.randn((1, dims[0]), generator=g)
    elif n == "guidance":
        if any("guidance" in k.lower() and v is True for k, v in cfg.items()):
            return torch.full((1,), 3.5)
    elif n in ("num_frames", "frames", "height", "width") and len(hidden) == 3:
        # packed latents: the grid they came from (frames x height x width == tokens)
        side = int(math.isqrt(hidden[1]))
        return 1 if "frame" in n else side
    elif n.endswith("_ids") and ("img" in n or "image" in n):
        return torch.zeros(_tokens(hidden, cfg), n_axes)
    elif n.endswith("_ids") and ("txt" in n or "text" in n):
        return torch.zeros(text_len, n_axes)
    elif required:
        return None  # required with no rule: the probe's error names it
    return _NO_INPUT


def first_tensor(out):
    """The main output: the first tensor of a tuple/list/ModelOutput, or the tensor itself."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            t = first_tensor(o)
            if t is not None:
                return t
    return None


def _grid(model, cand: dict) -> "ci.Grid":
    cfg = _config(model)
    s, t = _patch(cfg)
    hidden = cand["hidden"][1]
    side = hidden[-1] if len(hidden) >= 4 else 4 * s
    # a text length the config fixes (a positional table sized for it)
    text = [v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 512
            and any(w in k.lower() for w in ("text", "caption", "prompt"))
            and any(w in k.lower() for w in ("len", "seq"))]
    return ci.Grid(frames=max(2, t), height=side, width=side, channels=_in_channels(cfg), patch=s, patch_t=t,
                   n_axes=_rotary_axes(cfg), text=text[0] if text else ci.TEXT_LEN)


def _default_roles(rank: int) -> list:
    return {1: ["batch"], 2: ["batch", "dim"], 3: ["batch", "tokens", "dim"],
            4: ["batch", "channels", "height", "width"],
            5: ["batch", "channels", "frames", "height", "width"]}.get(rank, ["batch"] + [None] * (rank - 1))


class _Maker:
    """Builds a value for one forward parameter on demand (the repair loop asks it): what the
    code asks of it (``forward_needs``), else a rule by the parameter's name."""

    def __init__(self, model, cand: dict, needs: dict, seed: int = 0):
        self.model, self.cand, self.needs = model, cand, needs
        self.grid = _grid(model, cand)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.params = [p.name for p in inspect.signature(model.forward).parameters.values()
                       if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.first = self.params[0] if self.params else None
        self.annotations = {p.name: p.annotation for p in inspect.signature(model.forward).parameters.values()
                            if p.annotation is not inspect.Parameter.empty}

    def __call__(self, name: str, kwargs: dict, rank: int | None = None, roles: list | None = None):
        import copy

        ann = self.annotations.get(name)
        if rank is None and name != self.first:
            val = ci.pipeline_value(self.model, name, self.fill)  # as diffusers' own pipeline builds it
            if val is not None:
                return val
        if ann is not None and rank is None:
            val = ci.structured(ann, self.grid, lambda: self(name, kwargs, rank=4 if name == self.first else 3))
            if val is not None:
                return val
        listed = ci.per_module_list(self.model, name) if rank is None else None
        if listed is not None:  # one tensor per module of the list the forward feeds them to
            count, each = listed
            items = [ci.tensor_for(name, each, self.grid, self.gen) for _ in range(count)]
            if all(isinstance(t, torch.Tensor) for t in items):
                return items
        need = copy.copy(self.needs.get(name) or ci.Need())
        hidden = name == self.first
        if rank is not None:
            need.roles = need.roles if need.roles and len(need.roles) == rank else _default_roles(rank)
            if roles and len(roles) == rank:  # the roles the code's own unpack names
                need.roles = list(roles)
        if not need.empty():
            val = ci.tensor_for(name, need, self.grid, self.gen, hidden=hidden)
            if val is not None:
                return ci.suffix_sizes_fit(name, val, _config(self.model), self.gen)
        return ci.suffix_sizes_fit(name, self.by_name(name, kwargs), _config(self.model), self.gen)

    def fill(self, name: str, annotation):
        """A plain argument of a pipeline helper (``pipeline_value``): the device, a size of the token
        grid by its name, positions of the frames, 1.0 for a float; None otherwise."""
        low, text = name.lower(), str(annotation)
        grid_t = self.grid.token_grid()
        if "device" in low:
            return torch.device("cpu")
        if "dtype" in low:
            return torch.float32
        if text.startswith("list[int]"):
            return list(range(grid_t[0]))
        if "int" in text:
            return {"batch": 1, "frames": grid_t[0], "height": grid_t[1], "width": grid_t[2]}.get(ci.axis_role(name))
        if "float" in text:
            return 1.0
        return None

    def by_name(self, name: str, kwargs: dict):
        g, low = self.grid, name.lower()
        hidden = kwargs.get(self.first)
        tokens = hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.ndim == 3 else g.tokens(
            hidden.ndim if isinstance(hidden, torch.Tensor) else 4)
        texty = any(w in low for w in ("encoder", "text", "txt", "caption", "prompt", "context", "cond"))
        length = g.text if texty else tokens
        ann = str(self.annotations.get(name, ""))
        if ann and "int" in ann and "Tensor" not in ann and "list" not in ann.lower() and "tuple" not in ann.lower():
            # a size the forward takes as a plain int: the token grid's (frames, height, width)
            frames, height, width = g.token_grid()
            return {"frames": frames, "height": height, "width": width, "tokens": length}.get(ci.axis_role(name), 1)
        if "mask" in low:
            return torch.ones(1, g.text if _doc_texty(self.model, name) else length, dtype=torch.long)
        if "index" in low or "indices" in low:
            return torch.arange(length)  # a 1-D list of positions
        if low.endswith("ids") or "position" in low or "pos" in low.split("_"):
            return torch.zeros(1, length, dtype=torch.long)
        if "len" in low or "length" in low:
            return torch.full((1,), length, dtype=torch.long)
        if "time" in low or "sigma" in low:
            return torch.full((1,), 0.5 if "sigma" in low else 500.0)
        if "size" in low or "shape" in low:
            return torch.tensor([[g.height, g.width]], dtype=torch.long)
        if "scale" in low:
            return torch.ones(1)
        return torch.randn((1, length, g.channels), generator=self.gen)


def _doc_texty(model, name: str) -> bool:
    """The forward's docstring says ``name`` is about the text (``mask: the text padding mask``,
    ``Alias for encoder_attention_mask``): its first two lines name the text/encoder/prompt."""
    import re

    doc = inspect.getdoc(type(model).forward) or ""
    m = re.search(rf"^[ \t]*{re.escape(name)}\b[^\n]*(\n[^\n]*)?", doc, re.M)
    return bool(m) and any(w in m.group(0).lower() for w in ("text", "encoder", "prompt", "caption"))


def _run(model, kwargs):
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        out = first_tensor(model(**kwargs))
    if out is None or not torch.isfinite(out).all():
        raise Refused("the forward gave no finite tensor")
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + (str(exc).splitlines()[0][:120] if str(exc) else "")


REPAIRS = 12


def _flow_inputs(model, cand: dict, needs: dict, maker: "_Maker") -> dict:
    """The candidate's name-rule inputs with every tensor the code's data flow says more about
    rebuilt to meet it."""
    kwargs = make_inputs(model, cand, text_len=maker.grid.text)
    for name, val in list(kwargs.items()):
        if val is None or _list_annotated(maker, name):  # no name rule, or a list the annotation asks for
            kwargs[name] = maker(name, kwargs)
            continue
        need = needs.get(name)
        if need is None or need.empty() or not (val is None or isinstance(val, torch.Tensor)):
            continue
        if isinstance(val, torch.Tensor) and val.ndim == 1 and not need.vocab \
                and not (need.roles and len(need.roles) > 1 and "docstring" in need.where):
            continue  # a scalar per batch (timestep, guidance): name rules know best, unless documented wider
        new = ci.tensor_for(name, need, maker.grid, maker.gen, hidden=name == maker.first)
        if new is not None:
            kwargs[name] = new
    for name, val in kwargs.items():  # masks as integers: they are summed, compared and indexed with
        if "mask" in name.lower() and isinstance(val, torch.Tensor) and val.is_floating_point():
            kwargs[name] = torch.ones(val.shape, dtype=torch.long)
    return kwargs


def _tagged(kwargs: dict, needs: dict) -> dict:
    """Inputs the code compares with module constants (token role tags) hold those constants, in
    the shape the name rules gave them: random values would tag no token at all."""
    out = dict(kwargs)
    for name, val in kwargs.items():
        need = needs.get(name)
        if need is not None and need.values and isinstance(val, torch.Tensor) and val.ndim >= 1 and val.numel():
            n = val.shape[-1]
            row = torch.tensor([need.values[min(i * len(need.values) // n, len(need.values) - 1)] for i in range(n)])
            out[name] = row.expand(tuple(val.shape)).clone()
    return out


def _list_annotated(maker, name: str) -> bool:
    """The forward annotates ``name`` as a list (of tensors per sample, of grids): a tensor made by
    the name rules is not what it takes."""
    ann = maker.annotations.get(name)
    return ann is not None and ci.annotation_text(ann).startswith("list[") and "Tensor" in ci.annotation_text(ann)


def _regrid(exc, kwargs, model, cand, needs, maker, forbid):
    found = repairs.int_input_size(exc, kwargs)
    if found and (found[0], "int", found[1]) not in forbid:
        return None  # an int input gives that size: the input repairs set it
    fixed = _regrid_inputs(exc, model, cand, needs, maker, forbid)
    if fixed is None:
        return None
    new, why = fixed
    for k, v in kwargs.items():  # what the repairs supplied so far, made again on the new grid
        if new.get(k) is None and v is not None:
            new[k] = maker(k, new)
    return new, why


def _regrid_inputs(exc, model, cand, needs, maker, forbid):
    """A size mismatch whose one side is the grid's text length or frame count (a positional table
    sized by the config): the whole input set rebuilt on a grid with the other size."""
    if repairs.last_axis_mismatch(exc):
        return None  # a feature width, not a length: the input repairs fix it
    if "divisible" in str(exc) and maker.grid.height < 8 * maker.grid.patch * 4 \
            and ("grow", maker.grid.height) not in forbid:
        # a token grid too small for the model's windows/tiles: twice as large on each side
        forbid.add(("grow", maker.grid.height))
        maker.grid.height *= 2
        maker.grid.width *= 2
        return _flow_inputs(model, cand, needs, maker), f"grid {maker.grid.height}x{maker.grid.width}"
    m = repairs._SIZE.search(str(exc))
    if not m:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    for attr in ("text", "frames"):
        for old, new in ((a, b), (b, a)):
            if getattr(maker.grid, attr) == old and 1 <= new <= 512 and (attr, new) not in forbid:
                forbid.add((attr, new))
                maker.grid.resize(attr, new)
                return _flow_inputs(model, cand, needs, maker), f"grid {attr} {old} -> {new}"
    # a sequence of text plus a fixed number of other tokens against a table sized for a longer
    # text: the text longer by the difference
    if int(m.group(3)) == 1 and b > a and maker.grid.text + (b - a) <= 512 and ("text+", b - a) not in forbid:
        forbid.add(("text+", b - a))
        old = maker.grid.text
        maker.grid.text += b - a
        return _flow_inputs(model, cand, needs, maker), f"grid text {old} -> {maker.grid.text}"
    return None


def find_inputs(model, log=None) -> tuple[dict, dict]:
    """(keyword inputs, candidate) of the first combination whose forward runs: the name rules'
    candidates, then each through the data flow and the error repairs; required running-pipeline state
    inputs are made where the code says how (``coverage.state``), noted in the candidate's ``setup``."""
    required = [p.name for p in inspect.signature(model.forward).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [n for n in required if repairs.never_supplied(n)]
    if not names:
        return _search(model, log, {})
    options = state.state_options(model, names)
    if not options:
        raise Refused(f"the forward requires {names}: state/cache objects of a running pipeline that the probe "
                      f"does not make up")
    last = None
    for values, notes in options:
        try:
            kwargs, cand = _search(model, log, values)
        except reconfig.Reconfigure:
            raise
        except Refused as exc:
            last = exc
            continue
        return kwargs, {**cand, "setup": cand.get("setup", []) + notes}
    raise Refused(f"with {names} made empty ({'; '.join(options[-1][1])}): {last}")


def _search(model, log, given: dict) -> tuple[dict, dict]:  # long: the two passes share the error record
    """``find_inputs`` for one set of ``given`` inputs (state objects), set on every attempt."""
    errors: dict[str, str] = {}
    cands = input_candidates(model)
    needs = ci.forward_needs(model)
    for cand in cands:
        kwargs = {**_tagged(make_inputs(model, cand), needs), **given}
        try:
            _run(model, kwargs)
        except Exception as exc:
            errors.setdefault(cand["hidden"][0], _first_line(exc))
            continue
        return kwargs, cand
    seen = []
    for cand in cands:
        maker = _Maker(model, cand, needs)
        flow = _flow_inputs(model, cand, needs, maker)
        # a packed joint sequence described by its parts: laid out consistently first
        joint = layout.layout_inputs(model, maker.grid, needs, flow, maker.gen)
        for start in ([joint] if joint is not None else []) + [flow, make_inputs(model, cand)]:
            start = {**start, **given}
            sig = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for k, v in start.items()}
            if sig in seen:
                continue
            seen.append(sig)
            kwargs, forbid = start, set()
            for _ in range(REPAIRS):
                try:
                    _run(model, kwargs)
                except Exception as exc:
                    change = reconfig.config_repair(exc, model)
                    if change is not None:
                        raise reconfig.Reconfigure(*change) from None
                    if repairs.missing_dependency(exc):
                        raise Refused(repairs.missing_dependency(exc)) from None
                    fixed = (_regrid(exc, kwargs, model, cand, needs, maker, forbid)
                             or repairs.repair(exc, kwargs, maker, forbid))
                    if log:
                        log(cand["hidden"][0], _summary(exc), fixed[1] if fixed else None)
                    if fixed is None:
                        own = repairs._own_none(exc)  # the model's own setting left None by its defaults
                        errors[f"{cand['hidden'][0]}+flow"] = _first_line(exc) + (
                            f" ({own} is None: a setting the class's defaults leave unset)" if own
                            else repairs.explain(exc, model, kwargs))
                        break
                    kwargs = fixed[0]
                    continue
                return kwargs, cand
    # the data-flow attempts' last errors first: they went furthest
    order = sorted(errors, key=lambda k: not k.endswith("+flow"))
    pipe_state = ci.pipeline_state_inputs(type(model))
    if pipe_state:
        raise Refused(f"every call of this transformer in diffusers' pipelines passes {pipe_state}: state of a running "
                      f"pipeline (a kv cache filled by earlier calls) that the probe does not make up; without it "
                      f"no input runs the forward: " + "; ".join(f"{k}: {errors[k]}" for k in order[:2]))
    raise Refused("no inputs from the forward signature run it: " + "; ".join(f"{k}: {errors[k]}" for k in order))


