"""Measure (`specrt profile`, and `Engine.open` for an artifact nobody profiled) what a draft/verify round costs on this machine and backend (the table the schedulers
plan on; runtime/profile.py says what it holds and stores it).

    verify   the packed target call for B slots verifying P tokens in all (P = B: the plain decoding step),
             for each exported batch size B and each token budget P of its verify buckets, on the densest
             grid that holds them: cost against the total verified tokens (the DSpark paper's SPS curve)
    draft    each head's propose call for B slots as greedy rounds make it (the greedy variant where exported),
             with one and with two new context rows, averaged: a round that accepted no draft or one, which is
             most rounds (a call's cost grows slowly with its rows). As in a round, each timed call follows a
             target call (a decoding step of the same B slots, not timed): the target's weights have just gone
             through the caches, so the head's come from memory. Timed back to back, the head's weights stay
             cached and its call measures ~30% cheaper than an engine ever sees it (0.68 against 1.0 ms on the
             default artifact, 2 threads)

Calls are interleaved (every configuration once per repetition; medians over repetitions), because the speed of a
shared machine drifts.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime import calls as contract
from specrt.runtime.backends import load_runner
from specrt.runtime.profile import Profile, default_threads, load_profile, placement, profile_options

_QUICK: dict[tuple, Profile] = {}  # quick profiles measured in this process, for artifacts without one


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device))


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
            repeats: int = 5, calls: int = 4, progress: bool = True, device: str = "cpu",
            dtype: str | None = None) -> Profile:
    """Time every configuration `calls` times per repetition, interleaved over `repeats` repetitions. `device`,
    `dtype`: the torch backend's (on CUDA each call is a graph replay and its outputs' copy back, as an engine's)."""
    art = Path(art)
    manifest = io.load_manifest(art)
    threads = threads or default_threads()
    s = manifest.export
    if not s.verify_len < position < s.max_seq - s.verify_len:
        raise SpecrtError(f"--position must be between {s.verify_len + 1} and {s.max_seq - s.verify_len - 1}, "
                          f"got {position}")
    where = dict(device=device, dtype=dtype)
    target = load_runner(backend, art, manifest, io.TARGET, threads=threads, spin=True, **where)
    heads = {name: load_runner(backend, art, manifest, name, threads=threads, spin=False, **where)
             for name in manifest.heads}
    batches = io.batch_sizes(s.batch)
    token = min(100, manifest.model.vocab_size - 1)  # any token: costs do not depend on values
    target.allocate(max(batches))
    for r in heads.values():
        r.allocate(max(batches))
    jobs: list[tuple[tuple, object, object]] = []  # (key, a call, what runs before each timed call, untimed)

    def target_call(b: int, p: int):
        t = -(-p // b)  # the densest grid holding p tokens
        bucket = target.spec.bucket("decode", B=b) if t == 1 else target.spec.bucket("verify", B=b, T=t, P=p)
        _fill_target(target.inputs(0, bucket), position, token)
        return lambda: target.run(0, bucket)

    def draft_call(name: str, b: int, rows: int):
        r = heads[name]
        bucket = r.spec.bucket("propose", B=b, C=rows)
        _fill_draft(contract.for_head(manifest.heads[name].kind), r.inputs(0, bucket, greedy=True), position, rows,
                    token)
        return lambda: r.run(0, bucket, greedy=True)

    for b in batches:
        step = target_call(b, b)  # a draft call follows the target's in every round
        for p in verify_tokens(target.spec, b):
            jobs.append((("verify", b, p), target_call(b, p), None))
        for name in heads:
            for rows in sorted({1, min(2, s.verify_len)}):
                jobs.append((("draft", name, b, rows), draft_call(name, b, rows), step))
    times: dict[tuple, list[float]] = {key: [] for key, _, _ in jobs}
    for _, call, _ in jobs:  # warm-up: first-use allocations, cache growth
        call()
    with tqdm(total=repeats * len(jobs), desc="profile", unit="config", disable=not progress) as bar:
        for _ in range(repeats):
            for key, call, before in jobs:
                ts = []
                for _ in range(calls):
                    if before is not None:
                        before()
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
    machine = _cpu() if device == "cpu" else _gpu(device)
    return Profile(backend=placement(backend, device, dtype), threads=threads, position=position, machine=machine,
                   created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), verify=verify, draft=draft)


def profile_for(art: str | Path, *, backend: str, threads: int | None, device: str = "cpu",
                dtype: str | None = None) -> Profile:
    """The artifact's stored profile for this backend (on this device, in this precision), or (with a warning, once
    per process) a quick one measured now, for the cost-aware schedulers and the hybrids of an artifact nobody
    profiled (`specrt profile` stores a careful one)."""
    label = placement(backend, device, dtype)
    prof = load_profile(art, backend=label, threads=threads)
    if prof is not None:
        return prof
    key = (str(Path(art).resolve()), label, threads)
    if key not in _QUICK:
        print(f"specrt: warning: {art} has no {label} cost profile; measuring a quick one "
              f"(run `specrt profile {art}{profile_options(label)}` once to store a careful one)", file=sys.stderr)
        max_seq = io.load_manifest(Path(art)).export.max_seq
        _QUICK[key] = measure(art, backend=backend, threads=threads, repeats=1, calls=2, progress=False,
                              position=min(128, max_seq // 2), device=device, dtype=dtype)
    return _QUICK[key]
