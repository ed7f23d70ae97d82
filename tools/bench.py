"""`specrt bench`: specrt's methods and baselines on the same model and prompts, interleaved in one run.

    workers      every engine (each specrt method, each baseline) in a process of its own (bench_workers.py)
    warm-up      each engine runs the first prompt once, unmeasured
    passes       `repeats` passes over the prompts; on each prompt every engine runs in turn, the order rotating
                 from one prompt to the next, so drift in the machine's speed lands on all engines alike
    ratios       per prompt and pass, an engine's decode rate over the reference's on the same prompt, over the
                 same number of tokens (the fewer of the two generated); reported as the median with a bootstrap
                 95% interval (bench_stats.py), against `ar` and against every baseline
    quiet check  load, steal, other processes' CPU over windows of requests, idle engines' CPU (machine.py);
                 a warning when noisy

Exact engines (specrt's methods, transformers) must produce `ar`'s tokens on every prompt and pass; engines
that compute differently (llama.cpp, OpenVINO) have their first difference reported.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime.config import method_variant
from specrt.runtime.engine import check_room
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.tokenizer import Tokenizer
from specrt.runtime.stats import RunStats
from specrt.tools.bench_stats import fmt, median_ci
from specrt.tools.bench_workers import (BASELINES, REPORTED_ONLY, EngineSpec, Generation, Worker, is_baseline, is_cpp,
                                        require)
from specrt.tools.machine import CpuSample, QuietCheck, machine_info
from specrt.tools.plots import save_figure

SETTLE_S = 0.02  # pause between two engines' runs (not measured)

def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where `a` and `b` differ (one ending early counts), or None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def difference_summary(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Where each prompt's tokens first differ from the reference's, pooled: identical prompts, min and mean index."""
    per_prompt = [first_difference(o, r) for o, r in zip(outputs, reference)]
    diff = [i for i in per_prompt if i is not None]
    return {"identical_prompts": len(per_prompt) - len(diff), "prompts": len(per_prompt),
            "min_index": min(diff) if diff else None,
            "mean_index": round(sum(diff) / len(diff), 1) if diff else None, "per_prompt": per_prompt}


def plot_report(report: dict, path: str | Path) -> Path:
    """Each engine's speedup over `ar` with its 95% interval, per-position conditional acceptance per method (pooled
    over the prompt sets) and τ per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in report["pooled"] if "per_position_acceptance" in r]
    if not spec:
        raise SpecrtError("--plot needs at least one speculative method (mtp or dspark) in --methods")
    fig, (speed, left, right) = plt.subplots(1, 3, figsize=(16, 4.4))
    rows = [r for r in report["pooled"] if r["method"] != "ar" and r.get("speedup_ci")]
    for y, row in enumerate(rows):
        lo, hi = row["speedup_ci"]
        speed.errorbar(row["speedup"], y, xerr=[[row["speedup"] - lo], [hi - row["speedup"]]], fmt="o", capsize=4)
        speed.annotate(f"{row['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]", (row["speedup"], y), textcoords="offset points",
                       xytext=(0, 7), ha="center", fontsize=7)
    speed.axvline(1.0, color="k", lw=0.8)
    speed.set_yticks(range(len(rows)), [r["method"] for r in rows])
    speed.set(xlabel="decode speedup over specrt ar (median, 95% interval)",
              title=f"Speedup, {report['prompts']} prompts x {report.get('repeats', 1)} passes")
    speed.grid(axis="x", alpha=0.3)
    for row in spec:
        cond = row["per_position_acceptance"]["conditional"]
        left.plot(range(1, len(cond) + 1), cond, marker="o", label=f"{row['method']} (τ {row['tau']:.2f})")
    left.set(xlabel="draft position k", ylabel="P(accept k | k-1 accepted)", ylim=(0, 1),
             title="Per-position conditional acceptance")
    left.grid(alpha=0.3)
    left.legend()
    names = [d["dataset"] for d in report["datasets"]]
    methods = [r["method"] for r in spec]
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        taus = [next(r["tau"] for r in d["results"] if r["method"] == m) for d in report["datasets"]]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
        bars = right.bar(xs, taus, width, label=m)
        right.bar_label(bars, fmt="%.2f", fontsize=7)
    right.set_xticks(range(len(names)), names, rotation=15)
    right.set(ylabel="τ (tokens per target call)", title="τ per prompt set")
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"greedy, batch 1, {report['max_new_tokens']} new tokens", fontsize=9)
    return save_figure(fig, path)


def parse_baselines(values: Iterable[str]) -> list[str]:
    """`--baseline` values (repeated and/or comma-separated) -> the baselines to run, in order, `none` dropped."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    bad = [n for n in names if n != "none" and not is_baseline(n)]
    if bad:
        raise SpecrtError(f"--baseline: unknown baseline {bad[0]!r}; choose from none, {', '.join(BASELINES)} "
                          "(a C++ method's variant too: cpp-ngram:tree=3)")
    for n in names:
        if is_cpp(n):
            method_variant(n.removeprefix("cpp-"))  # a malformed variant: its one-line error now
    if "none" in names and len(set(names)) > 1:
        raise SpecrtError("--baseline none cannot be combined with another baseline")
    return list(dict.fromkeys(n for n in names if n != "none"))


