"""The one way ditbook changes a module's (or any object's) method at run time.

In the shape of diffusers' ``ModelHook``/``HookRegistry``, reduced to what ditbook needs: wrap an
instance's ``forward`` (or another method such as ``pipe.encode_prompt`` or ``vae.decode``) under a
name, get a handle, remove it by name; wraps nest (the newest is outermost) and come off in any
order; when the last one comes off, the attribute is exactly what it was before the first one went
on — the class's method again (nothing left in the instance ``__dict__``) or the very object that
was set on the instance. Classes are never touched: every wrap is per instance.

    handle = wrap_method(module, "count-calls", lambda original, *a, **kw: original(*a, **kw))
    ...
    handle.remove()          # or remove_wrap(module, "count-calls"), or `with wrap_method(...):`

A wrapper is ``wrapper(original, *args, **kwargs)``: ``original`` is the next inner callable (the
previous wrap, or the method as it was).

Something else put on top of a wrap (a diffusers hook, user code) is seen by identity — the
registry remembers the callable it installed — and both wrapping again and removing then refuse
with a named ``WrapError`` rather than drop the other one. ``WrapGroup`` applies several wraps (and
torch hook handles) as one change: all or nothing, removed together.

Data attributes and registry entries of objects ditbook does not own (a processor's config, a
diffusers module constant, a diffusers registry dict) change through ``swap_attribute`` /
``set_item``, whose ``SwapHandle`` undoes exactly the same way. Nothing in ``lib/`` uses
``unittest.mock``, assigns a method or a module attribute directly, or writes an entry of another
library's registry (``sys.modules``, diffusers' and cache-dit's registries) but through
``set_item`` / ``swap_attribute`` (``tests/test_structure.py``).

Written here rather than taken from diffusers: diffusers' registry wraps ``forward`` of
``torch.nn.Module`` only and keeps hooks with state resets for its cache techniques; ditbook also
wraps pipeline and VAE methods and needs the exact-undo guarantee above.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

_REGISTRY_ATTR = "_ditbook_wraps"
_CALL_BASE = "_ditbook_call_base"  # on a class made by wrap_call: the instance's class before
class _Missing:
    """The "nothing was there" marker. A deep copy of a wrapped object (the parallel worker copies a
    pristine pipeline per plan) keeps this very marker: a copied plain ``object()`` was another object,
    and the copy's wrap called it as the method it stood in for ("'object' object is not callable")."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()

Wrapper = Callable[..., Any]


@dataclass
class _Stack:
    """The wraps of one attribute of one object, innermost first, and what was there before."""

    before: Any  # the instance-dict value before the first wrap, or _MISSING (the class's method)
    wraps: list[tuple[str, Wrapper]] = field(default_factory=list)
    installed: Any = None  # the callable this registry put on the instance (identity is the check)


class WrapError(RuntimeError):
    """A wrap was asked under a name already in use, or removed when it is not there."""


def _stacks(obj: Any, create: bool) -> dict[str, _Stack] | None:
    stacks = obj.__dict__.get(_REGISTRY_ATTR)
    if stacks is None and create:
        stacks = {}
        object.__setattr__(obj, _REGISTRY_ATTR, stacks)
    return stacks


def _original(obj: Any, attr: str, stack: _Stack) -> Callable:
    if stack.before is not _MISSING:
        return stack.before
    # the class the instance had before ``wrap_call`` gave it one that dispatches ``__call__``
    cls = type(obj).__dict__.get(_CALL_BASE, type(obj))
    return getattr(cls, attr).__get__(obj, type(obj))


def _install(obj: Any, attr: str, stack: _Stack) -> None:
    """Compose the stack into one callable on the instance (or restore what was there)."""
    if not stack.wraps:
        if stack.before is _MISSING:
            obj.__dict__.pop(attr, None)
        else:
            object.__setattr__(obj, attr, stack.before)
        return
    base = fn = _original(obj, attr, stack)
    for _name, wrapper in stack.wraps:
        fn = functools.partial(wrapper, fn)
    inner = fn

    def wrapped(*args, **kwargs):
        return inner(*args, **kwargs)

    # name, docstring and ``__wrapped__`` of the method as it was, so ``inspect.signature`` of the
    # wrapped attribute still reads the real parameters
    with contextlib.suppress(AttributeError, TypeError):
        functools.update_wrapper(wrapped, base)
    wrapped.__ditbook_wraps__ = tuple(n for n, _ in stack.wraps)  # type: ignore[attr-defined]
    stack.installed = wrapped
    object.__setattr__(obj, attr, wrapped)


def _replaced_outside(obj: Any, attr: str, stack: _Stack) -> bool:
    """Whether someone put another callable on ``obj.<attr>`` over ours. By identity: a wrapper
    made with ``functools.update_wrapper`` (diffusers' hook registry does so) copies our marker."""
    return obj.__dict__.get(attr, _MISSING) is not stack.installed


