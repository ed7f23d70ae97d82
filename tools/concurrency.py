"""`specrt bench --concurrency`: R requests in flight through the online engine, per method and scheduler.

Each configuration serves every prompt with at most R requests active at once (a finished request's slot takes
the next prompt at the following step, the way a server runs), greedy, and reports:

    tokens_per_s              all generated tokens over the wall time from the first step to the last token
    per_request_tokens_per_s  mean over requests of its tokens over its own time from admission to finish
    mean_verify_len, tau      drafts verified per slot-round and tokens committed per slot-round
    prefill_s, decode_s       the wall time's split: prompt prefill (with a head's prompt pass) and decode steps
                              or rounds; speculative rows add draft_s and verify_s (parts of decode_s)

Rows: batched AR ("ar", scheduler "-") and every speculative method under every scheduler. The greedy tokens of
every row must equal AR's for every prompt (exactness), or the command fails. Each engine runs in a process of its
own (`EngineWorker`, as `specrt bench`'s engines do), one at a time; they are warmed up, then serve --repeats passes
in rotating order (`run` says how); every number is the median over passes.
"""
from __future__ import annotations

import time
from collections import deque
from statistics import median
from pathlib import Path

from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.config import SCHEDULERS, EngineConfig
from specrt.runtime.engine import Engine
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.tools.bench_workers import EngineSpec, Worker, worker_loop
from specrt.runtime.measure import profile_for
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import RunStats
from specrt.runtime.tokenizer import Tokenizer


def parse_levels(text: str, max_batch: int) -> list[int]:
    """`1,2,4` -> [1, 2, 4]; each level must fit the artifact's request slots."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecrtError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    bad = [c for c in levels if not 1 <= c <= max_batch]
    if not levels or bad:
        raise SpecrtError(f"--concurrency levels must be between 1 and the artifact's {max_batch} request slots "
                          f"(re-export with a larger --batch), got {text!r}")
    return sorted(set(levels))


def serve(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int, *,
          progress: bool = False, desc: str = "") -> tuple[dict, list[list[int]]]:
    """Run every prompt with `concurrency` in flight; (row, outputs in prompt order)."""
    queue = deque(enumerate(prompts))
    started: dict[int, float] = {}
    done: dict[int, tuple[list[int], float]] = {}
    stats = RunStats(method=engine.method, gamma=engine.gamma)  # this run's steps
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress) as bar:
        while queue or engine.has_unfinished():
            while queue and len(started) - len(done) < concurrency:
                i, ids = queue.popleft()
                engine.add_request(ids, params, request_id=i)
                started[i] = time.perf_counter()
            deltas = engine.step()
            stats.add(engine.last_step)
            for d in deltas:
                if d.finished is not None:
                    done[d.id] = (d.finished.output_ids, time.perf_counter())
                    bar.update(1)
    wall = time.perf_counter() - t0
    tokens = sum(len(out) for out, _ in done.values())
    per_request = [len(out) / (end - started[i]) for i, (out, end) in done.items() if end > started[i]]
    s = stats.to_dict()
    row = {"method": engine.method, "scheduler": engine.scheduler_name if engine.method != "ar" else "-",
           "concurrency": concurrency, "tokens_per_s": round(tokens / wall, 3) if wall else 0.0,
           "per_request_tokens_per_s": round(sum(per_request) / len(per_request), 3) if per_request else 0.0,
           "mean_verify_len": s.get("mean_verify_len", 0.0), "tau": s.get("tau", 1.0),
           "generated_tokens": tokens, "wall_s": round(wall, 3),
           "prefill_s": round(stats.prefill_s, 3), "decode_s": round(stats.decode_s, 3)}
    if engine.method != "ar":
        row.update(draft_s=s["draft_s"], verify_s=s["verify_s"])
    return row, [done[i][0] for i in range(len(prompts))]


class EngineWorker(Worker):
    """One engine of a run in a process of its own, serving whole passes (`serve`) on request.

    In one process, engines made one after another did not run alike: paired prompt by prompt
    (scripts/engine_pair.py), the same `ar` engine's decoding calls cost 1-2% more when it was made second, the
    order the bench made them in (`ar` first, every speculative engine after it). A process per engine gives each
    its own allocations and thread pool, as a user's server would have."""

    def __init__(self, label: str, art: str | Path, config: EngineConfig, profile) -> None:
        self.spec = EngineSpec(name=label, artifact=str(art))
        self._start(_serve_engine, (str(art), config, profile))
        self.ready()

    def serve(self, prompts: list[list[int]], params: SamplingParams, concurrency: int, *, progress: bool = False,
              desc: str = "") -> tuple[dict, list[list[int]]]:
        self.conn.send(("serve", prompts, params, concurrency, progress, desc))
        return self._answer()


