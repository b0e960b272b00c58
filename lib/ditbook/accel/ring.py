"""Ring attention written for ditbook: each rank keeps its block of queries, the key/value blocks
travel around the ranks (point-to-point ``isend``/``irecv``, batched; gloo on the CPU, NCCL on
GPUs), and the partial attentions are merged by their log-sum-exp.

The maths. For one query row, attention over the keys split in blocks ``B_1..B_n`` is

    out = sum_j softmax(s)_j v_j,   s_j = q.k_j * scale,   lse = log sum_j exp(s_j)

and over one block ``b`` alone ``out_b = sum_{j in b} exp(s_j - lse_b) v_j``. Two blocks merge as

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

which is exact in any order, so ``n - 1`` exchanges of the key/value block with the ring
neighbours give each rank the attention of its queries over the whole sequence. Each block's
partial attention and log-sum-exp come from a fused kernel where one applies (CUDA, half
precision, no mask: ``fused_partial``, checked once per process against the float32 path), else
from ``q k^T`` in float32, which materialises the whole score matrix.

The sequence is split and gathered by the model's context-parallel plan (cache-dit's split/gather
hooks); each attention module's forward enters a ``TorchFunctionMode`` that turns its SDPA calls
into ring attention. A mask over the keys travels round the ring with its keys; a causal flag,
dropout, or a mask not over the local keys is refused by name (``RingAttentionRefused``).

``RingRecorder`` records per rank each attention call's local query/key lengths and the ring's own
counts; ``check_ring_sharding`` fails with ``RingShardingError`` when no call went round the ring
or a call merged fewer than ``degree`` blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..cp.sharding import ShardingError
from ..hooks import WrapError, WrapGroup, swap_attribute
from . import plan_name, register
from .technique import Feasibility, NoSettings, ParallelTechnique

RING_WRAP = "ditbook.ring-attention"
RECORD_WRAP = "ditbook.ring-record"
_SDPA = F.scaled_dot_product_attention


class RingAttentionRefused(RuntimeError):
    """An attention call ring attention does not compute (causal, dropout, a mask not over the keys)."""


class RingShardingError(ShardingError):
    """A ring run whose attention calls did not go round the ring."""


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key/value block: (out, lse), lse float32 of shape q[..., 0].
    ``mask`` (SDPA's convention) covers this block's keys; a row with every key masked has lse -inf
    and out 0. A fused kernel where one applies (``fused_partial``), else ``reference_partial``."""
    if mask is None:
        fused = fused_partial(q, k, v, scale)
        if fused is not None:
            return fused
    return reference_partial(q, k, v, scale, mask)


