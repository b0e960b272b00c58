"""Regional ``torch.compile``: the one helper the benchmark's compiled configurations, the cache
stage's compiled check and the parallel stage's ``+compile`` use.

diffusers' ``ModelMixin.compile_repeated_blocks`` where the model class names its repeated blocks
(``_repeated_blocks``), else ``nn.Module.compile`` of every block of the block lists the inspection
finds (``ditbook.inspect.static.find_block_lists``), in place. Both set each block's
``_compiled_call_impl``; the undo puts back exactly what every module of the transformer held.
"""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


def compile_regions(transformer, *, backend: str = "inductor", mode: str | None = None,
                    fullgraph: bool = False, dynamic: bool | None = None) -> tuple[Callable[[], None], str, int]:
    """Compile the transformer's repeated blocks in place; returns (undo, method, regions)."""
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph}
    if mode is not None:
        kwargs["mode"] = mode
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    saved = [(m, m.__dict__.get("_compiled_call_impl", _MISSING)) for m in transformer.modules()]

    def undo() -> None:
        for m, before in saved:
            if before is _MISSING:
                m.__dict__.pop("_compiled_call_impl", None)
            else:
                m._compiled_call_impl = before

    try:
        if getattr(transformer, "_repeated_blocks", None) and hasattr(transformer, "compile_repeated_blocks"):
            transformer.compile_repeated_blocks(**kwargs)
            method = "compile_repeated_blocks"
        else:
            from .inspect.static import find_block_lists

            lists, _ = find_block_lists(transformer)
            if not lists:
                raise ValueError(f"{type(transformer).__name__} has no block lists to compile regionally")
            for _, blocks in lists:
                for block in blocks:
                    block.compile(**kwargs)
            method = "block lists: " + ", ".join(name for name, _ in lists)
    except BaseException:
        undo()
        raise
    regions = sum(1 for m, before in saved
                  if m.__dict__.get("_compiled_call_impl") is not None and before in (_MISSING, None))
    return undo, method, regions


__all__ = ["compile_regions"]
