"""Regional ``torch.compile``: the one helper the benchmark's compiled configurations, the cache
stage's compiled check and the parallel stage's ``+compile`` use.

diffusers' ``ModelMixin.compile_repeated_blocks`` where the model class names its repeated blocks
(``_repeated_blocks``), else ``nn.Module.compile`` of every block of the block lists the inspection
finds (``ditbook.arch.static.find_block_lists``), in place. Both set each block's
``_compiled_call_impl``; the undo puts back exactly what every module of the transformer held.

``compile_decoder(pipe)`` compiles the pipeline's image decoder the same way (``nn.Module.compile``
of ``pipe.vae.decoder``, diffusers' autoencoder layout), for configurations where the decode is a
visible share of a cached run's time; a pipeline without that module is refused with the reason.
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
    saved, undo = _saved_compiled_state(transformer)
    try:
        if getattr(transformer, "_repeated_blocks", None) and hasattr(transformer, "compile_repeated_blocks"):
            transformer.compile_repeated_blocks(**kwargs)
            method = "compile_repeated_blocks"
        else:
            from ..arch.static import find_block_lists

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


def _saved_compiled_state(root) -> tuple[list, Callable[[], None]]:
    """What every module under ``root`` holds as ``_compiled_call_impl`` now, and the undo that
    puts exactly that back."""
    saved = [(m, m.__dict__.get("_compiled_call_impl", _MISSING)) for m in root.modules()]

    def undo() -> None:
        for m, before in saved:
            if before is _MISSING:
                m.__dict__.pop("_compiled_call_impl", None)
            else:
                m._compiled_call_impl = before

    return saved, undo


class DecoderUnavailable(RuntimeError):
    """The pipeline has no decoder module to compile (the reason is the message)."""


def decoder_module(pipe):
    """``pipe.vae.decoder`` when it is a module (diffusers' autoencoders), else raise
    :class:`DecoderUnavailable` naming what is missing."""
    import torch

    vae = getattr(pipe, "vae", None)
    if not isinstance(vae, torch.nn.Module):
        raise DecoderUnavailable(f"{type(pipe).__name__} has no vae module, so there is no decoder to compile")
    dec = getattr(vae, "decoder", None)
    if not isinstance(dec, torch.nn.Module):
        raise DecoderUnavailable(f"{type(vae).__name__} has no decoder module to compile")
    return dec


def compile_decoder(pipe, *, backend: str = "inductor", mode: str | None = None,
                    dynamic: bool | None = None) -> tuple[Callable[[], None], str]:
    """Compile ``pipe.vae.decoder`` in place (``nn.Module.compile``); returns (undo, what). The
    undo puts back exactly what every module of the decoder held."""
    dec = decoder_module(pipe)
    kwargs: dict[str, Any] = {"backend": backend}
    if mode is not None:
        kwargs["mode"] = mode
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    _, undo = _saved_compiled_state(dec)
    try:
        dec.compile(**kwargs)
    except BaseException:
        undo()
        raise
    return undo, f"{type(pipe.vae).__name__}.decoder"


__all__ = ["DecoderUnavailable", "compile_decoder", "compile_regions", "decoder_module"]
