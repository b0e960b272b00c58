"""What every acceleration technique is: a settings dataclass, ``applicable(facts)``, ``apply(...)``
returning a :class:`Handle` (an exact undo, and a typed :class:`Record` of what it did, read from the
model or the run), and ``check(record)``, which raises :class:`NothingDone` when the technique
changed nothing. Kinds (``Technique.kind``): ``cache`` (:class:`CacheTechnique`), ``parallel``
(:class:`ParallelTechnique`), and the pipeline-wide ``compile``, ``quantize``, ``graphs``,
``attention``. A stage asks the registry (``ditbook.accel``) for the techniques of a kind; it never
branches on a technique's name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, ClassVar

KINDS = ("cache", "parallel", "compile", "quantize", "graphs", "attention")


@dataclass
class NoSettings:
    """The settings of a technique that takes none of its own (its degree or the card says all)."""


class NothingDone(RuntimeError):
    """A technique's ``check`` found that applying it changed nothing it claims to change."""


@dataclass
class Record:
    """What a technique did, measured on the model or the run. Subclasses add their figures."""

    technique: str

    def to_dict(self) -> dict:
        return asdict(self)


class Handle:
    """What ``apply`` returns: ``undo()`` puts back exactly what was there (once; later calls do
    nothing), ``record()`` reads what the technique did so far (None where it keeps none); ``state``:
    what it installed, where a driver builds on it (the attention route context parallelism scopes)."""

    def __init__(self, undo: Callable[[], None] | None = None, record: Callable[[], Record | None] | None = None,
                 state: Any = None):
        self._undo = undo
        self._record = record
        self.state = state
        self.undone = False

    def undo(self) -> None:
        if self.undone:
            return
        self.undone = True
        if self._undo is not None:
            self._undo()

    def record(self) -> Record | None:
        return self._record() if self._record is not None else None

    def __call__(self) -> None:  # a handle is also its undo callable
        self.undo()


class Technique:
    """The base of every technique module's class (registered with ``ditbook.accel.register``)."""

    name: ClassVar[str]
    kind: ClassVar[str]
    family: ClassVar[str]  # the name a reviewer reads in tables ("cache-dit DBCache")
    Settings: ClassVar[type]

    @classmethod
    def settings(cls, **values) -> Any:
        """The settings dataclass from a mapping; keys it does not have are left out."""
        names = {f.name for f in fields(cls.Settings)}
        return cls.Settings(**{k: v for k, v in values.items() if k in names})

    @classmethod
    def settings_dict(cls, settings) -> dict:
        return asdict(settings)

    @classmethod
    def applicable(cls, facts) -> str | None:
        """Why the technique cannot run on a model with these facts (None: it can)."""
        return None

    @classmethod
    def check(cls, record: Record | None) -> None:
        """Raise :class:`NothingDone` when ``record`` shows the technique did nothing."""


class PipelineTechnique(Technique):
    """A technique on the whole loaded pipeline: ``apply(pipe, settings) -> Handle``. The benchmark
    asks each one, in ``order``, for its settings from the card (``requested``, None when off) and
    the rows it adds beside the others (``variants``: e.g. a compiled twin of each)."""

    order: ClassVar[int] = 50

    @classmethod
    def apply(cls, pipe, settings) -> Handle:
        raise NotImplementedError

    @classmethod
    def requested(cls, card) -> Any:
        return None

    @classmethod
    def variants(cls, ctx, pipe, configs: list, settings, log: Callable[[str], None] = print, **options) -> list:
        """The rows this technique adds beside ``configs`` (``options``: for one that measures first)."""
        return []


@dataclass
class Feasibility:
    """One parallel kind at one world size: whether it applies, the plan to launch, why (or why not)."""

    kind: str
    world_size: int
    feasible: bool
    plan: str | None  # the plan name to launch, when it is a launchable plan
    reason: str  # why not, or how (padding, replicated KV, ...)
    launchable: bool = True  # ditbook's launcher runs it

    def to_dict(self) -> dict:
        return asdict(self)


class ParallelTechnique(Technique):
    """One way to spread a generation over processes, named in plan names by its ``token`` (``tp``
    in ``tp2``); ``judge(facts, n)``: its feasibility rows at world size ``n``. A kind that
    ``multiplies`` the world takes its own ranks, else it rides on any plan's ranks (VAE, text
    encoders). ``on_rank``: the worker applies it on each rank (``apply_on_rank``) and
    ``check(records, degree)`` judges every rank's record; the others (CFG, Ulysses, USP) are composed
    into one device mesh with cache-dit's context parallelism, judged from every rank's block inputs."""

    kind = "parallel"
    token: ClassVar[str]
    multiplies: ClassVar[bool] = True
    on_rank: ClassVar[bool] = False
    order: ClassVar[int] = 50  # the feasibility table's order, the plan name's, and the ranks' order of application

    @classmethod
    def judge(cls, facts, n: int) -> list[Feasibility]:
        raise NotImplementedError

    @classmethod
    def grammar(cls) -> str:
        """How the kind's part of a plan name is written, for messages."""
        return f"{cls.token}<N>"

    @classmethod
    def parse_part(cls, n: int, m: int | None) -> dict[str, int]:
        """The degrees a plan-name part ``<token><n>`` (or ``<token><n>x<m>``) sets."""
        if m is not None:
            raise ValueError(f"{cls.token}{n}x{m}: only a kind of two degrees takes RxU")
        return {cls.token: n}

    @classmethod
    def name_part(cls, degrees: dict[str, int]) -> str | None:
        """This kind's part of a plan name, taking its degree out of ``degrees``."""
        n = degrees.pop(cls.token, 1)
        return f"{cls.token}{n}" if n > 1 else None

    @classmethod
    def degree_problem(cls, n: int) -> str | None:
        return None

    @classmethod
    def refusal(cls, spec, device: str | None = None) -> str | None:
        """Why ditbook will not launch ``spec`` with this kind (on ``device`` when given)."""
        return None

    @classmethod
    def runs_on_rank(cls, spec) -> bool:
        """Whether the worker applies this kind itself on each rank of ``spec``."""
        return cls.on_rank and spec.degree(cls.token) > 1

    @classmethod
    def records(cls, spec) -> bool:
        """Whether each rank of ``spec`` keeps a record of this kind that ``check`` judges."""
        return cls.runs_on_rank(spec)

    @classmethod
    def apply_on_rank(cls, pipe, card, spec, degree: int, noop: bool = False) -> Handle:
        """Apply on this rank (``noop``: record without applying, the tests' fault injection)."""
        raise NotImplementedError

    @classmethod
    def check(cls, records: list, degree: int) -> dict:  # type: ignore[override]
        """Every rank's record of this kind; raise a ``ShardingError`` when they show no split."""
        raise NotImplementedError


