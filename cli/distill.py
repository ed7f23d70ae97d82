"""`specrt distill`: training draft heads for a target (the work is in specrt/distill)."""
from __future__ import annotations

import json
from pathlib import Path

import click


def _layer_list(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer ids, got {value!r}") from None



@click.command()
@click.argument("target")
@click.option("--head", type=click.Choice(["dspark", "mtp"]), required=True, help="Which draft head to train.")
@click.option("--prompts", "prompts", multiple=True, type=click.Path(path_type=Path),
              help='Training prompts, JSONL of {"turns": [...]} (repeatable). Rows equal to an eval row '
                   "(the first 20 of each datasets/ file) are dropped.")
@click.option("--responses", "responses", multiple=True, type=click.Path(path_type=Path),
              help="Instead of --prompts: this target's responses generated before (repeatable; JSONL or .jsonl.gz "
                   "with their .meta.json, e.g. datasets/corpus/responses/), split by prompt.")
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
@click.option("--objective", type=click.Choice(["sampled", "greedy"]), default="sampled",
              help="DSpark loss: DeepSpec's, for sampled (T=1) serving; or greedy: the draft learns the target's "
                   "argmax and the confidence head whether it matches, for greedy (T=0) serving.")
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
@click.option("--device", default="cpu", show_default=True,
              help="Where generation, features and training run: cpu, or cuda[:N] (the target on the torch "
                   "backend, the head trained on the GPU).")
@click.option("--backend", type=click.Choice(["ort", "torch"]), default=None,  # distill.pipeline.WORK_BACKENDS
              help="The work target's runtime [default: ort on the CPU, torch on a GPU].")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def distill(target: str, prompts: tuple[Path, ...], responses: tuple[Path, ...], out: Path, work: Path | None,
            force: bool, quiet: bool, as_json: bool, **opts) -> None:
    """Train a draft head for TARGET: generate -> features -> train -> calibrate -> save (each stage resumes)."""
    from specrt.distill.pipeline import DistillSettings, distill as run_distill
    from specrt.outdir import sigterm_as_interrupt

    with sigterm_as_interrupt():  # stages resume; SIGTERM stops like Ctrl-C, so nothing half-written is left
        report = run_distill(target, list(prompts), out, DistillSettings(**opts), work=work, progress=not quiet,
                             force=force, responses=list(responses))
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
