"""BlockDance (Zhang et al., CVPR 2025): in the later, structure-settled steps, reuse the output of
the first (shallow, structure-focused) blocks from the last fully computed step and compute only
the blocks after them.

*Cache steps* (every block runs, outputs kept) alternate with up to ``interval`` *reuse steps*
(the first ``depth`` blocks do not run). ``depth`` is calibrated per generation: the leading blocks
whose output changed (relative L1, between cache steps) less than ``threshold`` times the median
change so far; ``threshold = 0`` never reuses. Only the first block list is used, its last block
always runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .. import hooks
from ..adapter.build import PATTERN_OUTPUT_INDEX
from ._forecast import calls_per_step, install_patched, rel_l1, timestep_reader
from . import register
from .technique import CacheTechnique
from .teacache_fitted import _pack, _split_inputs


@dataclass
class BlockDanceSettings:
    threshold: float = 0.5  # a block is settled when its change is below this x the median change
    interval: int = 1  # reuse steps after each cache step
    warmup_steps: int = 2  # first calls (per CFG slot) always computed in full


@dataclass
class _Slot:
    calls: int = 0
    outputs: list = field(default_factory=list)  # per block: its output on the last cache step
    changes: list = field(default_factory=list)  # every block change measured on cache steps
    depth: int = 0
    reuse_run: int = 0


class BlockReuser:
    def __init__(self, adapter, config: BlockDanceSettings, slots: int):
        self.config = config
        self.slots = max(1, slots)
        self.reset()
        self.last_t = None
        self.mode = "cache"
        self.depth = 0
        self.depths: list[int] = []
        transformer = adapter.pipe.transformer
        self.read_t = timestep_reader(transformer)
        _, blocks, pattern = adapter.block_lists()[0]
        self.n = len(blocks)
        self.hs_i, self.ehs_i = PATTERN_OUTPUT_INDEX[pattern]
        self.handles = [hooks.wrap_method(transformer, "ditbook-blockdance", self._on_call)]
        for bi, block in enumerate(blocks):
            self.handles.append(hooks.wrap_method(block, "ditbook-blockdance", self._block(bi)))

    def reset(self):
        self.state = [_Slot() for _ in range(self.slots)]
        self.call = -1

    def _hidden(self, out):
        return out if self.ehs_i is None else out[self.hs_i]

    def _on_call(self, original, *args, **kwargs):
        t = self.read_t(args, kwargs)
        if t is not None and self.last_t is not None and t > self.last_t + 1e-9 and self.call % self.slots == self.slots - 1:
            self.reset()
        self.last_t = t
        self.call += 1
        st = self.state[self.call % self.slots]
        st.calls += 1
        cfg = self.config
        if (cfg.threshold > 0 and st.calls > cfg.warmup_steps and st.depth > 0 and st.outputs
                and st.reuse_run < cfg.interval):
            self.mode, self.depth = "reuse", st.depth
            st.reuse_run += 1
        else:
            self.mode, self.depth = "cache", 0
            st.reuse_run = 0
        self._fresh = []
        return original(*args, **kwargs)

    def _block(self, bi):
        def forward(original, *args, **kwargs):
            st = self.state[self.call % self.slots]
            if self.mode == "reuse" and bi < self.depth:
                if bi < self.depth - 1:
                    return _pack(*_split_inputs(args, kwargs), self.hs_i, self.ehs_i)  # not run: replaced below
                return st.outputs[bi]
            out = original(*args, **kwargs)
            if self.mode == "cache":
                self._fresh.append(out)
                if bi == self.n - 1:
                    self._end_cache_step(st)
            return out

        return forward

    def _end_cache_step(self, st: _Slot):
        fresh = self._fresh
        if len(fresh) != self.n:
            st.outputs, st.depth = fresh, 0
            return
        now = [self._hidden(o).detach().float() for o in fresh]
        if st.outputs and all(self._hidden(o).shape == h.shape for o, h in zip(st.outputs, now)):
            change = [rel_l1(h, self._hidden(o).float()) for h, o in zip(now, st.outputs)]
            st.changes += change
            limit = self.config.threshold * statistics.median(st.changes)
            depth = 0
            while depth < self.n - 1 and change[depth] < limit:
                depth += 1
            st.depth = depth
        else:
            st.depth = 0
        st.outputs = list(fresh)
        self.depths.append(st.depth)

    def remove(self):
        for h in reversed(self.handles):
            h.remove()
        self.handles = []


@register
class BlockDance(CacheTechnique):
    name = "blockdance"
    family = "BlockDance (shallow-block reuse, ditbook hooks)"
    Settings = BlockDanceSettings

    @classmethod
    def applicable(cls, adapter):
        lists = adapter.info.block_lists
        if not lists:
            return "no block lists"
        if lists[0].length < 2:
            return "the first block list has one block: nothing before the last block to reuse"
        return None

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        undo = install_patched(adapter, lambda: BlockReuser(adapter, config, calls_per_step(adapter)))
        undo.reuser = undo.installed
        return undo

    @classmethod
    def grid(cls, adapter, steps):
        return [BlockDanceSettings(threshold=t, interval=k, warmup_steps=2)
                for t, k in ((1.0, 1), (2.0, 1), (2.0, 2), (4.0, 1), (1.0, 2), (4.0, 2), (0.5, 1), (0.5, 2))]

    @classmethod
    def disabled(cls, adapter, steps):
        return BlockDanceSettings(threshold=0.0)


__all__ = ["BlockDance", "BlockDanceSettings", "BlockReuser"]
