"""What runs an engine's rounds, built from its config: the target's runner, the drafter, the scheduler, the cost
table they plan on, and the executor that runs a round over them (nano-vllm's model-runner side of the engine).

    Rounds.open(art_dir, manifest, config, profile)   loads the graphs on the config's backend and picks the
                                                       executor: the torch backend's device rounds
                                                       (runtime/device_round.py), else the host's (Speculator)
    rounds.run(slots, load) -> Round                  one round over slots [0, n): each slot's outcome

The Engine (runtime/engine.py) owns requests, slots and their sequences; it calls `run` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends import Runner, load_runner
from specrt.runtime.config import EngineConfig
from specrt.runtime.costs import CostTable
from specrt.runtime.drafters import Drafter, make_drafter
from specrt.runtime.profile import Profile, load_profile, placement, profile_options
from specrt.runtime.schedulers import Load, Scheduler, make_scheduler, scheduler_class
from specrt.runtime.round import Round
from specrt.runtime.speculative import Speculator

if TYPE_CHECKING:
    from specrt.runtime.device_round import DeviceRounds


@dataclass
class Rounds:
    target: Runner
    drafter: Drafter | None  # None: AR (every round a decoding step)
    scheduler: Scheduler | None
    costs: CostTable | None  # what the cost-aware scheduler and the hybrid plan on
    gamma: int  # drafts verified per round at most (0: AR)
    executor: Speculator | DeviceRounds
    run: Callable[[list, Load], Round]
    device_rounds: DeviceRounds | None  # the torch backend's executor, else None
    device_note: str  # why the rounds run on the host ("" on the device)

    @classmethod
    def open(cls, art_dir: Path, manifest: io.Manifest, config: EngineConfig, profile: Profile | None) -> "Rounds":
        c, method = config, config.parsed
        where = {"device": c.device, "dtype": c.dtype}
        if c.backend != "ort":  # torch on CUDA, and TensorRT, capture each call in a CUDA graph
            where["graphs"] = c.cuda_graphs and (c.backend == "tensorrt" or c.device.startswith("cuda"))
        target = load_runner(c.backend, art_dir, manifest, io.TARGET, threads=c.threads, spin=True, **where)
        drafter = scheduler = costs = None
        gamma = 0
        if method.speculative:
            exported = manifest.gamma
            if c.gamma is not None and not 1 <= c.gamma <= exported:
                raise SpecrtError(f"--gamma must be between 1 and {exported} (the artifact's verify length - 1), "
                                  f"got {c.gamma}")
            if c.plans_on_costs:  # a GPU's costs are not a CPU's
                costs = cost_table(art_dir, config, placement(c.backend, c.device, c.dtype), profile)
            drafter = make_drafter(method, art_dir, manifest, gamma=c.gamma or exported, backend=c.backend,
                                   threads=c.threads, ngram=c.ngram, costs=costs,
                                   gated=c.gate_head and scheduler_class(c.scheduler).traits.gates_head, **where)
            gamma = min(c.gamma or exported, drafter.steps)
            head = manifest.heads.get(method.head) if method.head else None
            scheduler = make_scheduler(c.scheduler, gamma=gamma, temperatures=head.temperatures if head else (),
                                       threshold=c.threshold, costs=costs)
        if c.backend == "torch":  # imported here: the ONNX Runtime path never loads torch
            from specrt.runtime.device_round import DeviceRounds

            device = DeviceRounds(target, drafter, scheduler, gamma=gamma, costs=costs, capture=where["graphs"])
            return cls(target, drafter, scheduler, costs, gamma, device, device.run, device, "")
        host = Speculator(target, drafter, scheduler, gamma=gamma, costs=costs)
        return cls(target, drafter, scheduler, costs, gamma, host, host.round, None,
                   "the host loop runs every round on this backend")

    def allocate(self, slots: int) -> None:
        """Caches and per-slot state for `slots` slots."""
        self.target.allocate(slots)
        if self.drafter:
            self.drafter.allocate(slots)
        if self.device_rounds is not None:
            self.device_rounds.allocate(slots)


def cost_table(art_dir: Path, config: EngineConfig, backend: str, profile: Profile | None) -> CostTable:
    """The artifact's stored profile for this backend (its `placement`), or the one given; either is refined online
    by the rounds the engine times (runtime/costs.py)."""
    stored = load_profile(art_dir, backend=backend, threads=config.threads)
    if stored is not None:
        return CostTable(stored, f"artifact profile {stored.backend}/{stored.threads}")
    if profile is None:
        raise SpecrtError(f"--scheduler {config.scheduler} / --method {config.method} plan on a cost profile and "
                          f"{art_dir} has none for {backend}: run `specrt profile {art_dir}{profile_options(backend)}` "
                          f"once (or open it with Engine.open, or pass Engine(..., profile=...))")
    return CostTable(profile, f"profile measured {profile.created}")
