"""`specrt bench`, `profile`, `compare`: measuring an artifact (the work is in specrt/tools)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.errors import SpecrtError
from specrt.runtime.config import (BACKENDS, DEFAULT_SCHEDULER, DTYPES, METHODS, SCHEDULERS, TORCH_SCHEDULER,
                                   method_variant)
from specrt.cli.options import say_kernels, scheduler_for


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompt_files", multiple=True, required=True, type=click.Path(path_type=Path),
              help='JSONL of {"turns": [...]}; repeat for several prompt sets (reported one by one).')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of each file.")
@click.option("--max-new-tokens", default=128, help="Tokens to generate per prompt (greedy, batch 1).")
@click.option("--methods", default="ar", help="Comma-separated specrt methods to run: " + ", ".join(METHODS)
              + " (a variant: ngram:tree=3, n-gram lookups drafting trees of 3 continuations).")
@click.option("--gamma", type=int, default=None, help="Drafts verified per round [default: the artifact's].")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default=None,
              help=f"Verify lengths per round (see `specrt run --help`) [default: {DEFAULT_SCHEDULER}; "
                   f"{TORCH_SCHEDULER} with --backend torch].")
@click.option("--threshold", default=0.3, show_default=True, help="--scheduler threshold: the survival cut.")
@click.option("--concurrency", default=None,
              help="Comma-separated request counts kept in flight (e.g. 1,2,4,8,16): serve all prompts through the "
                   "online engine at each level, per method and --schedulers entry, beside batched AR.")
@click.option("--schedulers", default=None,
              help="With --concurrency: comma-separated schedulers to run every speculative method under "
                   "[default: --scheduler].")
@click.option("--ngram", default=3, help="ngram method: longest suffix looked up.")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", help="Runtime backend.")
@click.option("--device", default="cpu", show_default=True,
              help="--backend torch: cpu or cuda[:N] (CUDA graphs); the hf baseline runs there too.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="--backend torch: the modules' precision [default: the artifact's]; the hf baseline's too.")
@click.option("--baseline", "baselines", multiple=True, default=["none"],
              help="Also run on the artifact's source model, each in its own process: hf (transformers generate()), "
                   "llama.cpp (llama-cpp-python on the source GGUF; optional extra specrt[llama]), openvino and "
                   "openvino-lookup (OpenVINO GenAI on the source GGUF, plain and with its prompt lookup; optional "
                   "extra specrt[openvino]), cpp-METHOD (specrt's C++ runtime on the artifact, e.g. cpp-ar, "
                   "cpp-dspark+ngram, cpp-ngram:tree=3: docs/cpp.md); repeat or comma-separate.")
@click.option("--repeats", default=1, show_default=True,
              help="Passes over the prompts (each pass interleaves every engine prompt by prompt, rotating; with "
                   "--concurrency, every engine serves all prompts in turn per pass, rotating; medians reported).")
@click.option("--bracket", is_flag=True,
              help="With --concurrency: AR also serves before each other engine's pass and after the last, and "
                   "each engine is rated against the mean of the AR passes either side of it (a drift of the "
                   "machine's speed between them cancels; more AR passes, longer run).")
@click.option("--threads", type=int, default=None,
              help="Threads for ONNX Runtime, torch, llama.cpp and OpenVINO (default: all cores).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: speedups with their intervals, per-position conditional acceptance per method, "
                   "and tau per prompt set.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(artifact: Path, prompt_files: tuple[Path, ...], limit, max_new_tokens: int, methods: str, gamma,
          scheduler: str, threshold: float, concurrency: str | None, schedulers: str | None, ngram: int,
          backend: str, device: str, dtype: str | None, baselines: tuple[str, ...], repeats: int, bracket: bool,
          threads, plot: Path | None, as_json: bool) -> None:
    """Benchmark methods and baselines on the same prompts, interleaved in one run (greedy, batch 1).

    Every engine runs in a process of its own; on each prompt every engine runs in turn (rotating order), over
    --repeats passes after a warm-up. Speedups are medians of per-prompt ratios with a bootstrap 95% interval,
    against ar and every baseline, over the tokens both engines generated. Every method (and the hf baseline)
    must produce the same greedy tokens as `ar`; if any differs the command fails (exit 1). llama.cpp and OpenVINO
    compute differently (quantized weights): where they first differ is reported."""
    from specrt.tools import bench as b
    from specrt.tools.bench_workers import require

    names = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in names if m.partition(":")[0] not in METHODS]
    if bad or not names:
        raise SpecrtError(f"--methods: unknown method {bad[0] if bad else '(none)'}; choose from {', '.join(METHODS)} "
                          "(a variant: ngram:tree=3)")
    for m in names:
        method_variant(m)  # a variant's options are checked before anything is loaded
    names = ["ar", *dict.fromkeys(m for m in names if m != "ar")]  # speedups are relative to specrt's own AR
    stems = [p.stem for p in prompt_files]
    if len(set(stems)) != len(stems):
        raise SpecrtError(f"--prompts: two files share the name {next(s for s in stems if stems.count(s) > 1)!r}")
    if plot is not None and plot.suffix.lower() != ".png":
        raise SpecrtError(f"--plot writes a PNG; got {plot}")
    baselines = b.parse_baselines(baselines)
    scheduler = scheduler_for(scheduler, backend)
    if repeats < 1:
        raise SpecrtError(f"--repeats must be >= 1, got {repeats}")
    if concurrency is not None:
        if baselines:
            raise SpecrtError("--baseline runs at batch 1; drop --concurrency to compare with it")
        from specrt.tools import concurrency as cc

        report = cc.bench(artifact, prompt_files, limit, max_new_tokens, names, gamma, scheduler, schedulers, threshold,
                          concurrency, backend, threads, progress=not as_json, device=device, dtype=dtype,
                          repeats=repeats, bracket=bracket)
        if plot is not None:
            report["plot"] = str(cc.plot(report, plot))
        click.echo(json.dumps(report) if as_json else cc.format_rows(report))
        say_kernels(artifact, backend)
        if not report["identical"]:
            raise SpecrtError("methods produced different greedy tokens")
        return
    if bracket:
        raise SpecrtError("--bracket goes with --concurrency (at batch 1 every engine serves each prompt in turn)")
    if schedulers is not None:
        raise SpecrtError("--schedulers goes with --concurrency; for one scheduler at batch 1 use --scheduler")
    for name in baselines:
        if name != "hf":
            require(name)  # a missing optional extra fails before anything is loaded
    report = b.run_bench(artifact, prompt_files, limit, max_new_tokens, names, baselines, repeats, threads,
                                progress=not as_json,
                                options=dict(gamma=gamma, scheduler=scheduler, ngram=ngram, backend=backend,
                                             threshold=threshold, device=device, dtype=dtype))
    if plot is not None:
        report["plot"] = str(b.plot_report(report, plot))
    if as_json:
        click.echo(json.dumps(report))
    else:
        table, warning = b.format_report(report)
        click.echo(table)
        if warning:
            click.echo(f"specrt: warning: {warning}", err=True)
    say_kernels(artifact, backend)
    if not report["identical"]:
        bad_sets = ", ".join(d["dataset"] for d in report["datasets"] if not d["identical"])
        click.echo(f"specrt: error: methods produced different greedy tokens (on {bad_sets})", err=True)
        sys.exit(1)



@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", help="Runtime backend.")
@click.option("--device", default="cpu", show_default=True,
              help="--backend torch: cpu or cuda[:N] (each call a CUDA graph's replay, as an engine makes it); the "
                   "profile is stored for that device and precision.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="--backend torch: the modules' precision [default: the artifact's].")
@click.option("--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("--position", default=128, show_default=True, help="Cache position every call runs at.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved repetitions (medians are reported).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: verify cost against verified tokens, draft calls against a decoding step.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def profile(artifact: Path, backend: str, device: str, dtype: str | None, threads: int | None, position: int,
            repeats: int, plot: Path | None, as_json: bool) -> None:
    """Measure the draft call and the verify call (against verified tokens) on this machine; store the table in
    ARTIFACT (profile.json) for the schedulers."""
    from specrt.runtime.measure import measure
    from specrt.runtime.profile import save_profile
    from specrt.tools.plots import plot_profile

    if plot is not None and plot.suffix.lower() != ".png":
        raise SpecrtError(f"--plot writes a PNG; got {plot}")
    if repeats < 1 or (threads is not None and threads < 1):
        raise SpecrtError("--repeats and --threads must be >= 1")
    prof = measure(artifact, backend=backend, threads=threads, position=position, repeats=repeats,
                   progress=not as_json, device=device, dtype=dtype)
    path = save_profile(artifact, prof)
    report = {**prof.to_dict(), "in_steps": prof.summary(), "file": str(path)}
    if plot is not None:
        report["plot"] = str(plot_profile(prof, plot))
    if as_json:
        click.echo(json.dumps(report))
        return
    step = prof.step_ms(1)
    click.echo(f"{prof.backend}, {prof.threads} threads, cache position {prof.position} ({prof.machine})")
    lens = sorted({t for row in prof.verify.values() for t in row})  # rows of larger B may stop at fewer T
    click.echo("verify call ms, B slots x T tokens each (T=1: a decoding step)")
    click.echo(" " * 6 + "".join(f"{'T=' + str(t):>8s}" for t in lens))
    for b, row in sorted(prof.verify.items()):
        click.echo(f"{'B=' + str(b):6s}" + "".join(f"{row[t]:8.2f}" if t in row else f"{'-':>8s}" for t in lens))
    for head, row in sorted(prof.draft.items()):
        click.echo(f"{head} draft call ms: " + ", ".join(f"B={b} {ms:.2f}" for b, ms in sorted(row.items()))
                   + f"  ({prof.draft_ms(head, 1) / step:.2f} decoding steps at B=1)")
    click.echo(f"wrote {path}" + (f" and {report['plot']}" if plot is not None else ""))



@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backends", default="ort,torch", help="Comma-separated backends; the first is the reference.")
@click.option("--bucket-seed", "seed", default=0, help="Seed of the random inputs fed to every backend.")
@click.option("--atol", type=float, default=None, help="Largest abs difference [default: 1e-3 float32, 5e-2 float16].")
@click.option("--threads", type=int, default=None, help="Intra-op threads per backend (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def compare(artifact: Path, backends: str, seed: int, atol: float | None, threads: int | None, as_json: bool) -> None:
    """Run every graph family of ARTIFACT on several backends with the same inputs; exit 1 if they disagree."""
    from specrt.tools.compare import compare_artifact, failure_message, format_table, parse_backends

    result = compare_artifact(artifact, parse_backends(backends), seed=seed, atol=atol, threads=threads)
    click.echo(json.dumps(result.to_dict()) if as_json else format_table(result))
    if not result.ok:
        raise SpecrtError(failure_message(result))
