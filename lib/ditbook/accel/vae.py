"""Patch-parallel VAE decode: the latent's rows are split over the ranks, each rank decodes its band
of rows, and the bands are gathered into the whole image on every rank. To compute exactly what one
process does: a ``k x k`` convolution gets ``k // 2`` halo rows from the neighbouring bands (zeros
at the image's edges) and runs without row padding; a GroupNorm all-reduces its sums (sum, sum of
squares, count, in float64); self-attention keeps its band's queries and all-gathers the keys and
values (a ``TorchFunctionMode`` entered around the decoder's forward only). Everything else must be
per-pixel or a nearest-neighbour upsampling by a whole factor: ``plan_vae_decode`` refuses, naming
the module, anything else (a strided or transposed convolution, Conv3d, another normalization)
and a latent height that does not divide by the degree; other interpolation is refused when met.

``VaeRecorder`` records per rank what the decoder really received; ``check_vae_sharding`` fails
with ``VaeShardingError`` when a rank decoded the whole latent or the bands do not tile it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..cp.sharding import ShardingError
from ..hooks import WrapGroup
from . import plan_name, register
from .technique import Feasibility, Handle, NoSettings, ParallelTechnique

VAE_WRAP = "ditbook.vae-patch-parallel"
_SDPA = F.scaled_dot_product_attention
_INTERPOLATE = F.interpolate


class VaeParallelRefused(RuntimeError):
    """The VAE's decoder cannot be decoded patch-parallel (the message names the module and why)."""


class VaeShardingError(ShardingError):
    """A patch-parallel decode whose ranks did not each decode 1/degree of the latent rows."""


_PER_PIXEL = (nn.Dropout, nn.Identity, nn.Linear)


def _is_activation(m: nn.Module) -> bool:
    return type(m).__module__ == "torch.nn.modules.activation"


def decoder_of(vae) -> nn.Module:
    dec = getattr(vae, "decoder", None)
    if not isinstance(dec, nn.Module):
        raise VaeParallelRefused(f"{type(vae).__name__} has no decoder module to split")
    return dec


def plan_vae_decode(vae, degree: int, latent_height: int | None = None) -> dict:
    """What the patch decode will do on this VAE: the convolutions that need halos, the norms to
    all-reduce; raises ``VaeParallelRefused`` naming what it cannot split."""
    dec = decoder_of(vae)
    convs, norms = [], []
    for name, m in dec.named_modules():
        if list(m.children()):
            continue
        if isinstance(m, nn.Conv2d):
            kh = m.kernel_size[0]
            if m.stride[0] != 1 or m.dilation[0] != 1:
                raise VaeParallelRefused(f"decoder.{name}: strided or dilated convolution (stride {m.stride}, "
                                         f"dilation {m.dilation}) moves rows across bands")
            if kh > 1 and (kh % 2 == 0 or m.padding[0] != kh // 2 or m.padding_mode != "zeros"):
                raise VaeParallelRefused(f"decoder.{name}: kernel {m.kernel_size} with padding {m.padding} "
                                         f"({m.padding_mode}) is not a same-size zero-padded convolution")
            if kh > 1:
                convs.append(name)
        elif isinstance(m, nn.GroupNorm):
            norms.append(name)
        elif isinstance(m, _PER_PIXEL) or _is_activation(m):
            continue
        else:
            raise VaeParallelRefused(f"decoder.{name}: {type(m).__name__} — the patch decode splits only "
                                     f"Conv2d, GroupNorm, per-pixel layers and nearest upsampling")
    if latent_height is not None and latent_height % degree:
        raise VaeParallelRefused(f"latent height {latent_height} is not divisible by vae {degree}")
    return {"halo_convs": convs, "group_norms": norms, "degree": degree}


@dataclass
class VaeStats:
    halo_exchanges: int = 0
    norms_reduced: int = 0
    attention_gathers: int = 0
    bands: list = field(default_factory=list)  # [start, end) latent rows of this rank, per decode


def _gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-2)


