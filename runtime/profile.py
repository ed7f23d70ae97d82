"""`specrt profile`: what a draft/verify round costs on this machine and backend, stored in the artifact.

A round pays when the tokens it commits (τ) are worth more than its cost in plain decoding steps:
    cost = draft call + verify call over (anchor + ℓ drafts) per slot
so the schedulers need two measured curves, taken here at one cache position with every slot busy:

    verify   the packed target call for B slots verifying P tokens in all (P = B: the plain decoding step),
             for each exported batch size B and each token budget P of its verify buckets, on the densest
             grid that holds them: cost against the total verified tokens (the DSpark paper's SPS curve)
    draft    each head's propose call for B slots as greedy rounds make it (the greedy variant where exported),
             with one and with two new context rows, averaged: a round that accepted no draft or one, which is
             most rounds (a call's cost grows slowly with its rows)

Calls are interleaved (every configuration once per repetition; medians over repetitions), because the speed
of a shared machine drifts. The table goes to PROFILE_FILE in the artifact, one entry per backend and thread
count; `load_profile` reads it back.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime import calls as contract
from specrt.runtime.backends import load_runner

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


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _fill_target(feeds: dict[str, np.ndarray], position: int, token: int) -> None:
    """A verify (or decode) call of every slot at `position`, its first P cells computed (costs do not depend on
    token values or on which cells)."""
    b, t = feeds[io.INPUT_IDS].shape
    p = len(feeds[io.TOKEN_ROWS])
    contract.target.grid(feeds, np.full(b, token), np.full(b, position), np.full((b, t - 1), token), np.arange(p))


def _fill_draft(head, feeds: dict[str, np.ndarray], position: int, rows: int, token: int) -> None:
    """A propose call of every slot: `rows` new context rows ending at the anchor's position."""
    b = feeds[io.TEMPERATURE].shape[0]
    width = (feeds.get(io.CTX_FEATURES) if io.CTX_FEATURES in feeds else feeds[io.MTP_HIDDEN]).shape[-1]
    contract.head.settings(feeds)
    ctx = contract.ContextRows(np.full((b, rows, width), 0.1, np.float32), np.full((b, rows), token),
                            np.full(b, position - rows), np.full(b, rows))
    head.propose(feeds, ctx, np.full(b, token))


def verify_tokens(spec: io.GraphSpec, batch: int) -> list[int]:
    """The total verified token counts profiled at `batch` slots: one per slot (decode), and every token
    budget of the batch's verify buckets above that."""
    budgets = {b["P"] for b in spec.buckets["verify"] if b["B"] == batch and b["P"] > batch}
    return [batch, *sorted(budgets)]


def measure(art: str | Path, *, backend: str = "ort", threads: int | None = None, position: int = 128,
            repeats: int = 5, calls: int = 4, progress: bool = True) -> Profile:
    """Time every configuration `calls` times per repetition, interleaved over `repeats` repetitions."""
    art = Path(art)
    manifest = io.load_manifest(art)
    threads = threads or default_threads()
    s = manifest.export
    if not s.verify_len < position < s.max_seq - s.verify_len:
        raise SpecrtError(f"--position must be between {s.verify_len + 1} and {s.max_seq - s.verify_len - 1}, "
                          f"got {position}")
    target = load_runner(backend, art, manifest, io.TARGET, threads=threads, spin=True)
    heads = {name: load_runner(backend, art, manifest, name, threads=threads, spin=False) for name in manifest.heads}
    batches = io.batch_sizes(s.batch)
    token = min(100, manifest.model.vocab_size - 1)  # any token: costs do not depend on values
    target.allocate(max(batches))
    for r in heads.values():
        r.allocate(max(batches))
    jobs: list[tuple[tuple, object]] = []  # (key, a call)

    def target_call(b: int, p: int):
        t = -(-p // b)  # the densest grid holding p tokens
        bucket = target.spec.bucket("decode", B=b) if t == 1 else target.spec.bucket("verify", B=b, T=t, P=p)
        _fill_target(target.inputs(0, bucket), position, token)
        return lambda: target.run(0, bucket)

    def draft_call(name: str, b: int, rows: int):
        r = heads[name]
        bucket = r.spec.bucket("propose", B=b, C=rows)
        _fill_draft(contract.for_head(manifest.heads[name].kind), r.inputs(0, bucket, greedy=True), position, rows, token)
        return lambda: r.run(0, bucket, greedy=True)

    for b in batches:
        for p in verify_tokens(target.spec, b):
            jobs.append((("verify", b, p), target_call(b, p)))
        for name in heads:
            for rows in sorted({1, min(2, s.verify_len)}):
                jobs.append((("draft", name, b, rows), draft_call(name, b, rows)))
    times: dict[tuple, list[float]] = {key: [] for key, _ in jobs}
    for _, call in jobs:  # warm-up: first-use allocations, cache growth
        call()
    with tqdm(total=repeats * len(jobs), desc="profile", unit="config", disable=not progress) as bar:
        for _ in range(repeats):
            for key, call in jobs:
                ts = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t0)
                times[key].append(float(np.median(ts)) * 1e3)
                bar.update(1)
    med = {key: round(float(np.median(v)), 3) for key, v in times.items()}
    verify: dict[int, dict[int, float]] = {}
    draft: dict[str, dict[int, float]] = {}
    for key, ms in med.items():
        if key[0] == "verify":
            verify.setdefault(key[1], {})[key[2]] = ms
    for name in heads:
        for b in batches:
            draft.setdefault(name, {})[b] = round(float(np.mean([ms for k, ms in med.items()
                                                                  if k[:3] == ("draft", name, b)])), 3)
    return Profile(backend=backend, threads=threads, position=position, machine=_cpu(),
                   created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), verify=verify, draft=draft)


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
    from specrt.exporter.outdir import note_written

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


def load_profile(art: str | Path, *, backend: str = "ort", threads: int | None = None) -> Profile | None:
    """The stored profile for this backend and thread count (or, failing that, for this backend), if any."""
    entries = _read(Path(art) / PROFILE_FILE)
    threads = threads or default_threads()
    key = _key(backend, threads) if _key(backend, threads) in entries else \
        next((k for k in entries if k.startswith(backend + "/")), None)
    return _entry(entries[key], Path(art) / PROFILE_FILE, key) if key is not None else None