def load_hf_model(source: Path, threads: int | None = None):
    """transformers' fp32 model of an artifact's source (a GGUF is dequantized), in eval mode."""
    import torch
    import transformers as tf

    if threads:
        torch.set_num_threads(threads)
    if source.suffix == ".gguf":
        model = tf.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return model.eval()


def artifact_source(manifest) -> Path:
    """The source model an artifact (its manifest) was exported from (a GGUF file or a Hugging Face directory)."""
    sources = manifest.sources
    if not sources:
        raise SpecrtError("the artifact records no source model, so no --baseline can be loaded")
    path = Path(sources[0].path)
    if path.name in ("config.json",) or path.suffix == ".safetensors" or path.name.endswith(".json"):
        path = path.parent
    if not path.exists():
        raise SpecrtError(f"the artifact's source model {path} no longer exists (needed for --baseline)")
    return path


# -- the interleaved run --------------------------------------------------------------------------------------

@dataclass
class Runs:
    """Every engine's generations: runs[dataset][engine][prompt][pass]."""

    sets: dict[str, list[list[int]]]
    runs: dict[str, dict[str, list[list[Generation]]]]
    quiet: dict
    engines: dict[str, dict]


def start_workers(specs: list[EngineSpec]) -> dict[str, Worker]:
    """Start every engine's process (they load side by side) and wait until each is ready."""
    workers = {s.name: Worker(s) for s in specs}
    try:
        for w in workers.values():
            w.ready()
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers


def run_interleaved(workers: dict[str, Worker], sets: dict[str, list[list[int]]], *, max_new_tokens: int,
                    eos: list[int], repeats: int = 1, progress: bool = True,
                    on_run: Callable[[str, str, int, int], None] | None = None) -> Runs:
    """Warm every engine up on the first prompt, then `repeats` passes: each prompt by every engine in a
    rotating order. Only one engine runs at a time; the CPU the others use meanwhile is recorded."""
    import psutil

    names = list(workers)
    me = psutil.Process()
    first = next((ids for prompts in sets.values() for ids in prompts), None)
    if first is None:
        raise SpecrtError("no prompts to run")
    for w in workers.values():  # warm-up, excluded: first-use allocations, caches, JIT
        w.run(first, max_new_tokens, eos)
    runs = {d: {n: [[] for _ in prompts] for n in names} for d, prompts in sets.items()}
    jobs = [(d, i) for _ in range(repeats) for d, prompts in sets.items() for i in range(len(prompts))]
    check = QuietCheck()
    with tqdm(total=len(jobs) * len(names), desc="bench", unit="run", disable=not progress) as bar:
        for j, (d, i) in enumerate(jobs):
            for name in names[j % len(names):] + names[:j % len(names)]:
                if on_run is not None:
                    on_run(d, name, i, len(runs[d][name][i]))
                before = {n: w.cpu_seconds() for n, w in workers.items()}
                mine, s0, t0 = sum(me.cpu_times()[:2]), CpuSample.now(), time.perf_counter()
                gen = workers[name].run(sets[d][i], max_new_tokens, eos)
                wall, s1 = time.perf_counter() - t0, CpuSample.now()
                used = {n: w.cpu_seconds() - before[n] for n, w in workers.items()}
                bench_s = sum(used.values()) + sum(me.cpu_times()[:2]) - mine
                busy = s1.busy_s - s0.busy_s if s0.busy_s is not None and s1.busy_s is not None else None
                idle = {n: v for n, v in used.items() if n != name}
                check.add(wall, busy, bench_s, sum(idle.values()), idle)
                runs[d][name][i].append(gen)
                bar.update(1)
                time.sleep(SETTLE_S)  # the engine's thread pool stops spinning before the next engine starts
    return Runs(sets, runs, check.report(), {n: w.describe() for n, w in workers.items()})


