"""The one small interface every backend implements: allocate buffers once, run a graph family on them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt import artifact as io


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Host-side inputs of one target call over slots [slot, slot + n)."""

    input_ids: np.ndarray  # [n, T] i64
    position_ids: np.ndarray  # [n, T] i64
    write_index: np.ndarray  # [n] i64
    logit_rows: np.ndarray  # [n, R] i64

    def feeds(self) -> dict[str, np.ndarray]:
        return {io.INPUT_IDS: self.input_ids, io.POSITION_IDS: self.position_ids,
                io.WRITE_INDEX: self.write_index, io.LOGIT_ROWS: self.logit_rows}


class Runner(Protocol):
    """Runs one graph family (target, draft) over a KV cache it owns."""

    max_seq: int
    slots: int

    def allocate(self, slots: int) -> None:
        """Allocate the KV cache (and any per-shape buffers) for `slots` request slots, once."""

    def run(self, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on slots [slot, slot + n); returns views of output buffers valid until the next call."""