def _serve_engine(conn, art: str, config: EngineConfig, profile) -> None:
    """An EngineWorker's process: open the engine, say ready, serve each pass sent until told to close."""
    def load():
        engine = Engine(art, config, profile=profile)

        def serve_pass(prompts, params, concurrency, progress, desc):
            return serve(engine, prompts, params, concurrency, progress=progress, desc=desc)

        return {"serve": serve_pass}, engine.close

    worker_loop(conn, load)


def run(art: str | Path, prompts: list[list[int]], *, levels: list[int], methods: list[str], schedulers: list[str],
        max_new_tokens: int, gamma: int | None, backend: str, threads: int | None, threshold: float,
        progress: bool, device: str = "cpu", dtype: str | None = None, repeats: int = 1,
        bracket: bool = False) -> dict:
    """Every (method, scheduler) at every concurrency level; AR's outputs are the ones the others must equal.

    Per level, every engine is opened once and warmed up on the first `level` prompts (untimed: first-use
    allocations, the cost table's first observations), then `repeats` passes serve all prompts through every engine
    in turn, the order rotating from pass to pass, so that a drift of the machine's speed falls on every engine
    alike. An engine keeps its state across passes, as a server would (its cost table, its head's estimate). A row
    reports the median over passes; `vs_best_of_ar_and_fixed` is the median over passes of the ratio to the best of
    AR and the fixed rows in the same pass.

    `bracket`: in every pass AR also serves before each other engine and after the last (AR, X, AR, Y, ..., AR),
    and an engine's AR in the ratio is the mean of the two AR passes either side of it, minutes apart at most, so a
    steady drift of the machine's speed between them cancels. The AR row reports the median over all its passes."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows, identical = [], True
    configs = [("ar", "fixed")] + [(m, s) for m in methods if m != "ar" for s in schedulers]
    profile = None  # one cost profile for every engine that plans on one (a quick one measured here, once, if none)
    for c in levels:
        engines = []
        try:
            for method, sched in configs:
                config = EngineConfig(method=method, gamma=gamma if method != "ar" else None, scheduler=sched,
                                      backend=backend, threads=threads, slots=c, threshold=threshold, device=device,
                                      dtype=dtype)
                if config.plans_on_costs and profile is None:
                    profile = profile_for(art, backend=backend, threads=threads, device=device, dtype=dtype)
                label = method if method == "ar" else f"{method}/{sched}"
                engines.append((label, EngineWorker(label, art, config, profile if config.plans_on_costs else None)))
            for _, engine in engines:
                engine.serve(prompts[:c], params, c)  # warm-up
            passes: list[list[dict]] = [[] for _ in engines]  # per engine, its row of every pass (AR: every run)
            outputs: list[list[list[list[int]]]] = [[] for _ in engines]  # per engine, its outputs of every run
            speed: list[list[float]] = [[] for _ in engines]  # per engine and pass: its tok/s (AR: its runs' mean)
            ar_ref: list[list[float]] = [[] for _ in engines]  # per engine and pass: the AR tok/s it is rated against

            def serve_one(j: int, k: int) -> float:
                label, engine = engines[j]
                row, out = engine.serve(prompts, params, c, progress=progress,
                                        desc=f"c={c} {label}" + (f" pass {k + 1}/{repeats}" if repeats > 1 else ""))
                passes[j].append(row)
                outputs[j].append(out)
                return row["tokens_per_s"]

            for k in range(repeats):
                if bracket:
                    ar_runs = [serve_one(0, k)]
                    for j in [1 + (k + i) % (len(engines) - 1) for i in range(len(engines) - 1)]:
                        speed[j].append(serve_one(j, k))
                        ar_runs.append(serve_one(0, k))
                        ar_ref[j].append((ar_runs[-2] + ar_runs[-1]) / 2)
                    speed[0].append(sum(ar_runs) / len(ar_runs))
                    ar_ref[0].append(speed[0][-1])
                else:
                    for j in [(k + i) % len(engines) for i in range(len(engines))]:
                        speed[j].append(serve_one(j, k))
                    for refs in ar_ref:
                        refs.append(speed[0][-1])
        finally:
            for _, engine in engines:
                engine.close()
        reference = outputs[0][0]  # AR's
        fixed = [j for j, (m, s) in enumerate(configs) if m != "ar" and s == "fixed"]
        for j, (runs, outs) in enumerate(zip(passes, outputs)):
            row = _median_row(runs)
            row["identical"] = all(out == reference for out in outs)
            identical &= row["identical"]
            bests = [max([ar_ref[j][k], *(speed[f][k] for f in fixed)]) for k in range(repeats)]
            ratios = [x / b for x, b in zip(speed[j], bests) if b]
            row["vs_best_of_ar_and_fixed"] = round(median(ratios), 3) if ratios else None
            if repeats > 1 or (bracket and j == 0):
                row["passes_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
            if bracket and j:
                row["ar_around_tokens_per_s"] = [round(x, 3) for x in ar_ref[j]]
            rows.append(row)
    return {"identical": identical, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "levels": levels,
            "repeats": repeats, "bracket": bracket, "rows": rows}


def _median_row(runs: list[dict]) -> dict:
    """One row for an engine's passes: every number the median over passes (the first pass's other fields)."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = round(median(r[key] for r in runs), 3)
    return row