# -- the report -----------------------------------------------------------------------------------------------

def _pair_ratios(gens: list[list[Generation]], refs: list[list[Generation]]) -> np.ndarray:
    """[prompts, passes]: rate over rate on the same prompt and pass, each over the tokens both generated."""
    out = np.full((len(gens), max((len(g) for g in gens), default=0)), np.nan)
    for i, (row, ref_row) in enumerate(zip(gens, refs)):
        for r, (g, ref) in enumerate(zip(row, ref_row)):
            k = min(len(g.tokens), len(ref.tokens))
            a, b = g.decode_rate(k), ref.decode_rate(k)
            if a and b:
                out[i, r] = a / b
    return out


def engine_row(name: str, gens: list[list[Generation]], gamma: int = 0) -> dict:
    """Pooled figures of one engine over prompts and passes: decode tokens/s, tokens, τ and acceptance."""
    flat = [g for row in gens for g in row]
    decode_tokens = sum(max(len(g.tokens) - 1, 0) for g in flat)
    decode_s = sum(g.times[-1] - g.times[0] for g in flat if len(g.tokens) > 1)
    total_s = sum(g.times[-1] for g in flat if g.tokens)
    row = {"method": name, "tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s else 0.0,
           "end_to_end_tokens_per_s": round(sum(len(g.tokens) for g in flat) / total_s, 3) if total_s else 0.0,
           "generated_tokens": sum(len(row[0].tokens) for row in gens if row),  # one pass's
           "prefill_s": round(sum(g.times[0] for g in flat if g.tokens), 3), "decode_s": round(decode_s, 3),
           "passes": max((len(r) for r in gens), default=0)}
    rounds = [r for g in flat for r in g.rounds]
    if rounds and gamma:  # a speculative method (AR's rounds verify no drafts)
        stats = RunStats(method=name, gamma=gamma, rounds=rounds, draft_s=sum(g.draft_s for g in flat),
                         verify_s=sum(g.verify_s for g in flat))
        spec = stats.to_dict()
        row.update(tau=spec["tau"], rounds=spec["rounds"], gamma=gamma, mean_verify_len=spec["mean_verify_len"],
                   per_position_acceptance=spec["per_position_acceptance"], draft_s=spec["draft_s"],
                   verify_s=spec["verify_s"])
    return row


