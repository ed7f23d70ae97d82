"""Observers of speculative rounds: the engine hands each one a record per request per round."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Proposal


@dataclass(frozen=True, slots=True)
class RoundRecord:
    request: int
    round: int
    position: int  # cache index of the anchor
    draft_tokens: list[int]  # all proposed
    confidence_logits: list[float] | None  # DSpark, before the sigmoid
    verify_len: int
    accepted: int
    committed: int

    @classmethod
    def of(cls, request: int, round: int, position: int, proposal: Proposal, i: int, verify_len: int, accepted: int,
           committed: int) -> "RoundRecord":
        """Slot i's record of a round whose drafts were `proposal`."""
        conf = proposal.confidence_logits
        return cls(request, round, position, proposal.tokens[i, :proposal.counts[i]].tolist(),
                   conf[i].tolist() if conf is not None else None, verify_len, accepted, committed)


class RoundObserver(Protocol):
    def on_round(self, record: RoundRecord) -> None: ...

    def close(self) -> None: ...


class TraceWriter:
    """`--trace FILE.jsonl`: one JSON line per round per request, flushed as it goes."""

    @staticmethod
    def check(path: str | Path) -> None:
        """Refuse a path that cannot be a trace file, before anything expensive happens (nothing is created)."""
        path = Path(path)
        if path.is_dir():
            raise SpecrtError(f"--trace {path} is a directory; give a file path")
        if not path.parent.is_dir():
            raise SpecrtError(f"cannot write --trace {path}: No such file or directory")

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.check(path)
        try:
            self._file = open(path, "w")
        except OSError as e:
            raise SpecrtError(f"cannot write --trace {path}: {e.strerror or e}") from None

    def on_round(self, record: RoundRecord) -> None:
        self._file.write(json.dumps(asdict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
