"""The attention route and its GQA path: a model's own ``scaled_dot_product_attention`` calls sent
through diffusers' dispatcher (``ditbook.cp.attention.route_attention``), grouped-query attention
taking SDPA's ``enable_gqa`` or K/V repeated, whichever the parallel stage measured faster
(``cp.attention.time_gqa``). Every parallel plan applies the route (it lets context parallelism
reach attention written outside diffusers); its check holds only where the model has GQA."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import register
from .technique import Handle, NothingDone, PipelineTechnique, Record

PATHS = ("enable_gqa", "repeat_interleave")


@dataclass
class GqaSettings:
    path: str = "enable_gqa"  # or "repeat_interleave"


@dataclass
class GqaRecord(Record):
    gqa_path: str = "enable_gqa"
    patched_modules: list[str] = field(default_factory=list)  # the attention modules routed
    calls: int = 0
    gqa_calls: int = 0  # calls with fewer key/value heads than query heads
    cp_calls: int = 0  # calls that went through the context-parallel attention


@register
class GqaPath(PipelineTechnique):
    name = "gqa_path"
    kind = "attention"
    family = "attention route and GQA path"
    Settings = GqaSettings
    order = 5

    @classmethod
    def applicable(cls, facts) -> str | None:
        """``facts``: the inspection's attention facts (``heads``, ``kv_heads``)."""
        heads, kv = getattr(facts, "heads", None), getattr(facts, "kv_heads", None)
        if not heads or not kv or kv >= heads:
            return "no grouped-query attention (as many key/value heads as query heads)"
        return None

    @classmethod
    def apply(cls, pipe, settings: GqaSettings) -> Handle:
        """Route the transformer's attention; ``handle.state`` is the ``AttentionRoute`` (context
        parallelism sets its scope)."""
        from ..cp.attention import route_attention

        if settings.path not in PATHS:
            raise ValueError(f"GQA path {settings.path!r} is not one of {PATHS}")
        route = route_attention(pipe.transformer, gqa_path=settings.path)
        return Handle(route.remove, lambda: GqaRecord(cls.name, settings.path, list(route.modules), route.calls,
                                                      route.gqa_calls, route.cp_calls), state=route)

    @classmethod
    def check(cls, record: GqaRecord | None) -> None:
        """Fails when no grouped-query attention call went through the route."""
        if record is None or record.gqa_calls == 0:
            raise NothingDone("GQA path: no grouped-query attention call went through the route")
