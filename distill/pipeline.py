"""`specrt distill`: the whole distillation pipeline, one resumable stage after another.

    target    export the target once more, with the feature outputs the heads train on (work/target), in the
              format `specrt export` gives it (a preset: its GGUF blocks; --weights chooses); then the run's time
              estimate (distill/estimate.py: the work of every stage at its graph calls' rates, timed now)
    generate  the target's own responses to the training prompts (work/responses.jsonl; resumable per prompt);
              with --responses-per-prompt K, K-1 more sampled ones (work/responses.<k>.jsonl), merged into one
    features  one prefill pass per response into an fp16 memmap cache (work/cache; work/cache.xK for K responses)
    train     DSpark or MTP training on that cache (work/train-<head>; resumable from its last save)
    calibrate STS temperatures of the DSpark confidence head on the held-out "calib" prompts
    save      the compact bf16 checkpoint (embedding and head left to the target's), token_counts.npy (the
              train responses' token frequencies, for `specrt export --draft-vocab`) + report.json, atomically

The work directory is shared by both heads: the target and cache always carry the default DSpark feature
layers and the final hidden state, so `--head mtp` after `--head dspark` reuses generation and features.
Wall time spent in each stage accumulates in work/timings.json across resumed runs and goes into the report.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.distill.cache import TargetCache
from specrt.distill.calibrate import calibrate_dspark
from specrt.distill.estimate import Estimate, estimate
from specrt.distill.features import capture_features
from specrt.distill.losses import OBJECTIVES
from specrt.distill.generate import (SAMPLING, check_responses, extra_sampling, generate_responses,
                                     given_responses, merge_responses, read_responses, responses_file)
from specrt.exporter.export import sha256_file
from specrt.exporter.vocab import COUNTS_FILE, count_tokens, write_counts
from specrt.distill.prompts import PromptSplit, rows_label, training_prompts
from specrt.distill.train_dspark import TrainResult, train_dspark
from specrt.distill.train_mtp import train_mtp
from specrt.exporter.loaders import load_target
from specrt.exporter.loaders.deepspec import SHARED_WITH_TARGET, default_layer_ids, load_dspark, save_deepspec_checkpoint
from specrt.exporter.loaders.mtp import load_mtp, save_mtp_checkpoint
from specrt.exporter.onnx.target import FINAL
from specrt.outdir import check_out, check_writable, staged
from specrt.configs.presets import preset_format, resolve_model

HEADS = ("dspark", "mtp")
WORK_BACKENDS = ("ort", "torch")  # where the work target runs (a TensorRT engine is built per artifact)
REPORT = "report.json"
TIMINGS = "timings.json"
CURVE_POINTS = 200  # loss-curve rows kept in the report (evenly spaced over the run)
# calibration reads at most this many calib samples (64 anchors x the block each: 16k anchors fit K temperatures;
# the 3M-token corpus's 1,530 took 19 minutes on two cores, 256 take 3)
CALIB_MAX_SEQS = 256


@dataclass(frozen=True)
class DistillSettings:
    """What `specrt distill` trains and on which data; the defaults produce the committed SmolLM2 heads."""

    head: str
    layers: int = 1
    block: int = 7
    markov_rank: int = 64
    head_type: str = "vanilla"
    target_layers: tuple[int, ...] | None = None  # DSpark feature layers (default: DeepSpec-style spread)
    steps: int = 3000
    lr: float = 6e-4
    max_new_tokens: int = 256
    sampling: str = "greedy"
    responses_per_prompt: int = 1  # the first with `sampling`, the others with DeepSpec's sampling
    gen_batch: int = 8
    max_seq: int = 768
    limit: int | None = None
    calib_fraction: float = 0.1
    seed: int = 0
    dtype: str = "bfloat16"  # of the saved weights
    threads: int | None = None
    weights: str | None = None  # of the work target that generates and gives features; None: what export uses
    objective: str = "sampled"  # DSpark: "sampled" (DeepSpec's loss, T=1) or "greedy" (argmax, T=0 serving)
    # where the work target generates and gives features (None: ONNX Runtime on the CPU, the torch backend on a GPU)
    # and where the head trains
    backend: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise SpecrtError(f"--head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.sampling not in SAMPLING:
            raise SpecrtError(f"--sampling must be one of {', '.join(SAMPLING)}, got {self.sampling!r}")
        for name in ("layers", "block", "steps", "max_new_tokens", "gen_batch", "responses_per_prompt"):
            if getattr(self, name) < 1:
                raise SpecrtError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.head == "mtp" and self.layers != 1:
            raise SpecrtError(f"an MTP head has exactly one layer (DeepSeek-V3 layout), got --layers {self.layers}")
        if self.markov_rank < 0:
            raise SpecrtError(f"--markov-rank must be >= 0, got {self.markov_rank}")
        if self.max_new_tokens >= self.max_seq:
            raise SpecrtError(f"--max-new-tokens {self.max_new_tokens} leaves no room for a prompt in "
                              f"--max-seq-len {self.max_seq}")
        if self.weights not in (None, "float", "int8", "int4", "gguf"):
            raise SpecrtError(f"--weights must be float, int8, int4 or gguf, got {self.weights!r}")
        if self.objective not in OBJECTIVES:
            raise SpecrtError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective != "sampled" and self.head != "dspark":
            raise SpecrtError(f"--objective {self.objective} is for --head dspark (an MTP head trains on CE + KL)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise SpecrtError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.backend is not None and self.backend not in WORK_BACKENDS:
            raise SpecrtError(f"--backend must be one of {', '.join(WORK_BACKENDS)}, got {self.backend!r}")
        if self.backend == "ort" and not self.device.startswith("cpu"):
            raise SpecrtError(f"--device {self.device} runs the target on the torch backend (the onnxruntime "
                              "installed here runs on the CPU); leave --backend out or pass --backend torch")

    @property
    def runs_on(self) -> dict[str, str]:
        """The work target's backend and device, as the generation and feature stages take them."""
        backend = self.backend or ("ort" if self.device.startswith("cpu") else "torch")
        return {"backend": backend, "device": self.device}