def _halo(x: torch.Tensor, h: int, group=None) -> torch.Tensor:
    """x with ``h`` rows of the neighbouring bands above and below (zeros at the image's edges)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[-2] < h:
        raise VaeParallelRefused(f"a band of {x.shape[-2]} rows is thinner than the {h}-row halo a convolution needs")
    edges = torch.cat([x[..., :h, :], x[..., -h:, :]], dim=-2).contiguous()
    parts = [torch.empty_like(edges) for _ in range(world)]
    dist.all_gather(parts, edges, group=group)
    zeros = torch.zeros_like(x[..., :h, :])
    top = parts[rank - 1][..., h:, :] if rank > 0 else zeros
    bottom = parts[rank + 1][..., :h, :] if rank < world - 1 else zeros
    return torch.cat([top, x, bottom], dim=-2)


class _DecoderMode(TorchFunctionMode):
    """Inside the decoder's forward: attention gathers K/V over the bands; interpolation must keep
    rows inside their band."""

    def __init__(self, stats: VaeStats, group=None):
        super().__init__()
        self.stats, self.group = stats, group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            names = ("query", "key", "value")
            qkv = list(args[:3]) + [kwargs.pop(n) for n in names[len(args[:3]):]]
            self.stats.attention_gathers += 1
            return _SDPA(qkv[0], _gather_rows(qkv[1], self.group), _gather_rows(qkv[2], self.group), *args[3:],
                         **kwargs)
        if func is _INTERPOLATE:
            mode = kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
            if mode not in ("nearest", "nearest-exact"):
                raise VaeParallelRefused(f"the decoder interpolates with mode '{mode}', which mixes rows across bands")
        return func(*args, **kwargs)


def _halo_conv(module: nn.Conv2d, stats: VaeStats, active: dict, group=None):
    """The wrapper of one convolution: while the patch decode runs, convolve the band with its
    neighbours' halo rows instead of zero padding."""
    h = module.kernel_size[0] // 2

    def wrapped(original, x, *a, **kw):
        if not active["on"]:
            return original(x, *a, **kw)
        stats.halo_exchanges += 1
        xe = _halo(x, h, group)
        return F.conv2d(xe, module.weight, module.bias, module.stride, (0, module.padding[1]), module.dilation,
                        module.groups)
    return wrapped


def _band_group_norm(module: nn.GroupNorm, stats: VaeStats, active: dict, group=None):
    """The wrapper of one GroupNorm: while the patch decode runs, its statistics are summed over
    every rank's band (so each band is normalised like the whole image)."""
    def wrapped(original, x, *a, **kw):
        if not active["on"]:
            return original(x, *a, **kw)
        stats.norms_reduced += 1
        b, c = x.shape[0], x.shape[1]
        g = module.num_groups
        xg = x.reshape(b, g, -1).double()
        sums = torch.stack([xg.sum(-1), (xg * xg).sum(-1),
                            torch.full_like(xg[..., 0], xg.shape[-1])], dim=-1)
        dist.all_reduce(sums, group=group)
        mean = sums[..., 0] / sums[..., 2]
        var = (sums[..., 1] / sums[..., 2] - mean * mean).clamp_min(0)
        y = ((xg - mean[..., None]) / torch.sqrt(var[..., None] + module.eps)).to(x.dtype).reshape(x.shape)
        if module.affine:
            shape = (1, c) + (1,) * (x.dim() - 2)
            y = y * module.weight.reshape(shape) + module.bias.reshape(shape)
        return y
    return wrapped


def _band_decode(stats: VaeStats, active: dict, group=None):
    """The wrapper of the decoder's forward: decode this rank's band of latent rows with the
    patches active, then gather the bands' images."""
    def decode(original, sample, *a, **kw):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        rows = sample.shape[-2]
        if rows % world:
            raise VaeParallelRefused(f"latent height {rows} is not divisible by vae {world}")
        band = rows // world
        stats.bands.append([rank * band, (rank + 1) * band])
        active["on"] = True
        try:
            with _DecoderMode(stats, group):
                out = original(sample[..., rank * band:(rank + 1) * band, :], *a, **kw)
        finally:
            active["on"] = False
        return _gather_rows(out, group)
    return decode


def apply_vae_parallel(vae, degree: int, group=None) -> tuple[WrapGroup, VaeStats]:
    """Install the patch decode on ``vae.decoder`` (per instance, ``ditbook.hooks``; undone by the
    returned group's ``remove()``). Every rank must call the decoder the same number of times."""
    plan = plan_vae_decode(vae, degree)
    dec = decoder_of(vae)
    stats = VaeStats()
    wraps = WrapGroup(VAE_WRAP)
    active = {"on": False}
    with wraps.applying():
        for name in plan["halo_convs"]:
            m = dec.get_submodule(name)
            wraps.wrap(m, _halo_conv(m, stats, active, group))
        for name in plan["group_norms"]:
            m = dec.get_submodule(name)
            wraps.wrap(m, _band_group_norm(m, stats, active, group))
        wraps.wrap(dec, _band_decode(stats, active, group))
    return wraps, stats


