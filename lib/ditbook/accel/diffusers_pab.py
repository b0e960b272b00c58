"""diffusers Pyramid Attention Broadcast: inside a timestep window, attention outputs are
reused for ``skip_range`` - 1 steps out of ``skip_range``. diffusers finds only its own attention
classes by name; here every self-attention module the inspection finds in the blocks
(``arch.static.attention_modules``), of any class, gets diffusers' own
``PyramidAttentionBroadcastHook`` through its ``HookRegistry``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .technique import CacheTechnique
from ._diffusers_hooks import finish_install, timestep_callback


@dataclass
class PABSettings:
    skip_range: int = 2
    window_low: int = 100
    window_high: int = 800


def attention_targets(blocks) -> list:
    """The outermost attention modules inside ``blocks`` (the inspection's definition), self
    attention only."""
    from ..arch.static import attention_modules

    out = []
    for block in blocks:
        found = attention_modules(block)
        names = [n for n, _ in found]
        for name, module in found:
            if any(name.startswith(other + ".") for other in names if other != name):
                continue  # inside another attention module: the outer one is hooked
            if getattr(module, "is_cross_attention", False):
                continue
            out.append(module)
    return out


@register
class DiffusersPAB(CacheTechnique):
    name = "diffusers_pab"
    family = "diffusers PAB"
    Settings = PABSettings

    @classmethod
    def applicable(cls, adapter):
        if not attention_targets(adapter.original_blocks()):
            return "the inspection finds no self-attention module (q/k/v projections) in the blocks"
        return None

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        from diffusers.hooks import HookRegistry
        from diffusers.hooks import pyramid_attention_broadcast as pab

        adapter.patch()
        current, handle = timestep_callback(pipe, pipe.transformer)
        # a registry on the transformer too: removal (and diffusers' cache contexts) recurse from there
        HookRegistry.check_if_exists_or_initialize(pipe.transformer)
        for module in attention_targets(adapter.original_blocks()):
            hook = pab.PyramidAttentionBroadcastHook((config.window_low, config.window_high), config.skip_range,
                                                     current)
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, pab._PYRAMID_ATTENTION_BROADCAST_HOOK)
        return finish_install(pipe, adapter, (pab._PYRAMID_ATTENTION_BROADCAST_HOOK,), handle)

    @classmethod
    def grid(cls, adapter, steps):
        return [PABSettings(skip_range=k, window_low=lo, window_high=hi)
                for k in (2, 3) for lo, hi in ((100, 800), (50, 950))]

    @classmethod
    def disabled(cls, adapter, steps):
        return PABSettings(skip_range=1, window_low=0, window_high=0)