def reference_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` in float32 from the whole score matrix: any device, any mask."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(torch.where(finite[..., None], p, torch.zeros_like(p)), v.float())
    return out, lse


def _flash(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]


def _efficient(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                      scale=scale)[:2]
    return out, lse[..., : q.shape[-2]]  # the kernel pads the log-sum-exp's rows to a multiple of 32


FUSED_KERNELS = {"flash": _flash, "efficient": _efficient}
_CHOSEN: dict[tuple, str | None] = {}  # (device, dtype, head dim) -> kernel name, or None: float32 path


def _kernel_agrees(kernel, device, dtype, head_dim: int) -> bool:
    """One small problem through ``kernel`` and through ``reference_partial``: the kernel is used
    only if its output and log-sum-exp agree (torch's private ops change between releases)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 80, head_dim, generator=g, device="cpu").to(device, dtype) for _ in range(3))
    scale = head_dim ** -0.5
    try:
        out, lse = kernel(q, k, v, scale)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    ref_out, ref_lse = reference_partial(q, k, v, scale)
    return (tuple(lse.shape) == tuple(ref_lse.shape) and float((lse.float() - ref_lse).abs().max()) < 1e-2
            and float((out.float() - ref_out).abs().max()) < 2e-2)


def fused_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out, lse) of one block from the first fused kernel that agrees with the float32 path on this
    device, dtype and head dim; None where none does (the CPU, float32, GQA)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or k.shape[-3] != q.shape[-3]:
        return None
    key = (str(q.device), q.dtype, q.shape[-1])
    if key not in _CHOSEN:
        _CHOSEN[key] = next((n for n, fn in FUSED_KERNELS.items() if _kernel_agrees(fn, q.device, q.dtype, q.shape[-1])),
                            None)
    name = _CHOSEN[key]
    if name is None:
        return None
    out, lse = FUSED_KERNELS[name](q, k, v, scale)
    return out.float(), lse.float()


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint key blocks -> over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # both blocks masked: stays 0, -inf
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - safe), torch.zeros_like(lse_a))
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - safe), torch.zeros_like(lse_b))
    return out_a * wa[..., None] + out_b * wb[..., None], lse


@dataclass
class RingStats:
    calls: int = 0
    blocks: list = field(default_factory=list)  # blocks merged per call (first calls only)
    key_lengths: list = field(default_factory=list)  # [local key length, merged key length] per call (first)
    exchanges: int = 0

    def note(self, blocks: int, local: int, merged: int) -> None:
        self.calls += 1
        if len(self.blocks) < 64:
            self.blocks.append(blocks)
            self.key_lengths.append([local, merged])


def ring_attention(q, k, v, group=None, scale: float | None = None, stats: RingStats | None = None,
                   merge=merge_partials, mask: torch.Tensor | None = None):
    """Attention of this rank's queries over every rank's keys/values: [..., S_local, D] each.
    ``mask`` covers this rank's keys (last dim) and travels round the ring with them."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    travel = [k.contiguous(), v.contiguous()]
    if mask is not None:
        # the mask's key axis travels with the keys; on the gloo/NCCL wire as uint8 when boolean
        travel.append(mask.contiguous().to(torch.uint8) if mask.dtype == torch.bool else mask.contiguous())
    out = lse = None
    merged = 0
    for step in range(world):
        reqs = []
        if step < world - 1:
            incoming = [torch.empty_like(t) for t in travel]
            ops = [dist.P2POp(dist.isend, t, nxt, group) for t in travel] + \
                  [dist.P2POp(dist.irecv, t, prv, group) for t in incoming]
            reqs = dist.batch_isend_irecv(ops)
        block_mask = None
        if mask is not None:
            block_mask = travel[2].bool() if mask.dtype == torch.bool else travel[2]
        o, l = partial_attention(q, travel[0], travel[1], scale, block_mask)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
        merged += travel[0].shape[-2]
        for r in reqs:
            r.wait()
        if reqs:
            if stats is not None:
                stats.exchanges += 1
            travel = incoming
    if stats is not None:
        stats.note(world, k.shape[-2], merged)
    return out.to(q.dtype)


class _RingMode(TorchFunctionMode):
    def __init__(self, group, stats: RingStats):
        super().__init__()
        self.group, self.stats = group, stats

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not _SDPA:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        mask = bound.get("attn_mask")
        if mask is not None and mask.shape[-1] not in (1, bound["key"].shape[-2]):
            raise RingAttentionRefused(f"an attention mask over {mask.shape[-1]} keys for {bound['key'].shape[-2]} "
                                       f"local keys: it cannot travel with them")
        if bound.get("is_causal"):
            raise RingAttentionRefused("a causal attention call: ditbook's ring computes full attention only")
        if bound.get("dropout_p"):
            raise RingAttentionRefused("attention dropout in inference: ring attention takes none")
        q, k, v = bound["query"], bound["key"], bound["value"]
        if k.shape[-3] != q.shape[-3]:  # GQA: the key/value heads repeated to the query heads
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        return ring_attention(q, k, v, self.group, bound.get("scale"), self.stats, mask=mask)


def attention_modules(transformer) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules: diffusers' (they hold a ``processor``) and those whose own code calls
    SDPA (``attention.sdpa_callers``); the outermost only."""
    from ..cp.attention import sdpa_callers

    found = [(n, m) for n, m in transformer.named_modules() if n and hasattr(m, "processor")]
    found += sdpa_callers(transformer)
    out: list[tuple[str, torch.nn.Module]] = []
    for name, module in sorted(found, key=lambda x: x[0].count(".")):
        if any(name == o or name.startswith(o + ".") for o, _ in out):
            continue
        out.append((name, module))
    return out


def route_ring_attention(transformer, group=None) -> tuple[WrapGroup, RingStats, list[str]]:
    """Send every attention module's SDPA calls to ``ring_attention`` (per module; undo with the
    returned group's ``remove()``)."""
    stats = RingStats()
    wraps = WrapGroup(RING_WRAP)

    def routed(original, *args, **kwargs):
        with _RingMode(group, stats):
            return original(*args, **kwargs)

    mods = attention_modules(transformer)
    if not mods:
        raise RingAttentionRefused(f"{type(transformer).__name__}: no attention module found to route")
    with wraps.applying():
        for _, m in mods:
            wraps.wrap(m, routed)
    return wraps, stats, [n for n, _ in mods]


class RingRecorder:
    """Per rank: the local query/key lengths of each attention module's SDPA calls (seen before the
    ring route), and the ring's counts."""

    def __init__(self, transformer, stats: RingStats | None = None):
        self.stats = stats
        self.lengths: dict[str, list] = {}
        self.wraps = WrapGroup(RECORD_WRAP)
        rec = self

        class Spy(TorchFunctionMode):
            def __init__(self, name):
                super().__init__()
                self.name = name

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is _SDPA:
                    q = args[0] if args else kwargs["query"]
                    k = args[1] if len(args) > 1 else kwargs["key"]
                    seen = rec.lengths.setdefault(self.name, [])
                    if [q.shape[-2], k.shape[-2]] not in seen:
                        seen.append([int(q.shape[-2]), int(k.shape[-2])])
                return func(*args, **kwargs)

        def make(name):
            def wrapped(original, *args, **kwargs):
                with Spy(name):
                    return original(*args, **kwargs)
            return wrapped

        with self.wraps.applying():
            for name, m in attention_modules(transformer):
                self.wraps.wrap(m, make(name))

    def record(self) -> dict:
        s = self.stats
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "local_lengths": self.lengths,
                "ring_calls": s.calls if s else 0, "blocks": s.blocks if s else [],
                "key_lengths": s.key_lengths if s else [], "exchanges": s.exchanges if s else 0}

    def remove(self) -> None:
        try:
            self.wraps.remove()
        except WrapError:  # the CP plan's hooks wrapped the module after us: they go with the model
            pass


def check_ring_sharding(ranks: list[dict], degree: int) -> dict:
    """Each rank's ``RingRecorder.record()``: attention calls went round the ring on every rank,
    each merging ``degree`` blocks whose key lengths add up to ``degree`` x the local one."""
    problems = []
    for r, rec in enumerate(ranks):
        rec = rec or {}
        if not rec.get("ring_calls"):
            problems.append(f"rank {r}: no attention call went round the ring")
            continue
        if any(b != degree for b in rec["blocks"]):
            problems.append(f"rank {r}: calls merged {sorted(set(rec['blocks']))} blocks, expected {degree}")
        if any(m != local * degree for local, m in rec["key_lengths"]):
            problems.append(f"rank {r}: merged key lengths {rec['key_lengths'][:3]} are not {degree} x the local ones")
    if problems:
        raise RingShardingError("the attention did not run as a ring: " + "; ".join(problems))
    return {"degree": degree, "ring_calls": [rec["ring_calls"] for rec in ranks],
            "exchanges": [rec["exchanges"] for rec in ranks],
            "local_lengths": [rec["local_lengths"] for rec in ranks]}


def ring_check(f, n: int, own: bool = False) -> tuple[bool, str]:
    """``own``: ditbook's ring (this module, plain ring<N> plans), which computes the log-sum-exp
    itself and so runs on any device; else cache-dit's (inside USP)."""
    if f.heads is None:
        return False, "head count unknown (inspection found no attention)"
    s = f.seq_reason(n)
    if s:
        return False, s
    if not own and not f.device.startswith("cuda"):
        return False, ("ring attention merges partial results by their log-sum-exp, which cache-dit takes "
                       "from the flash SDPA kernel — CUDA only (on CPU it raises NotImplementedError)")
    full_masks = [m for m in f.att.masks if "mask" in m.lower() and "encoder" not in m.lower()]
    if full_masks and own:
        return True, f"key mask(s) {full_masks} travel round the ring with their keys; " + f.cp_how()
    if full_masks:
        return False, f"attention mask(s) {full_masks} over the whole sequence: ring attention takes no mask"
    return True, f.cp_how()


def apply_own_ring(tr, plan: dict, spec, noop: bool = False) -> tuple[list[str], RingRecorder]:
    """ditbook's ring attention on a plain ring<N> plan: cache-dit's split/gather hooks of the CP
    plan (without its attention backend) and every attention module routed round the ring. Returns
    the routed modules and the recorder (installed first). ``noop``: record only."""
    from torch.distributed.device_mesh import init_device_mesh

    dev_type = "cuda" if str(tr.device).startswith("cuda") else "cpu"
    recorder = RingRecorder(tr)
    if noop:
        return [n for n, _ in attention_modules(tr)], recorder
    from cache_dit.distributed.core import _ContextParallelConfig
    from cache_dit.distributed.core._context_parallel import _apply_context_parallel

    mesh = init_device_mesh(dev_type, (spec.ring, 1), mesh_dim_names=("ring", "ulysses"))
    # the ring route before the split/gather hooks: cache-dit's hook registry then wraps on top
    # of ditbook's wraps (``ditbook.hooks`` refuses to wrap on top of a foreign replacement)
    _, stats, modules = route_ring_attention(tr, group=mesh["ring"].get_group())
    recorder.stats = stats
    cpc = _ContextParallelConfig(ulysses_degree=1, ring_degree=spec.ring)
    cpc.setup(dist.get_rank(), dist.get_world_size(), tr.device, mesh=mesh)
    _apply_context_parallel(tr, cpc, plan)
    # cache-dit's planners patch some processor classes to read ``_cp_config`` (set by its own
    # enable path, which this one skips): None on each instance says "no CP attention here"
    recorder.cp_config_undo = WrapGroup("no-cp-config")  # exact undo of the None configs below
    for module in tr.modules():
        proc = getattr(module, "processor", None)
        for attr in ("_cp_config", "_parallel_config"):
            if proc is not None and not hasattr(proc, attr):
                recorder.cp_config_undo.track(swap_attribute(proc, attr, None))
    return modules, recorder


@register
class Ring(ParallelTechnique):
    """Ring attention. A plain ``ring<N>`` runs ditbook's own (any device, key masks travel, judged by
    every rank's ``RingRecorder`` record); rings inside USP, CFG x ring or +cache are cache-dit's."""

    name = "ring"
    token = "ring"
    family = "ring attention"
    Settings = NoSettings
    order = 30

    @classmethod
    def own(cls, spec) -> bool:
        """Whether the plan's ring attention is ditbook's own (a plain ring<N>)."""
        return spec.ring > 1 and spec.ulysses == 1 and spec.cfg == 1 and len(spec.kinds()) == 1 and not spec.cache

    @classmethod
    def records(cls, spec) -> bool:
        return cls.own(spec)

    @classmethod
    def refusal(cls, spec, device: str | None = None) -> str | None:
        if device is not None and spec.ring > 1 and not cls.own(spec) and not str(device).startswith("cuda"):
            return ("cache-dit's ring attention (in USP, CFG x ring or +cache plans) takes the log-sum-exp from the "
                    "flash SDPA kernel: CUDA only; a plain ring<N> runs ditbook's own ring on any device")
        return None

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        if n == 1:
            return [Feasibility("ring", 1, False, None, "one process: nothing to split")]
        ok, why = ring_check(f, n, own=True)
        return [Feasibility("ring", n, ok, plan_name(ring=n),
                            f"ditbook's ring attention (partials merged by log-sum-exp, K/V over isend/irecv); {why}"
                            if ok else why)]

    @classmethod
    def check(cls, records: list, degree: int) -> dict:
        """Fails when no attention call went round the ring on every rank (``check_ring_sharding``)."""
        return check_ring_sharding(records, degree)
