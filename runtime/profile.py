"""The cost profile: what a draft/verify round costs on this machine and backend (`Profile`), stored in the
artifact's PROFILE_FILE, one entry per backend and thread count; `load_profile` reads it back for the schedulers'
cost table (runtime/costs.py). `specrt profile` measures it (runtime/measure.py says how).

A round pays when the tokens it commits (τ) are worth more than its cost in plain decoding steps:
    cost = draft call + verify call over (anchor + ℓ drafts) per slot
so the schedulers need two curves: the verify call against the tokens verified in all, and each head's draft call.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrt import artifact as io
from specrt.errors import SpecrtError

PROFILE_FILE = io.PROFILE_FILE
VERSION = 2  # 2: verify costs keyed by total tokens P (packed verification)


@dataclass
class Profile:
    """Measured call costs (milliseconds) of one artifact on one backend with a given thread count."""

    backend: str
    threads: int
    position: int  # the cache position the calls ran at
    machine: str
    created: str
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> tokens verified in all P -> ms
    draft: dict[str, dict[int, float]] = field(default_factory=dict)  # head -> batch -> ms

    def step_ms(self, batch: int) -> float:
        """The plain decoding step (one token per slot) at the smallest profiled batch holding `batch` slots."""
        b = ceil_key(self.verify, batch)
        return self.verify[b][min(self.verify[b])]

    def verify_ms(self, batch: int, tokens: int) -> float:
        """A verify call of `batch` slots verifying `tokens` tokens in all (rounded up to profiled sizes)."""
        b = ceil_key(self.verify, batch)
        return self.verify[b][ceil_key(self.verify[b], tokens)]

    def draft_ms(self, head: str, batch: int) -> float:
        if head not in self.draft:
            return 0.0  # n-gram lookups: no graph call
        return self.draft[head][ceil_key(self.draft[head], batch)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify"] = {str(b): {str(t): ms for t, ms in row.items()} for b, row in self.verify.items()}
        d["draft"] = {h: {str(b): ms for b, ms in row.items()} for h, row in self.draft.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        d["verify"] = {int(b): {int(t): float(ms) for t, ms in row.items()} for b, row in d["verify"].items()}
        d["draft"] = {h: {int(b): float(ms) for b, ms in row.items()} for h, row in d["draft"].items()}
        return cls(**d)

    def summary(self) -> dict:
        """Costs in plain decoding steps at batch 1: what decides whether a round pays."""
        step = self.step_ms(1)
        return {"step_ms": round(step, 3),
                "verify_steps": {t: round(ms / step, 3) for t, ms in self.verify[min(self.verify)].items()},
                "draft_steps": {h: round(self.draft_ms(h, 1) / step, 3) for h in self.draft}}


def ceil_key(table: dict[int, object], n: int) -> int:
    keys = sorted(table)
    return next((k for k in keys if k >= n), keys[-1])


def _key(backend: str, threads: int) -> str:
    return f"{backend}/{threads}"


def placement(backend: str, device: str = "cpu", dtype: str | None = None) -> str:
    """The name a profile is measured and stored under: the backend, and for the torch backend on another device or
    in another precision than the graphs', where it runs ("torch@cuda:bfloat16"): a GPU's costs are not a CPU's."""
    if device == "cpu" and dtype is None:
        return backend
    return f"{backend}@{device}" + (f":{dtype}" if dtype else "")


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def save_profile(art: str | Path, profile: Profile) -> Path:
    """Add (or replace) this backend/thread count's entry in the artifact's PROFILE_FILE, atomically."""
    path = Path(art) / PROFILE_FILE
    entries = _read(path)
    entries[_key(profile.backend, profile.threads)] = profile.to_dict()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": VERSION, "profiles": entries}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SpecrtError(f"cannot write {path}: {e.strerror or e}") from None
    from specrt.outdir import note_written

    note_written(art, PROFILE_FILE)  # `specrt export --force` may replace the artifact with its profile
    return path


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return dict(data["profiles"]) if data.get("version") == VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise SpecrtError(f"{path} is not a specrt profile; delete it and run `specrt profile` again") from None


def _entry(d: object, path: Path, key: str) -> Profile:
    """One stored entry, validated: a verify table with a decoding step per batch, finite positive costs."""
    try:
        prof = Profile.from_dict(d)
        rows = [*prof.verify.values(), *prof.draft.values()]
        if not prof.verify or not all(rows) or not all(math.isfinite(ms) and ms > 0 for r in rows for ms in r.values()):
            raise ValueError("empty or non-positive costs")
        if not isinstance(prof.threads, int) or prof.threads < 1:
            raise ValueError(f"threads {prof.threads!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise SpecrtError(f"{path}: entry {key} is malformed ({what}); run `specrt profile` again") from None
    return prof


def profile_options(label: str) -> str:
    """The `specrt profile` options that measure the profile a `placement` names
    (" --backend torch --device cuda")."""
    backend, _, rest = label.partition("@")
    device, _, dtype = rest.partition(":")
    return ((f" --backend {backend}" if backend != "ort" else "") + (f" --device {device}" if device else "")
            + (f" --dtype {dtype}" if dtype else ""))


def load_profile(art: str | Path, *, backend: str = "ort", threads: int | None = None) -> Profile | None:
    """The stored profile for this backend and thread count (or, failing that, for this backend), if any. `backend`:
    a backend's name, or its `placement`."""
    entries = _read(Path(art) / PROFILE_FILE)
    threads = threads or default_threads()
    key = _key(backend, threads) if _key(backend, threads) in entries else \
        next((k for k in entries if k.startswith(backend + "/")), None)
    return _entry(entries[key], Path(art) / PROFILE_FILE, key) if key is not None else None
