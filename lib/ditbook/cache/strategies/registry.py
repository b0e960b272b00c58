"""The strategy registry: the ``Strategy`` base every strategy file subclasses, and ``register``."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Callable, ClassVar

REGISTRY: dict[str, type["Strategy"]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


class Strategy:
    name: ClassVar[str]
    family: ClassVar[str]
    Config: ClassVar[type]

    @classmethod
    def config(cls, **values):
        names = {f.name for f in fields(cls.Config)}
        return cls.Config(**{k: v for k, v in values.items() if k in names})

    @classmethod
    def config_dict(cls, config) -> dict:
        return asdict(config)

    @classmethod
    def applicable(cls, adapter) -> str | None:
        return None

    @classmethod
    def apply(cls, pipe, adapter, config) -> Callable[[], None]:
        raise NotImplementedError

    @classmethod
    def grid(cls, adapter, steps: int) -> list:
        return [cls.Config()]

    @classmethod
    def disabled(cls, adapter, steps: int):
        return None
