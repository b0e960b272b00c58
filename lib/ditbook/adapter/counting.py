"""Counting real block (and attention) evaluations, per instance: each original block's and attention module's
``forward`` is wrapped before a strategy is applied, so a skipped block is simply not counted; ``calls`` records how
many blocks ran per transformer call."""

from __future__ import annotations

import torch

from ..hooks import WrapGroup


class EvalCounter:
    def __init__(self, transformer: torch.nn.Module, blocks: list[torch.nn.Module]):
        self.transformer = transformer
        self.blocks = list(blocks)
        self.attentions = [m for b in self.blocks for name, m in b.named_modules()
                           if name and name.split(".")[-1].startswith("attn") and any(True for _ in m.parameters())
                           and not any(n.split(".")[-1].startswith("attn") for n in name.split(".")[:-1])]
        self.block_evals = 0
        self.attention_evals = 0
        self.calls: list[int] = []  # blocks run per transformer call
        self._wraps = WrapGroup("ditbook.count-evals")
        with self._wraps.applying():  # all or nothing: a failure half-way leaves every module as it was
            for b in self.blocks:
                self._wraps.wrap(b, self._counted("block_evals"))
            for a in self.attentions:
                self._wraps.wrap(a, self._counted("attention_evals"))
            self._wraps.track(transformer.register_forward_pre_hook(self._on_call))

    def _counted(self, counter: str):
        def counted(original, *args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            if counter == "block_evals" and self.calls:
                self.calls[-1] += 1
            return original(*args, **kwargs)
        return counted

    def _on_call(self, module, args):
        self.calls.append(0)

    def reset(self):
        self.block_evals = self.attention_evals = 0
        self.calls = []

    def snapshot(self) -> dict:
        return {"block_evals": self.block_evals, "attention_evals": self.attention_evals,
                "transformer_calls": len(self.calls), "calls": list(self.calls)}

    def remove(self):
        """Every counting wrap and the call hook off again (ditbook.hooks: exact undo)."""
        self._wraps.remove()


def savings(run: dict, baseline: dict) -> dict:
    """Skipped fractions and cached steps of a counted run against the uncached count."""
    full = max(baseline["calls"]) if baseline["calls"] else 0
    cached_steps = sum(1 for c in run["calls"] if c < full)
    blocks = 1.0 - run["block_evals"] / baseline["block_evals"] if baseline["block_evals"] else 0.0
    attn = 1.0 - run["attention_evals"] / baseline["attention_evals"] if baseline["attention_evals"] else 0.0
    return {"skipped_fraction": round(blocks, 5), "attention_skipped_fraction": round(attn, 5),
            "cached_steps": cached_steps, "transformer_calls": run["transformer_calls"],
            "block_evals": run["block_evals"], "baseline_block_evals": baseline["block_evals"]}