@dataclass
class CacheRecord(Record):
    """A cache's work as counted on the model's own blocks (``adapter.counting``): every original
    block and attention evaluation that ran, per transformer call."""

    transformer_calls: int = 0
    block_evals: int = 0
    attention_evals: int = 0
    calls: list = field(default_factory=list)  # blocks run per transformer call
    cached_steps: int = 0  # transformer calls that ran fewer blocks than the uncached run's
    skipped_fraction: float | None = None  # against ``baseline_block_evals``; None without a baseline
    attention_skipped_fraction: float | None = None
    baseline_block_evals: float | None = None

    def against(self, baseline: dict) -> "CacheRecord":
        """This record with its shares of ``baseline`` (the uncached run's counts) filled in."""
        from ..adapter.counting import savings

        s = savings({"block_evals": self.block_evals, "attention_evals": self.attention_evals,
                     "transformer_calls": self.transformer_calls, "calls": self.calls}, baseline)
        return replace(self, cached_steps=s["cached_steps"], skipped_fraction=s["skipped_fraction"],
                       attention_skipped_fraction=s["attention_skipped_fraction"],
                       baseline_block_evals=s["baseline_block_evals"])


class CacheTechnique(Technique):
    """A step or block cache on the adapter's block lists: ``enable(pipe, adapter, settings, steps)
    -> undo``, ``grid(adapter, steps)`` (the settings the cache stage tries, most promising first),
    ``disabled(adapter, steps)`` (skipping off: the adapter alone must reproduce the baseline), and
    optionally ``calibrate(pipe, adapter, run, steps) -> {setting: value}`` (measured on this model)."""

    kind = "cache"
    calibrate: ClassVar[Callable | None] = None

    @classmethod
    def enable(cls, pipe, adapter, settings, steps: int | None = None) -> Callable[[], None] | None:
        raise NotImplementedError

    @classmethod
    def apply(cls, pipe, settings, *, adapter, steps: int | None = None, baseline: dict | None = None) -> Handle:
        """Count the model's block evaluations, then enable the cache. ``record()``: a
        :class:`CacheRecord` (with ``baseline``, the uncached run's counts, its skipped shares)."""
        from ..adapter.counting import EvalCounter

        counter = EvalCounter(pipe.transformer, adapter.counted_blocks())
        try:
            undo = cls.enable(pipe, adapter, settings, steps=steps)
        except BaseException:
            counter.remove()
            raise

        def undo_all() -> None:
            try:
                if undo is not None:
                    undo()
            finally:
                counter.remove()

        def record() -> CacheRecord:
            c = counter.snapshot()
            rec = CacheRecord(cls.name, transformer_calls=c["transformer_calls"], block_evals=c["block_evals"],
                              attention_evals=c["attention_evals"], calls=list(c["calls"]))
            return rec.against(baseline) if baseline else rec

        return Handle(undo_all, record)

    @classmethod
    def apply_with_file(cls, pipe, settings, *, adapter_file, arch_file, used: str = "ditbook",
                        steps: int | None = None) -> Handle:
        """Apply through the adapter module a run shipped (``cache/adapter_<model>.py``: the file the
        cache stage verified) and the facts it was built from (``inspect/arch.json``)."""
        from ..adapter.build import CacheAdapter, load_adapter_file
        from ..arch.report import ArchReport

        module = load_adapter_file(adapter_file, pipe.transformer)
        adapter = CacheAdapter.from_module(pipe, ArchReport.load(arch_file), module, used)
        return cls.apply(pipe, settings, adapter=adapter, steps=steps)

    @classmethod
    def check(cls, record: CacheRecord | None) -> None:
        """Fails when the counts show no block evaluation skipped against the uncached run."""
        if record is None or record.skipped_fraction is None:
            raise NothingDone(f"{cls.name}: no count against the uncached run, so no skipped work is shown")
        if record.skipped_fraction <= 0.0 and record.cached_steps == 0:
            raise NothingDone(f"{cls.name} skipped no block evaluation in {record.transformer_calls} transformer calls")

    @classmethod
    def grid(cls, adapter, steps: int) -> list:
        return [cls.Settings()]

    @classmethod
    def disabled(cls, adapter, steps: int):
        return None


__all__ = ["KINDS", "CacheRecord", "CacheTechnique", "Feasibility", "Handle", "NoSettings", "NothingDone", "ParallelTechnique",
           "PipelineTechnique", "Record", "Technique"]