def compare(runs: dict[str, list[list[Generation]]], engines: dict[str, dict]) -> tuple[bool, list[dict]]:
    """One prompt set (or all, concatenated): whether every exact engine matched `ar`, and a row per engine with
    its speedup over `ar` and over each baseline (median and 95% interval of the paired ratios)."""
    ref = runs["ar"]
    baselines = [n for n in runs if is_baseline(n)]
    first_pass = {n: [row[0].tokens for row in gens] for n, gens in runs.items()}
    rows, identical = [], True
    for name, gens in runs.items():
        row = engine_row(name, gens, engines.get(name, {}).get("gamma", 0))
        same = all(g.tokens == r[0].tokens for row_, r in zip(gens, ref) for g in row_)
        if name not in REPORTED_ONLY:
            row["identical"] = same
            identical &= same
        if is_baseline(name):
            row["first_difference"] = difference_summary(first_pass[name], first_pass["ar"])
        ci = median_ci(_pair_ratios(gens, ref)) if name != "ar" else None
        row["speedup"] = ci["median"] if ci else (1.0 if name == "ar" else None)
        row["speedup_ci"] = [ci["low"], ci["high"]] if ci else None
        row["vs"] = {b: median_ci(_pair_ratios(gens, runs[b])) for b in baselines if b != name}
        rows.append(row)
    return identical, rows


def report(r: Runs, max_new_tokens: int, repeats: int) -> dict:
    """The bench's JSON: per prompt set and pooled over all, plus the machine, the quiet check and the engines."""
    names = list(next(iter(r.runs.values())))
    datasets = []
    for d, per_engine in r.runs.items():
        same, rows = compare(per_engine, r.engines)
        datasets.append({"dataset": d, "prompts": len(r.sets[d]), "identical": same,
                         "results": [dict(row, dataset=d) for row in rows]})
    pooled_runs = {n: [row for d in r.runs for row in r.runs[d][n]] for n in names}
    identical, pooled = compare(pooled_runs, r.engines)
    return {"identical": identical, "prompts": sum(len(v) for v in r.sets.values()), "repeats": repeats,
            "max_new_tokens": max_new_tokens, "order": "interleaved: every engine per prompt, rotating",
            "machine": machine_info(), "quiet": r.quiet, "engines": r.engines,
            "results": [row for d in datasets for row in d["results"]], "datasets": datasets, "pooled": pooled}


def run_bench(artifact: Path, prompt_files, limit, max_new_tokens: int, names: list[str],
                       baselines: list[str], repeats: int, threads, *, progress: bool, options: dict) -> dict:
    """`specrt bench` at batch 1: every method and baseline in its own worker process, interleaved prompt by prompt;
    the report (`report`)."""
    manifest = io.load_manifest(artifact)
    tokenizer = (Tokenizer.from_dir(Path(artifact) / io.TOKENIZER_DIR, manifest.tokenizer)
                 if manifest.tokenizer else None)
    sets = {p.stem: [encode_prompt(tokenizer, t) for t in read_prompts_file(p, limit)] for p in prompt_files}
    for stem, prompts in sets.items():  # before any worker starts: the rule every engine applies
        for i, ids in enumerate(prompts):
            try:
                check_room(manifest, len(ids), max_new_tokens, manifest.gamma if names != ["ar"] else 0)
            except SpecrtError as e:
                raise SpecrtError(f"{stem} prompt {i + 1}: {e}") from None
    longest = max((len(ids) for prompts in sets.values() for ids in prompts), default=0)
    source = str(artifact_source(manifest)) if any(not is_cpp(n) for n in baselines) else None
    exact = {k: v for k, v in options.items() if k in ("backend", "device", "dtype")}
    specs = [EngineSpec(m, str(artifact), threads=threads,
                        options=tuple(sorted(dict(options, gamma=options["gamma"] if m != "ar" else None).items())))
             for m in names]
    specs += [EngineSpec(n, str(artifact), source=source, threads=threads, n_ctx=longest + max_new_tokens + 8,
                         options=tuple(sorted((k, v) for k, v in exact.items() if k != "backend")))
              for n in baselines if not is_cpp(n)]
    specs += [EngineSpec(n, str(artifact), threads=threads, options=tuple(sorted(options.items())))
              for n in baselines if is_cpp(n)]  # the C++ runtime: the methods' own settings
    workers = start_workers(specs)
    try:
        runs = run_interleaved(workers, sets, max_new_tokens=max_new_tokens, eos=sorted(manifest.eos_ids),
                                 repeats=repeats, progress=progress)
    finally:
        for w in workers.values():
            w.close()
    return report(runs, max_new_tokens, repeats)


