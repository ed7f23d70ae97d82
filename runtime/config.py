"""The names an engine is configured with, defined once, and the one value every caller builds an engine from.

    METHODS, SCHEDULERS, BACKENDS   the registries: the CLI's choices, the server, the Triton model and the tests
                                    read them here (runtime/schedulers.py and runtime/backends check that their
                                    implementations cover exactly these names)
    Method.parse("dspark+ngram")    a method as a typed value: its draft head (or None) and whether it looks up
                                    n-grams; nothing else parses a method name
    EngineConfig(method=..., ...)   what `Engine(art, config)` runs: method, scheduler, gamma, backend, device,
                                    dtype, threads, slots, ... validated on creation

No heavy imports: the CLI reads this before it decides whether to load a runtime at all.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import SpecrtError

HEADS = ("dspark", "mtp")  # draft heads an artifact may carry (graph families named alike)
METHODS = ("ar", "ngram", "mtp", "dspark", "dspark+ngram", "mtp+ngram")


@dataclass(frozen=True, slots=True)
class SchedulerTraits:
    """What a scheduler's rule needs and does (runtime/schedulers.py implements each name's rule)."""

    reads_survival: bool  # its lengths come from the proposal's prefix survivals
    plans_on_costs: bool  # it plans on the cost profile (`specrt profile`)
    gates_head: bool  # under it a head alone is called only on the rounds it promises to pay for (`gate_head`)


SCHEDULER_TRAITS = {
    "fixed": SchedulerTraits(reads_survival=False, plans_on_costs=False, gates_head=False),
    "threshold": SchedulerTraits(reads_survival=True, plans_on_costs=False, gates_head=False),
    "sps": SchedulerTraits(reads_survival=True, plans_on_costs=True, gates_head=True),
    "sps-async": SchedulerTraits(reads_survival=True, plans_on_costs=True, gates_head=True),
}
SCHEDULERS = tuple(SCHEDULER_TRAITS)
BACKENDS = ("ort", "torch", "tensorrt")
DTYPES = ("float32", "float16", "bfloat16")  # the torch backend's compute precision (None: the graphs')
# sps: the fastest exact scheduler measured for every method on the CPU (docs/benchmarks.md, "Cheaper drafts"); the torch
# backend defaults to fixed lengths, which need no cost profile of its device (sps there needs `specrt profile
# --backend torch` first)
DEFAULT_SCHEDULER = "sps"
TORCH_SCHEDULER = "fixed"


def default_scheduler(backend: str) -> str:
    return TORCH_SCHEDULER if backend == "torch" else DEFAULT_SCHEDULER


@dataclass(frozen=True, slots=True)
class Method:
    """A decoding method: autoregressive, n-gram lookups, a draft head, or a head with lookups (a hybrid)."""

    name: str
    head: str | None  # "dspark" | "mtp" | None
    ngram: bool  # drafts from n-gram lookups (alone, or beside the head)

    @classmethod
    def parse(cls, name: str) -> "Method":
        if name not in METHODS:
            raise SpecrtError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
        first, _, rest = name.partition("+")
        head = first if first in HEADS else None
        return cls(name=name, head=head, ngram="ngram" in (first, rest))

    @property
    def speculative(self) -> bool:
        return self.name != "ar"

    @property
    def hybrid(self) -> bool:
        """A head and n-gram lookups, the better proposal taken per round (runtime/hybrid.py)."""
        return self.head is not None and self.ngram


def method_variant(spec: str) -> tuple[str, dict[str, int]]:
    """A bench row's method and its engine options: "ngram:tree=3" -> ("ngram", {"tree": 3}) (so one run can compare
    a method's variants); a plain method has none."""
    method, _, rest = spec.partition(":")
    options: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key != "tree" or not value.isdigit():
            raise SpecrtError(f"{spec!r}: a method's variant is METHOD:tree=W (e.g. ngram:tree=3), got {item!r}")
        options[key] = int(value)
    Method.parse(method)
    return method, options


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an engine runs an artifact; every name is checked against the registries on creation.

    `gamma`: drafts verified per round at most (default: the artifact's); `slots`: request slots allocated up
    front (a server), else sized to the queue whenever the engine is idle; `ngram`: the longest suffix n-gram
    lookups match; `threshold`: the threshold scheduler's survival cut; `device`, `dtype`, `cuda_graphs`: the
    torch backend's (and TensorRT's graphs); `gate_head`: under sps and sps-async a head alone (`dspark`, `mtp`) is
    called only on rounds where it promises more than a decoding step (runtime/hybrid.py; the host decides, on the
    torch backend's device rounds too); `tree`: drafts are trees, verified in one call (runtime/tree.py; 1: chains):
    n-gram lookups propose this many continuations with different first tokens, a DSpark head's block gets up to
    tree - 1 of the head's likeliest other first tokens beside its first draft."""

    method: str = "ar"
    scheduler: str = "fixed"
    gamma: int | None = None
    backend: str = "ort"
    threads: int | None = None
    slots: int | None = None
    ngram: int = 3
    threshold: float = 0.3
    device: str = "cpu"
    dtype: str | None = None
    cuda_graphs: bool = True
    gate_head: bool = True
    tree: int = 1

    def __post_init__(self) -> None:
        Method.parse(self.method)
        if self.scheduler not in SCHEDULERS:
            raise SpecrtError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.backend not in BACKENDS:
            raise SpecrtError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SpecrtError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("gamma", "threads", "slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SpecrtError(f"--{name} must be >= 1, got {value!r}")
        if not isinstance(self.ngram, int) or self.ngram < 1:
            raise SpecrtError(f"--ngram must be >= 1, got {self.ngram!r}")
        if not isinstance(self.tree, int) or isinstance(self.tree, bool) or not 1 <= self.tree <= 8:
            raise SpecrtError(f"--tree must be between 1 and 8, got {self.tree!r}")
        if self.tree > 1 and self.parsed.name not in ("ngram", "dspark", "dspark+ngram"):
            raise SpecrtError(f"--tree drafts trees of n-gram lookups or of a DSpark head's first drafts: use it with "
                              f"--method ngram, dspark or dspark+ngram (got {self.method})")
        if self.tree > 1 and self.backend == "torch":
            raise SpecrtError("--tree runs on the host's rounds (the ort and tensorrt backends), not the torch "
                              "backend's device rounds")

    @property
    def parsed(self) -> Method:
        return Method.parse(self.method)

    @property
    def plans_on_costs(self) -> bool:
        """Whether its rounds plan on a cost profile (the sps schedulers, the hybrids)."""
        m = self.parsed
        return m.speculative and (SCHEDULER_TRAITS[self.scheduler].plans_on_costs or m.hybrid)
