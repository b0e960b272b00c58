"""Which cache-dit ``ForwardPattern`` a block list corresponds to, and why (or why none): Patterns 0-2 call
``block(hidden_states, encoder_hidden_states, ...)``, 3-5 ``block(hidden_states, ...)``; the block returns ``H`` (2,
3), ``(H, E)`` (0, 4) or ``(E, H)`` (1, 5)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

H = "hidden_states"
E = "encoder_hidden_states"

# name -> (inputs, outputs) as in cache_dit.caching.forward_pattern.ForwardPattern
PATTERNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "Pattern_0": ((H, E), (H, E)),
    "Pattern_1": ((H, E), (E, H)),
    "Pattern_2": ((H, E), (H,)),
    "Pattern_3": ((H,), (H,)),
    "Pattern_4": ((H,), (H, E)),
    "Pattern_5": ((H,), (E, H)),
}


@dataclass
class PatternMatch:
    pattern: str | None
    compatible: list[str] = field(default_factory=list)
    reason: str = ""


def signature_params(fn) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.name != "self"]


def forward_params(block) -> list[str]:
    return [p.name for p in signature_params(block.forward)]


def match_pattern(block, output_roles: list[str] | None, receives_encoder: bool | None,
                  renamed: dict | None = None) -> PatternMatch:
    """Decide the pattern of one block (``renamed``: {H: image parameter, E: text parameter} from the trace)."""
    params = signature_params(block.forward)
    names = [p.name for p in params]
    note = ""
    if renamed and renamed.get(H) in names and H not in names:
        streams = [renamed[H]] + ([renamed[E]] if renamed.get(E) in names else [])
        rest = [p for p in params if p.name not in streams]
        params = [inspect.Parameter(H, inspect.Parameter.POSITIONAL_OR_KEYWORD)] + (
            [inspect.Parameter(E, inspect.Parameter.POSITIONAL_OR_KEYWORD)] if len(streams) > 1 else []) + rest
        names = [p.name for p in params]
        note = (f"traced streams {streams} taken as {[H, E][:len(streams)]}; cache-dit binds them by name, "
                f"so the loop is folded into blocks that take them: ")
    match = _match_named(params, names, output_roles, receives_encoder)
    match.reason = note + match.reason
    return match


def _match_named(params: list, names: list[str], output_roles, receives_encoder) -> PatternMatch:
    if H not in names:
        first = names[0] if names else "nothing"
        return PatternMatch(None, [], f"block.forward has no parameter named '{H}' (its first is '{first}'); "
                                      f"cache-dit binds the image stream by that name, so a wrapper that renames "
                                      f"the arguments is needed")
    if output_roles is None:
        return PatternMatch(None, [], "outputs unknown without a traced call (the return annotation does not say "
                                      "which output is the image stream)")
    if any(r not in (H, E) for r in output_roles) or not output_roles:
        return PatternMatch(None, [], f"outputs {output_roles} are not the image/text streams cache-dit expects "
                                      f"(1 or 2 tensors: hidden_states, encoder_hidden_states)")
    if len(output_roles) > 2 or output_roles.count(H) != 1:
        return PatternMatch(None, [], f"outputs {output_roles}: cache-dit handles one image stream and at most one "
                                      f"text stream")
    out = tuple(output_roles)
    e_second = len(names) > 1 and names[1] == E
    e_required = e_second and params[1].default is inspect.Parameter.empty
    takes_e = E in names and bool(receives_encoder)
    compatible = []
    for name, (ins, outs) in PATTERNS.items():
        if outs != out:
            continue
        if E in ins:
            if not (takes_e and e_second):
                continue
        elif E in outs and takes_e:
            # the wrapper would feed every block the first block's text stream, not the updated one
            continue
        compatible.append(name)
    if not compatible:
        if E in out and not e_second:
            reason = (f"the block returns the text stream but its second parameter is '{names[1] if len(names) > 1 else None}', "
                      f"not '{E}'; cache-dit passes the text stream as the second positional argument")
        else:
            reason = f"no cache-dit pattern has outputs {list(out)} with these inputs ({names[:3]}...)"
        return PatternMatch(None, [], reason)
    if out == (H,) and "Pattern_2" in compatible and "Pattern_3" in compatible:
        preferred = "Pattern_2" if e_required else "Pattern_3"
    else:
        preferred = compatible[0]
    ins, outs = PATTERNS[preferred]
    reason = f"in {list(ins)} -> out {list(outs)}"
    if len(compatible) > 1:
        reason += f"; also runs as {', '.join(c for c in compatible if c != preferred)}"
    return PatternMatch(preferred, compatible, reason)


def static_output_roles(block) -> list[str] | None:
    """Output roles without a trace: diffusers' block metadata, else a bare ``-> torch.Tensor`` means ``[H]``."""
    meta = diffusers_block_metadata(type(block))
    if meta is not None:
        roles: dict[int, str] = {}
        if meta.return_hidden_states_index is not None:
            roles[meta.return_hidden_states_index] = H
        if meta.return_encoder_hidden_states_index is not None:
            roles[meta.return_encoder_hidden_states_index] = E
        if roles and sorted(roles) == list(range(len(roles))):
            return [roles[i] for i in range(len(roles))]
    try:
        ann = inspect.signature(block.forward).return_annotation
    except (TypeError, ValueError):
        return None
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    if text in ("Tensor", "torch.Tensor") or ann is getattr(__import__("torch"), "Tensor"):
        return [H]
    return None


def diffusers_block_metadata(block_cls):
    """diffusers' hook metadata for a block class (``TransformerBlockRegistry``), or None."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:  # an older diffusers without the registry
        return None
    try:
        return TransformerBlockRegistry.get(block_cls)
    except Exception:  # not registered (ValueError) or a registry import problem
        return None
