"""`specrt run`, `demo`, `parity`: generating with an artifact."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt import native
from specrt.errors import SpecrtError
from specrt.runtime.config import DEFAULT_SCHEDULER, METHODS, EngineConfig
from specrt.cli.options import (build_requests, engine_config, engine_options, sampling_options, sampling_params,
                                say_kernels)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="User message (chat template applied unless --raw).")
@click.option("--input-ids", default=None, help="Comma-separated prompt token ids.")
@click.option("--prompts", default=None, type=click.Path(path_type=Path), help='JSONL of {"turns": [...]}.')
@click.option("--limit", type=int, default=None, help="Use the first N prompts of --prompts.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template to --prompt/--prompts.")
@sampling_options
@engine_options
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Write one JSON line per round per request (speculative methods).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def run(artifact: Path, prompt, input_ids, prompts, limit, raw, method, gamma, scheduler, threshold, ngram, tree,
        backend, device, dtype, threads, trace, as_json, **sampling) -> None:
    """Generate with an exported artifact."""
    from specrt.runtime.engine import Engine

    params = sampling_params(**sampling)
    if method == "ar":
        for flag, value in (("--gamma", gamma), ("--trace", trace)):
            if value is not None:
                click.echo(f"specrt: warning: {flag} is ignored with --method ar (it does not draft)", err=True)
        trace = gamma = None
    config = engine_config(method, gamma, scheduler, threshold, ngram, backend, device, dtype, threads, tree=tree)
    with Engine.open(artifact, config, trace=trace) as engine:
        requests = build_requests(engine, prompt, input_ids, prompts, limit, raw, params)
        stream = len(requests) == 1 and not as_json and engine.tokenizer is not None
        on_text = (lambda _id, delta: (sys.stdout.write(delta), sys.stdout.flush())) if stream else None
        outputs, stats = engine.generate(requests, on_text=on_text)
    if as_json:
        click.echo(json.dumps({"requests": [o.__dict__ for o in outputs], "stats": stats.to_dict()}))
        say_kernels(artifact, backend)
        return
    if stream:
        click.echo()
    else:
        for o in outputs:
            click.echo(f"[{o.id}] " + (o.text if engine.tokenizer else ",".join(map(str, o.output_ids))))
    s = stats.to_dict()
    tau = f", tau {s['tau']:.2f} tokens per target call" if method != "ar" and s.get("tau") else ""
    click.echo(f"-- {s['generated_tokens']} tokens, decode {s['decode_tokens_per_s']:.1f} tok/s{tau}, "
               f"prefill {s['prefill_ms']:.0f} ms", err=True)
    say_kernels(artifact, backend)



@click.command()
@click.option("--prompt", default="Write a Python function that checks whether a string is a palindrome, with a "
              "docstring and doctests.", help="User message (speculation pays most on code, which repeats itself).")
@click.option("--max-new-tokens", default=128, help="Tokens to generate.")
@click.option("--method", type=click.Choice(METHODS), default="dspark+ngram",
              show_default=True,
              help="The lossless draft/verify method run beside plain decoding (ar): ngram, dspark and mtp (the shipped "
                   "trained heads), or dspark+ngram / mtp+ngram, which draft by lookups and call the head when it "
                   "pays (dspark+ngram: the fastest measured, docs/benchmarks.md).")
def demo(prompt: str, max_new_tokens: int, method: str) -> None:
    """Fetch the default model, export it (cached), and generate for a sample prompt with plain decoding (ar) and
    with a speculative method: each one's speed, the speedup, and a check that the two outputs are identical;
    llama.cpp on the same GGUF and prompt tokens too, when llama-cpp-python is installed."""
    from tqdm import tqdm

    from specrt.tools.bench import llama_cpp_rate
    from specrt.tools.bench_workers import LLAMA_CPP_INSTALL
    from specrt.tools.default_artifact import default_artifact
    from specrt.runtime.engine import Request
    from specrt.runtime.prompts import encode_prompt
    from specrt.runtime.engine import Engine
    from specrt.runtime.sampling import SamplingParams

    art = default_artifact(progress=True)
    runs = {}
    for m in dict.fromkeys(("ar", method)):
        with Engine.open(art, EngineConfig(method=m, scheduler=DEFAULT_SCHEDULER)) as engine:
            ids = encode_prompt(engine.tokenizer, prompt)
            engine.generate([Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new_tokens))])  # warm-up:
            # every call shape the run will use is compiled and every cache page touched once, for both methods
            request = Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new_tokens))
            with tqdm(total=max_new_tokens, desc=f"generate ({m})", unit="tok") as bar:
                outputs, stats = engine.generate([request], on_token=lambda _id, n: bar.update(n))
            runs[m] = (outputs[0], stats.to_dict())
            manifest, art_dir, x = engine.manifest, engine.art_dir, engine.manifest.export
    (ar, s_ar), (spec, s_spec) = runs["ar"], runs[method]
    click.echo(f"\n>>> {prompt}\n{spec.text}\n")
    click.echo(native.kernels_line(x.kernels))
    click.echo(f"specrt ar ({x.weights} weights, {x.attention} attention): "
               f"{s_ar['generated_tokens']} tokens; "
               f"decode {s_ar['decode_tokens_per_s']:.1f} tokens/s")
    speedup = s_spec["decode_tokens_per_s"] / s_ar["decode_tokens_per_s"]
    if method != "ar":
        click.echo(f"specrt {method}: decode {s_spec['decode_tokens_per_s']:.1f} tokens/s, tau {s_spec['tau']:.2f} "
                   f"tokens per target call: {speedup:.2f}x ar")
    if spec.output_ids != ar.output_ids:
        k = next((i for i, (a, b) in enumerate(zip(ar.output_ids, spec.output_ids)) if a != b),
                 min(len(ar.output_ids), len(spec.output_ids)))
        if x.kernels == "stock":  # ONNX Runtime's kernels may compute a row differently among others than alone
            raise SpecrtError(f"{method}'s output differs from ar's at token {k}: the artifact runs ONNX Runtime's "
                              "stock kernels, which can give a token verified among others other bits than "
                              f"decoding it alone (docs/cli.md, `--kernels`); build specrt's kernels "
                              f"(`{ops_library.BUILD}`) and run the demo again")
        raise SpecrtError(f"{method}'s output differs from ar's at token {k}: greedy speculative decoding must be "
                          "identical (a bug; please report it with this command)")
    if method != "ar":
        click.echo(f"outputs identical: all {len(ar.output_ids)} tokens (checked)")
    try:
        source, tps = llama_cpp_rate(manifest, art_dir, ids, max_new_tokens)
    except SpecrtError as e:  # not installed, or it failed: say which
        if "needs llama_cpp" in str(e):
            click.echo(f"llama.cpp: not installed, no comparison; to compare: {LLAMA_CPP_INSTALL}")
        else:
            click.echo(f"llama.cpp: no comparison: {e}")
    else:
        if tps:
            click.echo(f"llama.cpp on {source.name}, same prompt tokens, its own process: decode {tps:.1f} tokens/s "
                       f"(specrt ar {s_ar['decode_tokens_per_s'] / tps:.2f}x"
                       + (f", {method} {s_spec['decode_tokens_per_s'] / tps:.2f}x)" if method != "ar" else ")"))
        else:
            click.echo("llama.cpp: produced no decode tokens")
    click.echo(f"(artifact: {art})")


@click.command()
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