@dataclass
class WrapHandle:
    """Removes one named wrap; idempotent; usable as a context manager."""

    obj: Any
    name: str
    attr: str = "forward"

    def remove(self) -> None:
        if is_wrapped(self.obj, self.name, self.attr):
            remove_wrap(self.obj, self.name, self.attr)

    def __enter__(self) -> "WrapHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def wrap_method(obj: Any, name: str, wrapper: Wrapper, attr: str = "forward") -> WrapHandle:
    """Wrap ``obj.<attr>`` (default ``forward``) under ``name``; the newest wrap is outermost."""
    stacks = _stacks(obj, create=True)
    stack = stacks.get(attr)
    if stack is None:
        current = obj.__dict__.get(attr, _MISSING)
        if current is _MISSING and not callable(getattr(type(obj), attr, None)):
            raise WrapError(f"{type(obj).__name__} has no method {attr!r} to wrap")
        stack = stacks[attr] = _Stack(before=current)
    elif _replaced_outside(obj, attr, stack):
        # someone replaced the attribute behind the registry's back: wrapping again would drop it
        raise WrapError(f"{type(obj).__name__}.{attr} was replaced outside ditbook.hooks while wrapped "
                        f"by {[n for n, _ in stack.wraps]}")
    if any(n == name for n, _ in stack.wraps):
        raise WrapError(f"{type(obj).__name__}.{attr} is already wrapped as {name!r}")
    stack.wraps.append((name, wrapper))
    _install(obj, attr, stack)
    return WrapHandle(obj, name, attr)


def remove_wrap(obj: Any, name: str, attr: str = "forward") -> None:
    """Take the wrap ``name`` off ``obj.<attr>``; the others stay, in their order."""
    stacks = _stacks(obj, create=False) or {}
    stack = stacks.get(attr)
    if stack is None or not any(n == name for n, _ in stack.wraps):
        raise WrapError(f"{type(obj).__name__}.{attr} has no wrap named {name!r}")
    if _replaced_outside(obj, attr, stack):
        # another mechanism (a diffusers hook, user code) wrapped on top of ours: undoing ours now
        # would silently drop theirs, so refuse and name it
        raise WrapError(f"{type(obj).__name__}.{attr} was replaced outside ditbook.hooks on top of "
                        f"{[n for n, _ in stack.wraps]}; remove that first")
    stack.wraps = [(n, w) for n, w in stack.wraps if n != name]
    _install(obj, attr, stack)
    if not stack.wraps:
        del stacks[attr]
        if not stacks:
            obj.__dict__.pop(_REGISTRY_ATTR, None)


def is_wrapped(obj: Any, name: str | None = None, attr: str = "forward") -> bool:
    stack = (_stacks(obj, create=False) or {}).get(attr)
    if stack is None:
        return False
    return name is None or any(n == name for n, _ in stack.wraps)


def wrap_names(obj: Any, attr: str = "forward") -> list[str]:
    """The wraps on ``obj.<attr>``, innermost first."""
    stack = (_stacks(obj, create=False) or {}).get(attr)
    return [n for n, _ in stack.wraps] if stack else []


@dataclass
class CallWrapHandle(WrapHandle):
    """Removes one ``wrap_call`` wrap; when it was the last, the instance is of its own class again."""

    def remove(self) -> None:
        super().remove()
        base = type(self.obj).__dict__.get(_CALL_BASE)
        if base is not None and not is_wrapped(self.obj, None, "__call__"):
            object.__setattr__(self.obj, "__class__", base)


def wrap_call(obj: Any, name: str, wrapper: Wrapper) -> CallWrapHandle:
    """Wrap what ``obj(...)`` runs (a pipeline's ``__call__``) under ``name``, for this instance only.

    Python looks ``__call__`` up on the type, never on the instance, so a wrap of the instance's
    ``__call__`` alone would not run on ``obj(...)``. The instance is given a class of its own: a
    subclass of its class with the same name, module and qualified name, whose ``__call__`` runs the
    instance's wrapped ``__call__``; the wraps themselves are ``wrap_method``'s. When the last one
    comes off, the instance is of its original class again (the class itself is never changed)."""
    cls = type(obj)
    if _CALL_BASE not in cls.__dict__:
        base = cls

        def __call__(self, *args, **kwargs):
            own = self.__dict__.get("__call__")
            return own(*args, **kwargs) if own is not None else base.__call__(self, *args, **kwargs)

        with contextlib.suppress(AttributeError, TypeError):
            functools.update_wrapper(__call__, base.__call__)  # the real parameters for inspect.signature
        own_cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                                "__qualname__": base.__qualname__, _CALL_BASE: base})
        object.__setattr__(obj, "__class__", own_cls)
    try:
        handle = wrap_method(obj, name, wrapper, attr="__call__")
    except BaseException:
        if not is_wrapped(obj, None, "__call__") and _CALL_BASE in type(obj).__dict__:
            object.__setattr__(obj, "__class__", type(obj).__dict__[_CALL_BASE])
        raise
    return CallWrapHandle(obj, name, "__call__")