class VaeRecorder:
    """What the decoder really received on this rank (hooks independent of the patch decode): the
    latent height handed to the decoder, and the rows its first convolution saw."""

    def __init__(self, vae, stats: VaeStats | None = None):
        self.dec = decoder_of(vae)
        self.stats = stats
        self.full: list[int] = []
        self.first_conv: list[int] = []
        self.out_rows: list[int] = []
        convs = [m for m in self.dec.modules() if isinstance(m, nn.Conv2d)]
        if not convs:
            raise VaeParallelRefused("the decoder has no convolution to record")
        waiting = {"first": False}

        def decoder_in(m, a):
            self.full.append(int(a[0].shape[-2]))
            waiting["first"] = True

        def conv_in(m, a):  # the first convolution that runs in this decode sees the latent band
            if waiting["first"]:
                waiting["first"] = False
                self.first_conv.append(int(a[0].shape[-2]))

        self.handles = [self.dec.register_forward_pre_hook(decoder_in),
                        self.dec.register_forward_hook(lambda m, a, o: self.out_rows.append(int(o.shape[-2])) and None)]
        self.handles += [c.register_forward_pre_hook(conv_in) for c in convs]

    def record(self) -> dict:
        s = self.stats
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "latent_height": self.full,
                "decoded_rows": self.first_conv, "output_height": self.out_rows,
                "bands": s.bands if s else [], "halo_exchanges": s.halo_exchanges if s else 0,
                "norms_all_reduced": s.norms_reduced if s else 0, "attention_gathers": s.attention_gathers if s else 0}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def check_vae_sharding(ranks: list[dict], degree: int) -> dict:
    """Each rank's ``VaeRecorder.record()``: every decode on every rank must have run its first
    convolution on latent height / degree rows, and the ranks' bands must tile the latent."""
    problems = []
    for r, rec in enumerate(ranks):
        if not rec or not rec.get("latent_height"):
            problems.append(f"rank {r}: the decoder was never called")
            continue
        want = [h // degree for h in rec["latent_height"]]
        if rec["decoded_rows"] != want:
            problems.append(f"rank {r}: the decoder's first convolution saw {sorted(set(rec['decoded_rows']))} rows "
                            f"of a {sorted(set(rec['latent_height']))}-row latent, expected 1/{degree} of it")
    if not problems:
        calls = len(ranks[0]["latent_height"])
        for i in range(calls):
            bands = sorted(tuple(rec["bands"][i]) for rec in ranks if i < len(rec.get("bands", [])))
            full = ranks[0]["latent_height"][i]
            edges = [0] + [e for _, e in bands]
            if len(bands) != degree or [s for s, _ in bands] != edges[:-1] or edges[-1] != full:
                problems.append(f"decode {i}: the ranks' bands {bands} do not tile the {full} latent rows")
                break
    if problems:
        raise VaeShardingError("the VAE decode was not split: " + "; ".join(problems))
    return {"degree": degree, "bands": [rec["bands"][0] for rec in ranks],
            "latent_height": ranks[0]["latent_height"][0], "decodes": len(ranks[0]["latent_height"]),
            "halo_exchanges": [rec["halo_exchanges"] for rec in ranks],
            "norms_all_reduced": [rec["norms_all_reduced"] for rec in ranks],
            "attention_gathers": [rec["attention_gathers"] for rec in ranks]}


def vae_facts(model_path, height: int | None) -> tuple[str | None, int | None]:
    """Before any launch: (why the model folder's VAE cannot be decoded patch-parallel, or None;
    the latent height at ``height`` pixels, or None). The VAE is built on the meta device from its
    ``vae/config.json``; a VAE class that is not diffusers' is left to the launch (None, None)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_path) / "vae" / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None, None
    import diffusers

    cls = getattr(diffusers, str(config.get("_class_name")), None)
    if cls is None:
        return None, None
    try:
        with torch.device("meta"):
            vae = cls.from_config(config)
    except Exception:  # noqa: BLE001 - judged at launch instead
        return None, None
    channels = config.get("block_out_channels")
    latent = height // 2 ** (len(channels) - 1) if height and channels else None
    try:
        plan_vae_decode(vae, 1)
    except VaeParallelRefused as exc:
        return str(exc), latent
    return None, latent


@register
class VaeParallel(ParallelTechnique):
    """Patch-parallel VAE decode: latent rows split over the plan's ranks (rides on any plan of its size)."""

    name = "vae"
    token = "vae"
    family = "VAE patch parallel"
    Settings = NoSettings
    order = 70
    multiplies = False
    on_rank = True

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        vae = f.components.get("vae")
        if n == 1:
            return [Feasibility("vae", 1, False, None, "one process")]
        if not vae:
            return [Feasibility("vae", n, False, None, "the pipeline has no vae component")]
        if f.vae_problem:
            return [Feasibility("vae", n, False, None, f"{vae}: {f.vae_problem}")]
        if f.latent_height and f.latent_height % n:
            return [Feasibility("vae", n, False, None, f"{vae}: {f.latent_height} latent rows not divisible by {n}")]
        return [Feasibility("vae", n, True, plan_name(vae=n),
                            f"{vae}: latent rows split over {n} ranks, halo rows per convolution, GroupNorm and attention "
                            f"over the whole image; a decoder layer it cannot split is refused at launch by name")]

    @classmethod
    def apply_on_rank(cls, pipe, card, spec, degree: int, noop: bool = False) -> Handle:
        vae = getattr(pipe, "vae", None)
        if vae is None:
            raise VaeParallelRefused(f"{type(pipe).__name__} has no vae component")
        plan_vae_decode(vae, degree)
        stats = None if noop else apply_vae_parallel(vae, degree)[1]
        recorder = VaeRecorder(vae, stats)
        return Handle(recorder.remove, recorder.record)

    @classmethod
    def check(cls, records: list, degree: int) -> dict:
        """Fails when a rank decoded more than its band of the latent (``check_vae_sharding``)."""
        return check_vae_sharding(records, degree)
