"""A TeaCache-style step-level cache whose rescale polynomial is fitted on this model.

TeaCache skips a whole transformer call (reusing its residual) while the accumulated, rescaled
relative L1 change of the first block's input since the last computed step stays below a
threshold. ``calibrate`` fits the rescale polynomial ("input change" -> "output residual change")
on a run of *this* model with ``numpy.polyfit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import register
from ._forecast import calls_per_step, install_patched, rel_l1
from .technique import CacheTechnique
from ..adapter.build import PATTERN_OUTPUT_INDEX
from ..hooks import WrapGroup


@dataclass
class TeaCacheSettings:
    threshold: float = 0.3  # skip while the accumulated rescaled change stays below this
    coefficients: list = field(default_factory=list)  # rescale polynomial, highest power first
    warmup_steps: int = 1  # first calls always computed
    max_consecutive: int = 3  # never skip more than this many calls in a row


def _split_inputs(args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    enc = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 and torch.is_tensor(args[1]) else None)
    return hidden, enc


def _pack(h, e, hs_i: int, ehs_i: int | None):
    """A block's output from its hidden and encoder streams, in the pattern's order."""
    if ehs_i is None:
        return h
    out = [None, None]
    out[hs_i], out[ehs_i] = h, e
    return tuple(out)


def _signal_tensors(args, kwargs) -> list[torch.Tensor]:
    """Block 0's hidden states plus every conditioning embedding (2-D tensor) it receives."""
    hidden, _ = _split_inputs(args, kwargs)
    out = [hidden]
    for v in list(args[1:]) + list(kwargs.values()):
        if torch.is_tensor(v) and v.ndim == 2 and v.is_floating_point() and v is not hidden:
            out.append(v)
    return out


class StepSkipper:
    """Per-instance wrappers on every block-list entry; one decision per transformer call."""

    def __init__(self, adapter, config: TeaCacheSettings, calls_per_step: int, record: bool = False):
        self.adapter = adapter
        self.config = config
        self.slots = max(1, calls_per_step)
        self.record = record
        self.records: list[dict] = []
        self.reset()
        self.lists = adapter.block_lists()
        self._inputs = {}
        self._outputs = {}
        self.poly = np.poly1d(config.coefficients) if config.coefficients else None
        self._last_t = None
        self._wraps = WrapGroup("ditbook.teacache-fitted")
        with self._wraps.applying():  # all or nothing
            # a new pipeline run starts when the timestep goes up again: start from a clean state
            self._wraps.track(adapter.pipe.transformer.register_forward_pre_hook(self._on_call, with_kwargs=True))
            for li, (_, blocks, pattern) in enumerate(self.lists):
                for bi, block in enumerate(blocks):
                    self._wraps.wrap(block, self._wrapper(li, bi, len(blocks), pattern))

    def _wrapper(self, li, bi, n, pattern):
        hs_i, ehs_i = PATTERN_OUTPUT_INDEX[pattern]

        def forward(original, *args, **kwargs):
            if li == 0 and bi == 0:
                self._begin_call(args, kwargs)
            h, e = _split_inputs(args, kwargs)
            if bi == 0:
                self._inputs[li] = (h, e)
            if self.skip:
                if bi < n - 1:
                    return _pack(h, e, hs_i, ehs_i)
                rh, re_ = self.state[self.call % self.slots]["residuals"][li]
                h_in, e_in = self._inputs[li]
                return _pack(h_in + rh, e_in + re_ if (re_ is not None and e_in is not None) else e_in, hs_i, ehs_i)
            out = original(*args, **kwargs)
            if self.record and li == 0 and bi == 0:
                ho0 = out if ehs_i is None else out[hs_i]
                st = self.state[self.call % self.slots]
                r0 = (ho0 - h).detach().float()
                self._first_change = rel_l1(r0, st["rec_r0"]) if st.get("rec_r0") is not None else None
                st["rec_r0"] = r0
            if bi == n - 1:
                if ehs_i is None:
                    ho, eo = out, None
                else:
                    ho, eo = out[hs_i], out[ehs_i]
                h_in, e_in = self._inputs[li]
                self._outputs[li] = (ho - h_in, (eo - e_in) if (eo is not None and e_in is not None
                                                              and eo.shape == e_in.shape) else None)
                if li == len(self.lists) - 1:
                    self._end_call()
            return out

        return forward

    def _begin_call(self, args, kwargs):
        self.call += 1
        st = self.state[self.call % self.slots]
        sig = [t.detach().float() for t in _signal_tensors(args, kwargs)]
        change = None
        if st["prev"] is not None and all(a.shape == b.shape for a, b in zip(sig, st["prev"])):
            change = float(np.mean([rel_l1(a, b) for a, b in zip(sig, st["prev"])]))
        st["prev"] = sig
        self._change = change
        cfg = self.config
        skip = False
        if (not self.record and change is not None and st["calls"] >= cfg.warmup_steps
                and st["residuals"] is not None and st["skipped_run"] < cfg.max_consecutive):
            rescaled = float(self.poly(change)) if self.poly is not None else change
            st["acc"] += max(rescaled, 0.0)
            skip = st["acc"] < cfg.threshold
        if not skip:
            st["acc"] = 0.0
            st["skipped_run"] = 0
        else:
            st["skipped_run"] += 1
        st["calls"] += 1
        self.skip = skip

    def _end_call(self):
        st = self.state[self.call % self.slots]
        residuals = [self._outputs[li] for li in range(len(self.lists))]
        if self.record:
            prev = st.get("rec_res")
            if prev is not None and self._change is not None:
                self.records.append({"call": self.call, "x": self._change,
                                     "y": rel_l1(residuals[-1][0], prev[-1][0]),
                                     "first_block": getattr(self, "_first_change", None)})
            st["rec_res"] = residuals
        st["residuals"] = residuals

    def reset(self):
        self.state = [dict(prev=None, acc=0.0, residuals=None, calls=0, skipped_run=0) for _ in range(self.slots)]
        self.call = -1
        self.skip = False

    def _on_call(self, module, args, kwargs):
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if torch.is_tensor(t):
            t = float(t.flatten()[0])
            if self._last_t is not None and t > self._last_t + 1e-9:
                self.reset()
            self._last_t = t

    def remove(self):
        self._wraps.remove()