class WrapGroup:
    """Wraps applied together and removed together, newest first; also any handle with a
    ``remove()`` (a torch hook handle) that belongs to the same change.

    Applying inside ``with group.applying():`` is all or nothing: an error half-way takes off
    what went on and re-raises, so every object is as it was before.

        group = WrapGroup("count-evals")
        with group.applying():
            for block in blocks:
                group.wrap(block, counted)
        ...
        group.remove()
    """

    def __init__(self, name: str):
        self.name = name
        self.handles: list[Any] = []

    def wrap(self, obj: Any, wrapper: Wrapper, attr: str = "forward", name: str | None = None) -> WrapHandle:
        handle = wrap_method(obj, name or self.name, wrapper, attr)
        self.handles.append(handle)
        return handle

    def track(self, handle: Any) -> Any:
        """Keep another undo handle (anything with ``remove()``) with this group."""
        self.handles.append(handle)
        return handle

    @property
    def objects(self) -> list[Any]:
        return [h.obj for h in self.handles if isinstance(h, WrapHandle)]

    def remove(self) -> None:
        """Every handle, newest first; all are tried, the first error is raised afterwards."""
        error: BaseException | None = None
        while self.handles:
            handle = self.handles.pop()
            try:
                handle.remove()
            except Exception as exc:  # noqa: BLE001 - undo the rest, then report
                error = error or exc
        if error is not None:
            raise error

    @contextlib.contextmanager
    def applying(self):
        try:
            yield self
        except BaseException:
            self.remove()
            raise

    def __len__(self) -> int:
        return len(self.handles)


def remove_all(obj: Any) -> None:
    """Every wrap on every attribute of ``obj``, newest first."""
    for attr, stack in list((_stacks(obj, create=False) or {}).items()):
        for name, _ in reversed(list(stack.wraps)):
            remove_wrap(obj, name, attr)


def snapshot_instance_attrs(root, attrs: tuple[str, ...] = ("forward", "_is_patched")) -> Callable[[], None]:
    """For code ditbook does not own that patches instances and does not undo it all (cache-dit's
    patch functors replace ``forward`` on a transformer and on some blocks and mark it
    ``_is_patched``; ``disable_cache`` leaves both): record ``attrs`` in the instance ``__dict__``
    of ``root`` and every submodule, and return ``restore()``, which puts each back exactly —
    removed where it was absent, the very same object where it was present."""
    modules = list(root.modules()) if hasattr(root, "modules") else [root]
    saved = [(m, {a: m.__dict__.get(a, _MISSING) for a in attrs}) for m in modules]

    def restore() -> None:
        for m, values in saved:
            for a, v in values.items():
                if v is _MISSING:
                    m.__dict__.pop(a, None)
                else:
                    object.__setattr__(m, a, v)

    return restore


# -- attributes and registry entries -------------------------------------------------------------
def _label(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


@dataclass
class SwapHandle:
    """Undoes one ``swap_attribute`` / ``set_item``: the attribute (or entry) exactly as it was —
    absent again where it was absent (a class attribute shows through again), else the very object
    that was there. Refuses (``WrapError``) when someone changed it after the swap; idempotent; a
    context manager."""

    obj: Any
    name: Any
    before: Any
    value: Any
    item: bool = False  # a container entry (``obj[name]``) rather than an attribute
    done: bool = False

    def _current(self) -> Any:
        if self.item:
            return self.obj[self.name] if self.name in self.obj else _MISSING
        return vars(self.obj).get(self.name, _MISSING)

    def remove(self) -> None:
        if self.done:
            return
        if self._current() is not self.value:
            raise WrapError(f"{_label(self.obj)}.{self.name} was changed outside ditbook.hooks while swapped")
        if self.item:
            if self.before is _MISSING:
                del self.obj[self.name]
            else:
                self.obj[self.name] = self.before
        elif self.before is _MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.before)
        self.done = True

    def __enter__(self) -> "SwapHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def swap_attribute(obj: Any, name: str, value: Any) -> SwapHandle:
    """Set ``obj.<name>`` (an instance, a class or a module: a module's constant is process-wide
    while swapped, so keep the handle's scope short) and return the handle that puts it back."""
    before = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    return SwapHandle(obj, name, before, value)


def set_item(container: Any, key: Any, value: Any) -> SwapHandle:
    """Set ``container[key]`` (a registry dict of another library) and return the handle that puts
    the entry back exactly (removed where it was absent)."""
    before = container[key] if key in container else _MISSING
    container[key] = value
    return SwapHandle(container, key, before, value, item=True)


__all__ = ["SwapHandle", "swap_attribute", "set_item", "snapshot_instance_attrs", "WrapError", "WrapHandle", "CallWrapHandle",
           "WrapGroup", "wrap_method", "wrap_call", "remove_wrap", "is_wrapped", "wrap_names", "remove_all"]