def _load(avg) -> str:
    return "?" if avg is None else "/".join(f"{x:.2f}" for x in avg)


def format_report(report: dict) -> tuple[str, str | None]:
    """The bench's table: per prompt set (and all), each engine's rate, τ, tokens and speedup with its interval; and
    the warning a run on a busy machine gets (None when it was quiet)."""
    lines: list[str] = []

    datasets = report["datasets"]
    rows = [(d["dataset"], row) for d in datasets for row in d["results"]]
    if len(datasets) > 1:
        rows += [("all", row) for row in report["pooled"]]
    baselines = [r["method"] for r in report["pooled"] if is_baseline(r["method"])]
    head = f"{'prompts':10s} {'engine':15s} {'tau':>6s} {'decode tok/s':>13s} {'tokens':>7s} {'vs ar (95% CI)':>24s}"
    lines.append(head + "".join(f" {'vs ' + n:>24s}" for n in baselines))
    for name, row in rows:
        tau = f"{row['tau']:6.2f}" if "tau" in row else f"{'-':>6s}"
        ar = (fmt({"median": row["speedup"], "low": row["speedup_ci"][0], "high": row["speedup_ci"][1]})
              if row.get("speedup_ci") else "1.00x" if row["method"] == "ar" else "-")
        cells = "".join(f" {fmt(row['vs'].get(n)) if n != row['method'] else '-':>24s}" for n in baselines)
        lines.append(f"{name[:10]:10s} {row['method']:15s} {tau} {row['tokens_per_s']:13.2f} "
                   f"{row['generated_tokens']:7d} {ar:>24s}{cells}")
    for row in report["pooled"]:
        if "per_position_acceptance" in row:
            cond = ", ".join(f"{a:.2f}" for a in row["per_position_acceptance"]["conditional"])
            lines.append(f"{row['method']} conditional acceptance per position: {cond}")
        if "first_difference" in row:
            d = row["first_difference"]
            where = (f"; first differs at token {d['min_index']} (min), {d['mean_index']} (mean)"
                     if d["min_index"] is not None else "")
            lines.append(f"{row['method']} vs ar: identical tokens on {d['identical_prompts']}/{d['prompts']} "
                       f"prompts{where}")
    for name, info in report["engines"].items():
        if "cost_table" in info:
            c = info["cost_table"]
            lines.append(f"{name}: cost table from {c['source']}, refined by {c['observations']} observations "
                       f"({c['explored_rounds']} exploring rounds), drift x{c['drift']:.2f}")
    q = report["quiet"]
    lines.append(f"{report['prompts']} prompts x {report['repeats']} passes, interleaved; other processes used "
               f"{q['other_cores_mean']} cores on average (max {q['other_cores_max']}), idle engines "
               f"{q['idle_engines_cpu_s']} CPU s, load {_load(q['load_before'])} -> {_load(q['load_after'])}")
    lines.append(f"identical greedy outputs: {report['identical']}")
    if "plot" in report:
        lines.append(f"wrote {report['plot']}")
    return "\n".join(lines), None if q["quiet"] else q["warning"]


def llama_cpp_rate(manifest: io.Manifest, art_dir: Path, ids: list[int], max_new_tokens: int) -> tuple[Path, float]:
    """llama.cpp's greedy decode tokens/s on the artifact's source GGUF for prompt tokens `ids`, in a process of its
    own (after a short warm-up); SpecrtError when llama-cpp-python is not installed."""
    require("llama.cpp")
    source = artifact_source(manifest)
    worker = Worker(EngineSpec("llama.cpp", str(art_dir), source=str(source), n_ctx=manifest.export.max_seq))
    try:
        worker.ready()
        eos = sorted(manifest.eos_ids)
        worker.run(ids, 8, eos)  # warm-up
        return source, worker.run(ids, max_new_tokens, eos).decode_rate() or 0.0
    finally:
        worker.close()
