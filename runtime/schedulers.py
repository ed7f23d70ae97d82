"""Schedulers: plug-ins that choose how many drafts each slot verifies this round.

A scheduler sees the slots, the proposal (with confidence logits where the drafter has a confidence
head) and the load, and returns verify lengths. The loop then caps every length by the drafts proposed
and by the request's remaining token budget, so a scheduler only expresses its policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Proposal, SlotView


@dataclass(frozen=True, slots=True)
class Load:
    """How busy the engine is this round."""

    active: int  # slots with a request
    slots: int  # slots the engine serves
    waiting: int  # requests queued for a slot


class Scheduler(Protocol):
    name: str

    def schedule(self, slots: list[SlotView | None], proposal: Proposal, load: Load) -> np.ndarray:
        """Verify lengths [n] for slots [0, n) (0 = a plain decode step for that slot)."""


class FixedScheduler:
    """Verify every proposed draft, up to gamma."""

    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def schedule(self, slots: list[SlotView | None], proposal: Proposal, load: Load) -> np.ndarray:
        return np.minimum(proposal.counts, self.gamma)


SCHEDULERS = {"fixed": FixedScheduler}


def make_scheduler(name: str, *, gamma: int) -> Scheduler:
    if name not in SCHEDULERS:
        raise SpecrtError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](gamma)
