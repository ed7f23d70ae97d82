"""Options and settings the commands share: export settings, sampling, the engine's configuration."""
from __future__ import annotations

import click

from specrt.configs.presets import EXPORT_DEFAULTS
from specrt.errors import SpecrtError
from specrt.runtime.config import BACKENDS, DEFAULT_SCHEDULER, DTYPES, METHODS, SCHEDULERS, TORCH_SCHEDULER, EngineConfig, default_scheduler


def scheduler_for(scheduler: str | None, backend: str) -> str:
    return scheduler or default_scheduler(backend)


def say_kernels(artifact, backend: str = "ort") -> None:
    """One line on stderr, after a command's work succeeded (so an error stays the one line it is): the kernels the
    artifact's graphs ran on in ONNX Runtime (specrt's, which instruction set, or the stock ones, why and at what
    cost). Nothing for the torch backend, which runs no ONNX graph."""
    from specrt import artifact as io
    from specrt import native

    if backend not in ("ort", "onnxruntime"):
        return
    click.echo(f"specrt: {native.kernels_line(io.load_manifest(artifact).export.kernels)}", err=True)


def engine_config(method: str, gamma: int | None, scheduler: str | None, threshold: float, ngram: int, backend: str,
                  device: str, dtype: str | None, threads: int | None, slots: int | None = None, tree: int = 1
                  ) -> EngineConfig:
    """The engine settings of `engine_options` (the scheduler defaulting by backend)."""
    return EngineConfig(method=method, gamma=gamma, scheduler=scheduler_for(scheduler, backend), threshold=threshold,
                        ngram=ngram, backend=backend, device=device, dtype=dtype, threads=threads, slots=slots,
                        tree=tree)



DEFAULTS = dict(batch=EXPORT_DEFAULTS.batch, max_seq_len=EXPORT_DEFAULTS.max_seq,
                prefill_chunk=EXPORT_DEFAULTS.prefill_chunk, verify_len=EXPORT_DEFAULTS.verify_len)



def export_options(f):
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



def export_settings(batch: int, max_seq_len: int, prefill_chunk: int, verify_len: int | None, gamma: int | None,
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



def build_requests(engine, prompt, input_ids, prompts, limit, raw, params):
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



def sampling_options(f):
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



def sampling_params(max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos):
    from specrt.runtime.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens, stop_strings=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)



def engine_options(f):
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
        click.option("--tree", default=1, show_default=True,
                     help="Draft trees, verified in one call (the scheduler admits their likeliest nodes; 1: "
                          "chains): ngram looks up this many continuations with different first tokens; dspark and "
                          "dspark+ngram add up to this many - 1 of the head's likeliest other first tokens."),
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