def plot(report: dict, path: str | Path) -> Path:
    """Aggregate throughput against concurrency, and the throughput / per-request speed frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specrt.tools.plots import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict]] = {}
    for r in report["rows"]:
        series.setdefault(r["method"] if r["method"] == "ar" else f"{r['method']} / {r['scheduler']}", []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        style = dict(marker="o", linestyle="--" if label == "ar" else "-", label=label)
        left.plot([r["concurrency"] for r in rs], [r["tokens_per_s"] for r in rs], **style)
        right.plot([r["per_request_tokens_per_s"] for r in rs], [r["tokens_per_s"] for r in rs], **style)
    left.set(xlabel="requests in flight", ylabel="aggregate tokens/s", xscale="log", title="Throughput")
    left.set_xticks(report["levels"], [str(c) for c in report["levels"]])
    right.set(xlabel="tokens/s per request", ylabel="aggregate tokens/s", title="Throughput / per-user frontier")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(f"greedy, {report['prompts']} prompts, {report['max_new_tokens']} new tokens", fontsize=9)
    return save_figure(fig, path)


def bench(artifact: Path, prompt_files, limit, max_new_tokens: int, names: list[str], gamma, scheduler: str,
          schedulers: str | None, threshold: float, concurrency: str, backend: str, threads, *, progress: bool,
          device: str = "cpu", dtype: str | None = None, repeats: int = 1, bracket: bool = False) -> dict:
    """`specrt bench --concurrency`: every method (with each of `schedulers`, comma-separated) at each concurrency
    level of `concurrency` on the prompt files' prompts; the report of `run`."""
    chosen = [x.strip() for x in (schedulers or scheduler).split(",") if x.strip()]
    bad = [x for x in chosen if x not in SCHEDULERS]
    if bad or not chosen:
        raise SpecrtError(f"--schedulers: unknown scheduler {bad[0] if bad else '(none)'}; choose from "
                          f"{', '.join(SCHEDULERS)}")
    manifest = io.load_manifest(artifact)
    levels = parse_levels(concurrency, manifest.export.batch)
    tok = Tokenizer.from_dir(artifact / io.TOKENIZER_DIR, manifest.tokenizer) if manifest.tokenizer else None
    prompts = [encode_prompt(tok, t) for p in prompt_files for t in read_prompts_file(p, limit)]
    return run(artifact, prompts, levels=levels, methods=names, schedulers=chosen, max_new_tokens=max_new_tokens,
               gamma=gamma, backend=backend, threads=threads, threshold=threshold, progress=progress,
               device=device, dtype=dtype, repeats=repeats, bracket=bracket)


def format_rows(report: dict) -> str:
    """The concurrency table: per level and method, throughput, per-request rate, ratio to the best of ar and fixed,
    mean verify length and τ."""
    lines = [f"{'conc':>4s} {'method':18s} {'tok/s':>9s} {'per req':>8s} {'vs best':>8s} {'verify':>7s} {'tau':>6s}"]
    for r in report["rows"]:
        label = r["method"] if r["method"] == "ar" else f"{r['method']}/{r['scheduler']}"
        lines.append(f"{r['concurrency']:4d} {label:18s} {r['tokens_per_s']:9.2f} {r['per_request_tokens_per_s']:8.2f} "
                     f"{r['vs_best_of_ar_and_fixed']:8.3f} {r['mean_verify_len']:7.2f} {r['tau']:6.2f}")
    lines.append(f"identical greedy outputs: {report['identical']}")
    return "\n".join(lines)