class _Timings:
    """Seconds per stage, summed over every run that worked in this work directory."""

    def __init__(self, work: Path) -> None:
        self.path = work / TIMINGS
        self.seconds: dict[str, float] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + seconds, 1)
        self.path.write_text(json.dumps(self.seconds, indent=1) + "\n")


def feature_sources(num_layers: int, target_layers: Sequence[int] | None) -> list[int | str]:
    """What the work-dir target outputs: DSpark's default layers (and any asked for) plus the final hidden state."""
    layers = sorted({*default_layer_ids(num_layers), *(target_layers or ())})
    return [*layers, FINAL]


def _stage_target(source: Path, work: Path, s: DistillSettings, sources: list[int | str], fmt: dict[str, str],
                  progress: bool) -> Path:
    from specrt.exporter.export import export_artifact

    art, key_path = work / "target", work / "target.json"
    key = {"source": str(source.resolve()), "features": sources, "batch": s.gen_batch, "max_seq": s.max_seq}
    if fmt != {"weights": "float", "attention": "standard"}:  # keys of float work directories stay as they were
        key.update(fmt)
    if (art / io.MANIFEST).is_file() and key_path.is_file():
        old = json.loads(key_path.read_text())
        if old != key:
            raise SpecrtError(f"work directory {work} was made for another target or settings "
                              f"({', '.join(k for k in key if old.get(k) != key[k])} differ); use another --work")
        return art
    settings = io.ExportSettings(batch=s.gen_batch, max_seq=s.max_seq, prefill_chunk=min(64, s.max_seq // 2),
                                 verify_len=1, **fmt)
    export_artifact(source, art, settings, extra_features=tuple(sources), progress=progress, force=True)
    key_path.write_text(json.dumps(key, indent=1) + "\n")
    return art


def _train(s: DistillSettings, cache: TargetCache, loaded, train_dir: Path, ids: list[int],
           progress: bool) -> TrainResult:
    if s.head == "dspark":
        return train_dspark(cache, loaded.weights, loaded.config, train_dir, layers=s.layers, block=s.block,
                            markov_rank=s.markov_rank, head_type=s.head_type, target_layer_ids=tuple(ids),
                            steps=s.steps, lr=s.lr, seed=s.seed, threads=s.threads, progress=progress,
                            objective=s.objective, device=s.device)
    return train_mtp(cache, loaded.weights, loaded.config, train_dir, steps=s.steps, lr=s.lr, seed=s.seed,
                     threads=s.threads, progress=progress, device=s.device)


def _save_compact(s: DistillSettings, train_dir: Path, staging: Path, loaded) -> None:
    """Re-save the trained head in `s.dtype` without the tensors it shares with the target."""
    if s.head == "dspark":
        head = load_dspark(train_dir, loaded.config)
        hf = json.loads((train_dir / "config.json").read_text())
        weights = {k: v for k, v in head.weights.items() if k not in SHARED_WITH_TARGET}
        save_deepspec_checkpoint(staging, dict(hf, dtype=s.dtype), weights, dtype=s.dtype)
    else:
        head = load_mtp(train_dir, loaded.config)
        save_mtp_checkpoint(staging, loaded.config.to_hf(), head.weights, dtype=s.dtype)


def _generation(meta: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    """Sampling parameters of the cached responses (one entry per response of a prompt when there are several)."""
    if "samples" in meta:
        return [m.get("sampling_params", {}) for m in meta["samples"]]
    return meta.get("sampling_params", {})


def _curve(history: list[dict[str, float]]) -> list[dict[str, float]]:
    every = max(1, len(history) // CURVE_POINTS)
    return [h for i, h in enumerate(history) if (i + 1) % every == 0 or i + 1 == len(history)]


def _estimate(art: Path, s: DistillSettings, split: PromptSplit | None, given: Path | None) -> Estimate:
    """The run's work and its time on this machine (distill/estimate.py): the prompts' tokens through the work
    target's tokenizer and chat template, or the given responses' tokens."""
    if given is not None:
        rows = read_responses(given)
        return estimate(art, prompts=len(rows), prompt_tokens=sum(len(r["prompt_ids"]) for r in rows),
                        generate_tokens=0, train_steps=s.steps, threads=s.threads, **s.runs_on,
                        feature_tokens=sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows))
    from specrt.distill.generate import prompt_tokens
    from specrt.runtime.tokenizer import Tokenizer

    manifest = io.load_manifest(art)
    tokenizer = Tokenizer.from_dir(art / io.TOKENIZER_DIR, manifest.tokenizer)
    n = len(split.prompts) * s.responses_per_prompt
    prompt = sum(prompt_tokens(tokenizer, p) for p in split.prompts) * s.responses_per_prompt
    return estimate(art, prompts=len(split.prompts), prompt_tokens=prompt, generate_tokens=n * s.max_new_tokens,
                    feature_tokens=prompt + n * s.max_new_tokens, train_steps=s.steps, threads=s.threads,
                    **s.runs_on)


def distill(target: str, prompt_files: Sequence[str | Path], out: str | Path, settings: DistillSettings, *,
            work: str | Path | None = None, progress: bool = True, force: bool = False,
            responses: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Run (or resume) every stage; write the head to `out` with its report, and return the report. `responses`:
    train on the target's responses generated before (e.g. datasets/corpus/responses/) instead of generating them
    for `prompt_files`."""
    s = settings
    out = Path(out)
    work = Path(work) if work is not None else out.with_name(out.name + ".work")
    for f in prompt_files:
        if not Path(f).is_file():
            raise SpecrtError(f"prompts file not found: {f}")
    for f in responses:
        if not Path(f).is_file():
            raise SpecrtError(f"responses file not found: {f}")
    if bool(prompt_files) == bool(responses):
        raise SpecrtError("give --prompts FILE.jsonl (responses are generated) or --responses FILE (generated "
                          "before), not both" if prompt_files else "give at least one --prompts FILE.jsonl or "
                          "--responses FILE")
    if responses and s.limit is not None:
        raise SpecrtError("--limit chooses among --prompts; with --responses every response is used")
    # everything is checked before the work directory is made: a failed start leaves nothing behind
    if not s.device.startswith("cpu"):
        from specrt.distill.train_dspark import train_device

        train_device(s.device)  # a GPU that is not there: one line, now
    source = resolve_model(target, progress=progress)
    check_out(out, sources=[source, work, *prompt_files, *responses], force=force, command="distill")
    if work.resolve() == out.resolve() or out.resolve() in work.resolve().parents:
        raise SpecrtError(f"--work {work} is inside --out {out}; writing the checkpoint would delete it")
    check_writable(out)
    split: PromptSplit | None = training_prompts(prompt_files=[Path(f) for f in prompt_files], limit=s.limit,
                                                 calib_fraction=s.calib_fraction, seed=s.seed) if prompt_files else None
    loaded = load_target(source)
    if responses:  # before anything is written: this target's own
        check_responses(responses, [sha256_file(Path(f)) for f in loaded.source_files])
    if loaded.tokenizer is None:
        raise SpecrtError(f"{target} has no tokenizer, and distill needs one to encode the --prompts text "
                          "(add the model's tokenizer.json, or tokenizer.model, to its directory)")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecrtError(f"cannot create the work directory {work}: {e.strerror or e}") from None
    timings = _Timings(work)
    t_run = time.perf_counter()

    def timed(stage: str, fn):
        t0 = time.perf_counter()
        result = fn()
        timings.add(stage, time.perf_counter() - t0)
        return result

    cfg = loaded.config
    ids = list(s.target_layers or default_layer_ids(cfg.num_layers))
    sources = feature_sources(cfg.num_layers, s.target_layers)
    # the work target has the weights and attention lowering `specrt export TARGET` gives (for a preset: its
    # 4-bit GGUF blocks), so the heads learn from the numerics they will be served beside, and generate faster
    fmt = preset_format(target)
    if s.weights is not None and s.weights != fmt["weights"]:
        fmt = {"weights": s.weights, "attention": fmt["attention"] if s.weights != "float" else "standard"}
    art = timed("target", lambda: _stage_target(source, work, s, sources, fmt, progress))
    if split is None:  # responses generated before: this target's, split by prompt
        given, splits = given_responses(responses, work / "responses.given.jsonl", calib_fraction=s.calib_fraction,
                                        target_sources=[f.sha256 for f in io.load_manifest(art).sources], seed=s.seed)
        k_files, cache_name = [given], "cache.given"
    plan = _estimate(art, s, split, given if split is None else None)
    if progress:
        print(plan.line(), file=sys.stderr, flush=True)
    if split is not None:
        k_files = [timed("generate", lambda k=k: generate_responses(
            art, split.prompts, responses_file(work, k), max_new_tokens=s.max_new_tokens,
            sampling=extra_sampling(k, s.sampling), seed=s.seed + k, threads=s.threads, progress=progress,
            **s.runs_on))
            for k in range(s.responses_per_prompt)]
        splits, n = split.indices, len(split.prompts)
    if split is None:
        responses_path = k_files[0]
    elif len(k_files) == 1:
        responses_path, cache_name = k_files[0], "cache"
    else:  # sample k of prompt i is row k * n + i, in the split of prompt i (a prompt's samples side by side,
        # so the held-out tail that training evaluates on holds whole prompts)
        responses_path = merge_responses(k_files, work / f"responses.x{len(k_files)}.jsonl", n)
        splits = {name: [k * n + i for i in idx for k in range(len(k_files))] for name, idx in splits.items()}
        cache_name = f"cache.x{len(k_files)}"  # beside the single-response cache, so neither replaces the other
    cache_dir = timed("features", lambda: capture_features(art, responses_path, work / cache_name,
                                                           feature_sources=sources, splits=splits,
                                                           threads=s.threads, progress=progress,
                                                           **s.runs_on))
    cache = TargetCache(cache_dir)
    train_dir = work / f"train-{s.head}"
    result = timed("train", lambda: _train(s, cache, loaded, train_dir, ids, progress))

    with staged(out, "distill") as staging:  # beside `out`, swapped in at the end; removed on any failure
        timed("save", lambda: _save_compact(s, train_dir, staging, loaded))
        train = set(splits["train"])  # what `specrt export --draft-vocab` ranks tokens by
        counts = count_tokens((r["response_ids"] for r in read_responses(responses_path) if r["index"] in train),
                              cfg.vocab_size)
        write_counts(staging / COUNTS_FILE, counts)
        calibration = None
        if s.head == "dspark":
            cal = timed("calibrate", lambda: calibrate_dspark(cache, staging, cfg, seed=s.seed,
                                                              acceptance=s.objective, max_seqs=CALIB_MAX_SEQS,
                                                              target_weights=loaded.weights, progress=progress))
            calibration = cal.to_dict()
            config_path = staging / "config.json"
            hf = json.loads(config_path.read_text())
            hf["confidence_temperatures"] = cal.temperatures
            config_path.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        report = {
            "head": s.head, "target": str(source), "settings": asdict(s),
            "prompts": ({"files": [str(f) for f in prompt_files], "split": rows_label(split),
                         "train": len(split.train), "calib": len(split.calib)} if split is not None else
                        {"responses": [str(f) for f in responses], "split": f"given responses (train "
                         f"{len(splits['train'])}, calib {len(splits['calib'])}, held out "
                         f"{len(splits.get('val', []))})", "train": len(splits["train"]),
                         "calib": len(splits["calib"]), "val": len(splits.get("val", []))}),
            "token_counts": {"file": COUNTS_FILE, "tokens": int(counts.sum()), "distinct": int((counts > 0).sum())},
            "cache": {"samples": len(cache), **cache.manifest.get("counts", {}),
                      "tokens": int(len(cache.tokens)), "capture": cache.manifest.get("capture", {}),
                      "generation": _generation(cache.manifest.get("generation", {}))},
            "train": {"config": result.config, "steps": result.steps, "steps_per_s": round(result.steps_per_s, 3),
                      "evals": result.evals, "loss_curve": _curve(result.history)},
            "tau": {"untrained": result.tau_initial, "trained": result.tau,
                    "estimate": "teacher-forced on held-out responses (DSpark: expected accepted drafts + 1 "
                                "per block; MTP: chained from depth-1 acceptance)"},
            "calibration": calibration,
            "seconds": {**timings.seconds, "total": round(sum(timings.seconds.values()), 1)},
            "estimate": plan.to_dict(),
            "checkpoint_bytes": sum(f.stat().st_size for f in staging.iterdir() if f.is_file()),
        }
        (staging / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    report["this_run_seconds"] = round(time.perf_counter() - t_run, 1)
    return report
