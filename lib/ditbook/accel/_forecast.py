"""What ditbook's own step-level caches share. The forecasters (MeanCache, Cubic) wrap the
transformer's ``forward``: per call it either runs and remembers its output, or returns a forecast
built from earlier computed calls, running no block, while the strategy's error estimate stays below
``threshold`` times the median relative L1 change between computed calls so far. Separate CFG keeps
one history per call slot; a new generation (the timestep goes up again) starts a clean history.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .. import hooks


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12))


def timestep_reader(transformer):
    """A function (args, kwargs) -> the call's timestep as a float, or None when the forward
    has no ``timestep`` parameter (then calls are numbered instead)."""
    import inspect

    try:
        params = list(inspect.signature(type(transformer).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    index = params.index("timestep") if "timestep" in params else None

    def read(args, kwargs):
        t = kwargs.get("timestep")
        if t is None and index is not None and len(args) > index:
            t = args[index]
        if torch.is_tensor(t):
            return float(t.flatten()[0])
        return float(t) if isinstance(t, (int, float)) else None

    return read


def main_tensor(out):
    """The output tensor of a transformer call (tensor, tuple's first, or a ``sample`` field)."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, dict):
        return next(iter(out.values()))
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def replace_tensor(out, tensor):
    """``out`` with its main tensor replaced, same container type."""
    if torch.is_tensor(out):
        return tensor
    if isinstance(out, tuple):
        return (tensor,) + tuple(out[1:])
    if isinstance(out, list):
        return [tensor] + list(out[1:])
    if hasattr(out, "sample"):
        return type(out)(sample=tensor)
    raise TypeError(f"cannot rebuild a {type(out).__name__}")


@dataclass
class Slot:
    times: list = field(default_factory=list)  # timesteps of computed calls, newest last
    outputs: list = field(default_factory=list)  # their output tensors (float32)
    template: object = None  # the last real output (its container type)
    changes: list = field(default_factory=list)  # relative change between consecutive computed calls
    skipped_run: int = 0
    calls: int = 0
    drift: float = 0.0  # accumulated error estimate since the last computed call
    last_t: float | None = None  # timestep of this slot's previous call (computed or not)


class CallForecaster:
    """Wraps ``transformer.forward``; ``predict(slot, t, previous call's t)`` -> (forecast,
    relative error estimate) or None when it cannot forecast yet."""

    keep = 4  # computed outputs remembered per slot

    def __init__(self, transformer, config, slots: int, predict, name: str):
        self.transformer = transformer
        self.config = config
        self.slots = max(1, slots)
        self.predict = predict
        self.state = [Slot() for _ in range(self.slots)]
        self.call = -1
        self.last_t = None
        self.skipped = 0
        self.computed = 0
        self.read_t = timestep_reader(transformer)
        self.handle = hooks.wrap_method(transformer, name, self._forward)

    def reset(self):
        self.state = [Slot() for _ in range(self.slots)]
        self.call = -1

    def _forward(self, original, *args, **kwargs):
        t = self.read_t(args, kwargs)
        if t is not None and self.last_t is not None and t > self.last_t + 1e-9 and self.call % self.slots == self.slots - 1:
            self.reset()
        self.call += 1
        st = self.state[self.call % self.slots]
        tt = float(st.calls) if t is None else t
        st.calls += 1
        self.last_t = t
        prev_t, st.last_t = st.last_t, tt
        cfg = self.config
        if (st.calls > cfg.warmup_steps and st.template is not None and st.changes
                and st.skipped_run < cfg.max_consecutive and cfg.threshold > 0):
            guess = self.predict(st, tt, prev_t)
            if guess is not None:
                tensor, err = guess
                budget = cfg.threshold * statistics.median(st.changes)
                if st.drift + err < budget:
                    st.drift += err
                    st.skipped_run += 1
                    self.skipped += 1
                    ref = main_tensor(st.template)
                    return replace_tensor(st.template, tensor.to(ref.dtype))
        out = original(*args, **kwargs)
        self.computed += 1
        y = main_tensor(out).detach().float()
        if st.outputs and st.outputs[-1].shape == y.shape:
            st.changes.append(rel_l1(y, st.outputs[-1]))
        elif st.outputs:  # a shape change (another size): start this slot's history again
            st.times, st.outputs, st.changes = [], [], []
        st.times = (st.times + [tt])[-self.keep:]
        st.outputs = (st.outputs + [y])[-self.keep:]
        st.template = out
        st.skipped_run = 0
        st.drift = 0.0
        return out

    def remove(self):
        self.handle.remove()


def calls_per_step(adapter) -> int:
    return 2 if adapter.info.has_separate_cfg else 1


def install_patched(adapter, build):
    """Patch the adapter and install ``build()`` (an object with ``remove()``); the undo removes it and
    unpatches (the object as ``undo.installed``). A failure on the way leaves the model as it was."""
    adapter.patch()
    try:
        installed = build()
    except BaseException:
        adapter.unpatch()
        raise

    def undo():
        try:
            installed.remove()
        finally:
            adapter.unpatch()

    undo.installed = installed
    return undo


def apply_forecaster(pipe, adapter, config, forecast, name: str):
    """Skip transformer calls by ``forecast``; the undo carries the ``CallForecaster`` as ``undo.forecaster``."""
    undo = install_patched(adapter, lambda: CallForecaster(pipe.transformer, config, calls_per_step(adapter),
                                                           forecast, name))
    undo.forecaster = undo.installed
    return undo