def fit_polynomial(records: list[dict], degree: int = 2) -> list[float]:
    """Least-squares fit of output residual change on input change (numpy.polyfit)."""
    x = np.array([r["x"] for r in records])
    y = np.array([r["y"] for r in records])
    if len(x) < degree + 2:
        return [1.0, 0.0]
    return [float(c) for c in np.polyfit(x, y, degree)]


def _install(adapter, config: TeaCacheSettings, record: bool = False):
    """The undo of a ``StepSkipper`` on the patched adapter (``undo.skipper``)."""
    undo = install_patched(adapter, lambda: StepSkipper(adapter, config, calls_per_step(adapter), record=record))
    undo.skipper = undo.installed
    return undo


@register
class TeaCacheFitted(CacheTechnique):
    name = "teacache_fitted"
    family = "TeaCache-style (fitted on this model)"
    Settings = TeaCacheSettings

    @classmethod
    def fit(cls, adapter, run_once, degree: int = 2) -> tuple[list[float], list[dict]]:
        """Run ``run_once()`` recording input and output changes; the fitted coefficients and records."""
        undo = _install(adapter, TeaCacheSettings(), record=True)
        try:
            run_once()
        finally:
            undo()
        return fit_polynomial(undo.skipper.records, degree), undo.skipper.records

    @classmethod
    def calibrate(cls, pipe, adapter, run, steps) -> dict:
        """The rescale polynomial fitted on every calibration case of this model (``run()``)."""
        return {"coefficients": cls.fit(adapter, run)[0]}

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        return _install(adapter, config)

    @classmethod
    def grid(cls, adapter, steps):
        return [TeaCacheSettings(threshold=t, warmup_steps=1, max_consecutive=k)
                for k in (1, 2) for t in (0.2, 0.3, 0.1, 0.5)]

    @classmethod
    def disabled(cls, adapter, steps):
        return TeaCacheSettings(threshold=0.0, coefficients=[1.0, 0.0])
