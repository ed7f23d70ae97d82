"""What runs an engine's rounds, built from its config: the target's runner, the drafter, the scheduler, the cost
table they plan on, and the executor that runs a round over them (nano-vllm's model-runner side of the engine).

    ModelRunner.open(art_dir, manifest, config, profile)   loads the graphs on the config's backend and picks the
                                                            executor: the torch backend's device rounds
                                                            (runtime/device_round.py), else the host's (HostRounds)
    runner.prefill(slot, ids) -> logits, features          a new request's prompt into its slot, chunk by chunk
    runner.start(slot, seq, features)                      its first token sampled: the drafter's prompt context and
                                                            the device round's slot state
    runner.run(slots, load) -> Round                       one round over slots [0, n): each slot's outcome

The Engine (runtime/engine.py) owns requests, slots and their sequences; it calls `run` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.backends import Runner, load_runner
from specrt.runtime import calls
from specrt.runtime.config import EngineConfig
from specrt.runtime.costs import CostTable
from specrt.runtime.drafters import Context, Drafter, make_drafter
from specrt.runtime.profile import Profile, load_profile, placement, profile_options
from specrt.runtime.host_round import HostRounds
from specrt.runtime.round import Round
from specrt.runtime.schedulers import Load, Scheduler, make_scheduler, scheduler_class

if TYPE_CHECKING:
    from specrt.runtime.device_round import DeviceRounds
    from specrt.runtime.sequence import Sequence


@dataclass
class ModelRunner:
    target: Runner
    drafter: Drafter | None  # None: AR (every round a decoding step)
    scheduler: Scheduler | None
    costs: CostTable | None  # what the cost-aware scheduler and the hybrid plan on
    gamma: int  # drafts verified per round at most (0: AR)
    executor: HostRounds | DeviceRounds
    device_rounds: DeviceRounds | None  # the torch backend's executor, else None
    device_note: str  # why the rounds run on the host ("" on the device)

    @classmethod
    def open(cls, art_dir: Path, manifest: io.Manifest, config: EngineConfig, profile: Profile | None) -> "ModelRunner":
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
            if c.tree > 1 and not any(t.name == io.TREE_MASK for t in target.spec.inputs):
                raise SpecrtError("--tree needs a target graph with a tree_mask input, which this artifact (exported "
                                  "by an older specrt) lacks: re-export it")
            if c.tree > 1 and method.head == "dspark" and "dspark" in manifest.graphs and not any(
                    t.name == io.DRAFT_FIRST_TOP for t in manifest.graphs["dspark"].outputs):
                raise SpecrtError("--tree needs a DSpark graph that outputs its likeliest first tokens, which this "
                                  "artifact (exported by an older specrt) lacks: re-export it")
            drafter = make_drafter(method, art_dir, manifest, gamma=c.gamma or exported, backend=c.backend,
                                   threads=c.threads, ngram=c.ngram, costs=costs,
                                   tree=c.tree if method.head is None else 1,
                                   gated=c.gate_head and scheduler_class(c.scheduler).traits.gates_head, **where)
            grafted = c.tree - 1 if method.head == "dspark" else 0  # a DSpark tree: the block and its alternatives
            gamma = min(c.gamma or exported, drafter.steps + grafted)
            head = manifest.heads.get(method.head) if method.head else None
            scheduler = make_scheduler(c.scheduler, gamma=gamma, temperatures=head.temperatures if head else (),
                                       threshold=c.threshold, costs=costs)
        if c.backend == "torch":  # imported here: the ONNX Runtime path never loads torch
            from specrt.runtime.device_round import DeviceRounds

            device = DeviceRounds(target, drafter, scheduler, gamma=gamma, costs=costs, capture=where["graphs"])
            return cls(target, drafter, scheduler, costs, gamma, device, device, "")
        host = HostRounds(target, drafter, scheduler, gamma=gamma, costs=costs,
                          tree=c.tree if method.head is not None else 1)
        return cls(target, drafter, scheduler, costs, gamma, host, None, "the host loop runs every round on this backend")

    @property
    def keeps_features(self) -> bool:
        """Whether the drafter reads the target's features (its context rows)."""
        return self.drafter is not None and self.drafter.needs_features

    def run(self, slots: list, load: Load) -> Round:
        """One round over slots [0, n) (None: idle) on the executor."""
        return self.executor.run(slots, load)

    def prefill(self, slot: int, ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Write a prompt into `slot`'s cache from position 0, a chunk per call: the last token's logits [V], and the
        prompt's features [len(ids), F] where the drafter reads them."""
        features, out = [], None
        for piece, out in calls.target.run_prefill(self.target, slot, np.asarray(ids, np.int64)):
            if self.keeps_features:
                features.append(out[io.FEATURES][0, :len(piece)].copy())
        return out[io.LOGITS][0], np.concatenate(features) if features else None

    def start(self, slot: int, seq: Sequence, features: np.ndarray | None) -> None:
        """After a prefill and its first token: the drafter takes the prompt's context rows (the slot's pending rows
        are what it returns), the device round the slot's state."""
        ids = seq.request.prompt_ids
        if self.drafter is not None:
            ctx = Context(pos=0, features=features if features is not None else np.zeros((len(ids), 0), np.float32),
                          next_tokens=np.asarray([*ids[1:], seq.pending], np.int64))
            seq.ctx = self.drafter.prefill(slot, ctx)
        if self.device_rounds is not None:
            self.device_rounds.upload(slot, seq.length, seq.pending, seq.budget, seq.ctx, seq.params)

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
