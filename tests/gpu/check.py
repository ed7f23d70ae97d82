"""The GPU check: correctness and speed of the torch CUDA-graph path (and TensorRT where it imports), one table.

    python3 tests/gpu/check.py [--device cuda] [--smollm2 PATH.gguf] [--out DIR] [--quick]

Rows (each a check with its result; a failed check is a row, never a crash of the whole script):
  identity   torch backend (fp32, CUDA graphs, device-resident rounds) greedy-identical to ONNX Runtime's CPU AR on
             the tiny models, DeepSpec's fixture and SmolLM2, every method
  graphs     replay equal to eager; static inputs and caches never reallocated; captures, replays, failures
  syncs      host synchronisations per decode round, counted by torch's sync debug mode (warnings), not assumed
  triton     the ConfidenceTruncate kernel compiled for this GPU, equal to the numpy reference
  speed      SmolLM2 tokens/s at batch 1 and 16: transformers generate() on the same device (the anchor), specrt AR
             eager, AR with CUDA graphs, each speculative method with CUDA graphs, tau beside each
  tensorrt   engine build and the tensorrt backend against ONNX Runtime (only where `tensorrt` imports)
With --device cpu it runs the same code without capture (a dry run of the script on a machine without a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # conftest's tiny-model builder

from specrt import artifact as io  # noqa: E402
from specrt.artifact import ExportSettings, load_manifest  # noqa: E402
from specrt.exporter.export import export_artifact  # noqa: E402
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint  # noqa: E402
from specrt.exporter.loaders.mtp import random_mtp_checkpoint  # noqa: E402
from specrt.runtime.backends import infer, load_runner  # noqa: E402
from specrt.tools.compare import random_feeds  # noqa: E402
from specrt.runtime.engine import Engine, Request  # noqa: E402
from specrt.runtime.profile import Profile  # noqa: E402
from specrt.runtime.prompts import encode_prompt, read_prompts_file  # noqa: E402
from specrt.runtime.sampling import SamplingParams  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "deepspec_dspark_tiny"
DATASETS = ROOT / "datasets"
ROWS: list[dict] = []


def row(check: str, case: str, ok: bool | None, detail: str = "", **numbers) -> None:
    ROWS.append({"check": check, "case": case, "ok": ok, "detail": detail, **numbers})
    mark = {True: "ok", False: "FAIL", None: "-"}[ok]
    print(f"  {check:9s} {case:34s} {mark:4s} {detail}", flush=True)


def guarded(check: str, case: str):
    """Run a check; an exception becomes a failed row with its last line."""
    def wrap(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 -- every failure is reported in the table
                line = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                row(check, case, False, f"{type(e).__name__}: {line[:160]}")
                traceback.print_exc(file=sys.stderr)
        return run
    return wrap


# -- artifacts -------------------------------------------------------------------------------------------------

def tiny_artifacts(tmp: Path) -> dict[str, Path]:
    from conftest import build_tiny_hf_model

    target = build_tiny_hf_model(tmp / "tiny_llama", "llama", num_layers=2)
    draft = random_dspark_checkpoint(tmp / "draft", target, layers=1, block_size=4, markov_rank=16)
    mtp = random_mtp_checkpoint(tmp / "mtp", target)
    settings = ExportSettings(batch=4, max_seq=128, prefill_chunk=8, verify_len=4)
    return {"tiny llama (dspark, mtp)": export_artifact(target, tmp / "tiny", settings, draft=draft, mtp=mtp,
                                                         progress=False),
            "deepspec fixture (qwen3)": export_artifact(FIXTURE / "target", tmp / "fixture",
                                                        ExportSettings(batch=2, max_seq=96, prefill_chunk=8,
                                                                       verify_len=5),
                                                        draft=FIXTURE / "draft", progress=False)}


def smollm2_artifact(tmp: Path, gguf: Path | None, batch: int) -> Path | None:
    """`specrt export smollm2 --batch B` (the shipped heads), offline: the GGUF comes from --smollm2 or the cache."""
    from specrt.configs.fetch import MODEL_FILENAME, cache_dir

    if gguf is not None:
        cache = tmp / "cache"
        link = cache / "models" / MODEL_FILENAME  # where default_model_path looks
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(gguf.resolve())
        os.environ["SPECRT_CACHE"] = str(cache)
    if not (cache_dir() / "models" / MODEL_FILENAME).exists():
        return None  # never fetched here: the GPU machine has no network
    out = tmp / f"smollm2_b{batch}"
    # stock ops: the torch backend reads those. Accuracy level 0: ORT's MatMulNBits with fp32 activations, what the
    # torch backend's dequantized weights compute (level 4's int8 activations are ORT's own rounding; a dry run here
    # saw a first-token difference on one of four prompts). No profile: the cost-aware rows bring their own table.
    subprocess.run([sys.executable, "-m", "specrt.cli", "export", "smollm2", "--batch", str(batch), "--out", str(out),
                    "--kernels", "stock", "--accuracy-level", "0", "--no-profile", "--force"], check=True,
                   stdout=subprocess.DEVNULL, cwd=tmp)  # not the checkout: its specrt/ is not the installed package
    return out


# -- checks ----------------------------------------------------------------------------------------------------

def prompts_of(art: Path, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts from the code and math sets when the artifact has a tokenizer, else random repeated ids."""
    m = load_manifest(art)
    if m.tokenizer:
        from specrt.runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(art / io.TOKENIZER_DIR, m.tokenizer)
        code, math = (read_prompts_file(DATASETS / f"{f}.jsonl", n) for f in ("humaneval", "gsm8k"))
        texts = [t for pair in zip(code, math) for t in pair]  # the eval rows: code and math alternate
        return [encode_prompt(tok, t) for t in texts[:n]]
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, 4).tolist() * 3 + rng.integers(3, vocab, 5).tolist()) for _ in range(n)]


def generate(art: Path | Engine, prompts: list[list[int]], max_new: int, **kw
             ) -> tuple[list[list[int]], Engine, float]:
    """Greedy outputs, the engine (made from `art` and `kw` unless given) and the wall time."""
    engine = art if isinstance(art, Engine) else Engine(art, **kw)
    reqs = [Request(p, SamplingParams(max_new_tokens=max_new), id=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs, _ = engine.generate(reqs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [o.output_ids for o in outs], engine, time.perf_counter() - t0


def flat_profile(m: io.Manifest) -> Profile:
    """A cost table for the cost-aware rows (the hybrid, sps): flat, so drafts pay; identity holds on any table."""
    batches = [b for b in (1, 2, 4, 8, 16, 32) if b <= m.export.batch] or [1]
    verify = {b: {p: 10.0 + 0.5 * p for p in range(b, (m.gamma + 1) * b + 1)} for b in batches}
    return Profile(backend="torch", threads=1, position=16, machine="flat", created="", verify=verify,
                   draft={h: {b: 1.0 for b in batches} for h in m.heads})


def identity(name: str, art: Path, device: str, max_new: int) -> None:
    m = load_manifest(art)
    methods = [(x, "fixed") for x in ("ar", "ngram", *[h for h in ("mtp", "dspark") if h in m.heads])]
    methods += [(f"{h}+ngram", "sps") for h in ("dspark",) if h in m.heads]
    methods += [("dspark", s) for s in ("sps", "sps-async") if "dspark" in m.heads]
    prompts = prompts_of(art, min(4, m.export.batch * 2), m.model.vocab_size)
    ref = guarded("identity", f"{name}: ORT CPU AR reference")(generate)(art, prompts, max_new, method="ar",
                                                                         backend="ort")
    if ref is None:
        return
    ref = ref[0]
    for method, scheduler in methods:
        case = f"{name}: {method}" + (f" {scheduler}" if scheduler != "fixed" else "")

        @guarded("identity", case)
        def one():
            out, engine, _ = generate(art, prompts, max_new, method=method, backend="torch", device=device,
                                      dtype="float32", scheduler=scheduler, profile=flat_profile(m))
            same = sum(a == b for a, b in zip(out, ref))
            first = next((k for a, b in zip(out, ref) for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            where = "device rounds" if engine.device_rounds is not None else f"host loop ({engine.device_note})"
            row("identity", case, same == len(ref),
                f"{same}/{len(ref)} identical to ORT CPU AR; {where}" + (f"; first difference at token {first}"
                                                                         if first is not None else ""))
        one()


def graphs(name: str, art: Path, device: str) -> None:
    """Every bucket of every family: a captured runner's outputs equal an eager runner's on the same inputs, twice
    (the second call reads what the first wrote); input buffers and cache tensors keep their addresses."""
    m = load_manifest(art)
    for family, spec in m.graphs.items():
        @guarded("graphs", f"{name}: {family}")
        def one():
            runs = {g: load_runner("torch", art, m, family, device=device, dtype="float32", graphs=g)
                    for g in ((True, False) if device.startswith("cuda") else (False,))}
            for r in runs.values():
                r.allocate(m.export.batch)
            worst, buckets = 0.0, 0
            ptrs = None
            for use, bs in spec.buckets.items():
                bucket = bs[-1]
                rng = np.random.default_rng(buckets)
                start = np.zeros(bucket["B"], np.int64)
                for _ in range(2):
                    feeds, start = random_feeds(m, family, bucket, bucket["B"], rng, start)
                    outs = {g: {k: v.copy() for k, v in infer(r, 0, feeds).items()} for g, r in runs.items()}
                    for k, v in outs[False].items():
                        worst = max(worst, float(np.abs(outs[list(outs)[0]][k].astype(np.float64) - v).max()))
                buckets += 1
                r = runs[list(runs)[0]]
                now = {key: [t.data_ptr() for t in c.feeds.values()] for key, c in r._calls.items()}
                now["cache"] = [t.data_ptr() for kv in r._cache for t in kv]
                ptrs = {**now, **(ptrs or {})}  # what each buffer's address was when first seen
                if any(now[k] != ptrs[k] for k in now):
                    raise AssertionError("a static buffer moved")
            s = runs[list(runs)[0]].graph_stats
            ok = (worst == 0.0 and s.failed == 0 and s.captures == buckets) if device.startswith("cuda") else None
            row("graphs", f"{name}: {family}", ok, f"{buckets} buckets, replay vs eager max |diff| {worst:.3g}; "
                f"captures {s.captures}, replays {s.replays}, failed {s.failed} {s.failure}", max_diff=worst,
                **s.as_dict())
        one()


def syncs(name: str, art: Path, device: str, method: str, max_new: int, batch: int = 1) -> None:
    @guarded("syncs", f"{name}: {method} b{batch}")
    def one():
        if not device.startswith("cuda"):
            row("syncs", f"{name}: {method} b{batch}", None, "needs CUDA (torch's sync debug mode)")
            return
        m = load_manifest(art)
        engine = Engine(art, method=method, backend="torch", device=device, scheduler="fixed", slots=batch)
        for p in prompts_of(art, batch, m.model.vocab_size):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        engine.step()  # admissions and prefill (their copies up are not rounds)
        engine.step()  # the first round of each bucket captures its graph
        steps, counted = 0, 0
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                while engine.has_unfinished() and not engine.waiting:
                    engine.step()
                    steps += 1
                counted = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        per = counted / max(steps, 1)
        rounds = engine.device_rounds
        g = rounds.graph_stats if rounds else None
        row("syncs", f"{name}: {method} b{batch}", per <= 1.0, f"{counted} synchronisations in {steps} rounds "
            f"({per:.2f} per round; engine count {rounds.syncs if rounds else '-'}); round graphs: "
            + (f"captures {g.captures}, replays {g.replays}, failed {g.failed} {g.failure}" if g else "-"),
            per_round=per)
    one()


@guarded("triton", "ConfidenceTruncate kernel")
def triton_kernel(device: str) -> None:
    if not device.startswith("cuda"):
        row("triton", "ConfidenceTruncate kernel", None, "needs CUDA (tests/test_confidence_truncate.py runs it "
            "under Triton's interpreter)")
        return
    from specrt.plugins.confidence_truncate import truncate
    from specrt.plugins.trt_confidence_truncate import launch

    rng = np.random.default_rng(0)
    cases = 0
    for b, g in [(1, 1), (1, 16), (3, 7), (8, 4), (16, 7), (64, 16)]:
        temps = rng.uniform(0.5, 2.0, g).astype(np.float32)
        for logits in (rng.normal(0, 3, (b, g)).astype(np.float32), np.full((b, g), 40.0, np.float32)):
            for threshold, budget in [(0.4, -1), (0.0, -1), (0.0, 0), (0.0, 5), (0.0, 10**6)]:
                a, n = launch(torch.from_numpy(logits).to(device), torch.from_numpy(temps).to(device),
                              torch.tensor(threshold, device=device), torch.tensor(budget, device=device))
                ra, rn = truncate(logits, temps, threshold, budget)
                np.testing.assert_allclose(a.cpu().numpy(), ra, rtol=2e-6, atol=1e-7)
                np.testing.assert_array_equal(n.cpu().numpy(), rn)
                cases += 1
    row("triton", "ConfidenceTruncate kernel", True, f"{cases} cases equal to the reference on "
        f"{torch.cuda.get_device_name()}")


def gpu_profile(art: Path, device: str, dtype: str) -> Profile | None:
    """The cost table the sps rows plan on, measured here (`specrt profile`'s measure on the torch backend)."""
    from specrt.runtime.measure import measure

    @guarded("speed", "profile")
    def one() -> Profile:
        t0 = time.perf_counter()
        prof = measure(art, backend="torch", device=device, dtype=dtype, repeats=3, calls=3, progress=False)
        at = {b: (prof.step_ms(b), max(prof.verify[b].items())) for b in (1, 16) if b in prof.verify}
        row("speed", "profile", None, f"{time.perf_counter() - t0:.0f} s; " + "; ".join(
            f"B={b}: a step {ms:.2f} ms, verifying {p} tokens {v / ms:.2f} steps" for b, (ms, (p, v)) in at.items())
            + "; draft calls at B=1 " + ", ".join(f"{h} {prof.draft_ms(h, 1) / prof.step_ms(1):.2f}"
                                                  for h in prof.draft) + " steps", profile=prof.to_dict())
        return prof
    return one()


def speed(art: Path, gguf_source: Path, device: str, batch: int, max_new: int, n_prompts: int, dtype: str,
          prof: Profile | None) -> None:
    """tokens/s (generated tokens over wall time, prefill included, after a warm-up) per configuration."""
    m = load_manifest(art)
    prompts = prompts_of(art, n_prompts, m.model.vocab_size)
    configs = [("transformers generate()", None), ("specrt ar eager", dict(method="ar", cuda_graphs=False)),
               ("specrt ar cuda graphs", dict(method="ar"))]
    configs += [(f"specrt {h} cuda graphs", dict(method=h)) for h in ("ngram", "mtp", "dspark")
                if h == "ngram" or h in m.heads]
    if prof is not None:  # the cost-aware scheduler on a table measured on this GPU
        configs += [(f"specrt {h} sps", dict(method=h, scheduler="sps"))
                    for h in ("mtp", "dspark", "dspark+ngram") if h.split("+")[0] in m.heads]
    results = {}
    for label, kw in configs:
        @guarded("speed", f"b{batch} {label}")
        def one():
            if kw is None:
                tokens, wall = hf_generate(gguf_source, prompts, max_new, device, dtype, batch)
                tau = None
            else:
                how = {"scheduler": "fixed", **kw}
                engine = Engine(art, backend="torch", device=device, dtype=dtype, slots=batch,
                                profile=prof if how["scheduler"] != "fixed" else None, **how)
                generate(engine, prompts[:batch], 8)  # warm-up: graph captures, the allocator
                outs, engine, wall = generate(engine, prompts, max_new)
                tokens = sum(len(o) for o in outs)
                tau = engine.stats.to_dict().get("tau") if kw["method"] != "ar" else 1.0
            results[label] = tokens / wall
            base = results.get("specrt ar cuda graphs")
            vs = f"; {results[label] / base:.2f}x AR graphs" if base and label != "specrt ar cuda graphs" else ""
            anchor = results.get("transformers generate()")
            vs += f"; {results[label] / anchor:.2f}x transformers" if anchor and kw is not None else ""
            row("speed", f"b{batch} {label}", None, f"{tokens / wall:8.1f} tok/s" +
                (f", tau {tau:.2f}" if tau is not None else "") + vs, batch=batch, tokens_per_s=tokens / wall,
                tau=tau)
        one()


def hf_generate(source: Path, prompts: list[list[int]], max_new: int, device: str, dtype: str, batch: int):
    from specrt.tools.bench import load_hf_model

    model = load_hf_model(source).to(device, getattr(torch, dtype))
    tokens, t0 = 0, None
    with torch.inference_mode():
        for warm in (True, False):
            t0 = time.perf_counter()
            for i in range(0, len(prompts), batch):
                chunk = prompts[i:i + batch] if not warm else prompts[:batch]
                width = max(map(len, chunk))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)  # left padding
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
                out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8 if warm else max_new,
                                     min_new_tokens=8 if warm else max_new, pad_token_id=0)
                if not warm:
                    tokens += (out.shape[1] - width) * len(chunk)
                if warm:
                    break
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    return tokens, time.perf_counter() - t0


@guarded("tensorrt", "engines")
def tensorrt_checks(arts: dict[str, Path], max_new: int) -> None:
    """`specrt build` (fp16 engines from fp32 artifacts: weakly typed), then the tensorrt backend's greedy tokens
    against ONNX Runtime's (fp16 may flip near-ties: the row says where the first difference is)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        row("tensorrt", "engines", None, "tensorrt does not import on this machine: not checked")
        return
    from specrt.exporter.tensorrt_build import build_engines

    for name, art in arts.items():
        rec = build_engines(art, precision="fp16", progress=False)
        row("tensorrt", f"build {name}", True, f"{len(rec['families'])} engines, TensorRT {rec['tensorrt']}")
        m = load_manifest(art)
        prompts = prompts_of(art, 2, m.model.vocab_size)
        ref, _, _ = generate(art, prompts, max_new, method="ar", backend="ort")
        variants = [(x, {}) for x in ("ar", *[h for h in ("mtp", "dspark") if h in m.heads])]
        variants.append(("ngram:tree=3", {"tree": 3}))  # the engine's tree_mask input and cache row moves on CUDA
        for label, extra in variants:
            out, engine, _ = generate(art, prompts, max_new, method=label.split(":")[0], backend="tensorrt",
                                      scheduler="fixed", **extra)
            same = sum(a == b for a, b in zip(out, ref))
            row("tensorrt", f"{name}: {label}", None, f"{same}/{len(ref)} identical to ORT CPU AR (fp16 engine); "
                f"captures {engine.target.graph_stats.captures}, failed {engine.target.graph_stats.failed}")


def smollm2_part(tmp: Path, args: argparse.Namespace, speed_only: bool = False) -> None:
    """The shipped heads on the default model: identity against ORT, syncs (unless `speed_only`), speed at batch 1
    and 16."""
    from specrt.configs.fetch import MODEL_FILENAME, cache_dir

    try:
        art = smollm2_artifact(tmp, args.smollm2, 16)
    except Exception as e:  # noqa: BLE001 -- reported as a row
        row("identity", "smollm2 export", False, f"{type(e).__name__}: {str(e).strip()[-160:]}")
        return
    if art is None:
        row("speed", "smollm2", None, "SmolLM2 GGUF not found (--smollm2 or $SPECRT_CACHE): skipped")
        return
    source = cache_dir() / "models" / MODEL_FILENAME
    if not speed_only:
        identity("smollm2", art, args.device, 16 if args.quick else 32)
        for method in ("ar", "dspark"):
            syncs("smollm2", art, args.device, method, 32)
    prof = gpu_profile(art, args.device, args.dtype)
    for batch in (1, 16):
        speed(art, source, args.device, batch, 16 if args.quick else 128,
              2 if args.quick else (8 if batch == 1 else 32), args.dtype, prof)


def distill_part(tmp: Path, args: argparse.Namespace) -> None:
    """scripts/distill_gpu.sh on SmolLM2 (a head for the user's model on one GPU, meant to take ten minutes): its
    wall time and stages, the head's held-out τ, and the head exported beside the model decoding as AR does on the
    GPU. The work target runs on the torch backend, the head trains on args.device (--device cpu: a dry run)."""
    from specrt.configs.fetch import MODEL_FILENAME, cache_dir

    gguf = args.smollm2 or cache_dir() / "models" / MODEL_FILENAME
    if not gguf.is_file():
        row("distill", "smollm2", None, "SmolLM2 GGUF not found (--smollm2 or $SPECRT_CACHE): skipped")
        return
    out, env = tmp / "distilled", dict(os.environ, DEVICE=args.device)
    extra = ["--max-new-tokens", "32"] if args.quick else []
    if args.quick:
        env.update(LIMIT="48", STEPS="8", GEN_BATCH="8")
    t0 = time.time()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "distill_gpu.sh"), str(gguf), str(out), "--backend", "torch",
                        "--json", "--quiet", *extra], capture_output=True, text=True, env=env, cwd=tmp)
    wall = time.time() - t0
    if r.returncode:
        row("distill", f"smollm2 on {args.device}", False, (r.stderr.strip().splitlines() or ["?"])[-1][-200:])
        return
    rep = json.loads(r.stdout)
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in rep["seconds"].items() if k != "total")
    row("distill", f"smollm2 dspark on {args.device}", wall <= 600 or args.quick,
        f"{wall:.0f} s end to end ({stages}); {rep['prompts']['train']} prompts, {rep['train']['steps']} steps at "
        f"{rep['train']['steps_per_s']:.1f}/s; held-out tau {rep['tau']['untrained']:.2f} -> "
        f"{rep['tau']['trained']:.2f}", seconds=wall, stages=rep["seconds"])

    @guarded("distill", "its head exported and decoding")
    def decode():
        art = tmp / "distilled_art"
        subprocess.run([sys.executable, "-m", "specrt.cli", "export", str(gguf), "--draft", str(out), "--batch", "1",
                        "--out", str(art), "--kernels", "stock", "--accuracy-level", "0", "--no-profile", "--force"],
                       check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        prompts = prompts_of(art, 4, load_manifest(art).model.vocab_size)
        n = 16 if args.quick else 64
        ref, _, _ = generate(art, prompts, n, method="ar", backend="torch", device=args.device, dtype="float32")
        got, engine, _ = generate(art, prompts, n, method="dspark", backend="torch", device=args.device,
                                  dtype="float32")
        tau = engine.stats.to_dict().get("tau")
        row("distill", "its head: dspark vs ar (fp32, batch 1)", got == ref,
            f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)} identical to AR"
            + (f"; tau {tau:.2f}" if tau else ""))
    decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf [default: the cache]")
    ap.add_argument("--out", type=Path, default=None, help="Write the table as JSON here too.")
    ap.add_argument("--quick", action="store_true", help="Fewer prompts and tokens (a dry run).")
    ap.add_argument("--dtype", default="bfloat16", help="Precision of the speed rows (identity rows are fp32).")
    ap.add_argument("--parts", default="tiny,smollm2,tensorrt",
                    help="Which parts to run (comma-separated): tiny (the tiny models, DeepSpec's fixture, the Triton "
                         "kernel), smollm2, smollm2-speed (its speed rows alone), tensorrt, distill "
                         "(scripts/distill_gpu.sh on SmolLM2, ten minutes: not in the default).")
    args = ap.parse_args()
    t0 = time.time()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none (dry run)"
    print(f"specrt GPU check: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        parts = set(args.parts.split(","))
        arts = tiny_artifacts(tmp) if parts & {"tiny", "tensorrt"} else {}
        for name, art in arts.items() if "tiny" in parts else ():
            identity(name, art, args.device, 24)
            graphs(name, art, args.device)
            syncs(name, art, args.device, "dspark", 24)
        if "tiny" in parts:
            triton_kernel(args.device)
        if parts & {"smollm2", "smollm2-speed"}:
            smollm2_part(tmp, args, speed_only="smollm2" not in parts)
        if "tensorrt" in parts:
            tensorrt_checks(arts, 16)
        if "distill" in parts:
            distill_part(tmp, args)
    print(f"\n| check | case | ok | result |\n|---|---|---|---|")
    for r in ROWS:
        mark = {True: "ok", False: "**FAIL**", None: ""}[r["ok"]]
        print(f"| {r['check']} | {r['case']} | {mark} | {r['detail']} |")
    print(f"\n{gpu}; {time.time() - t0:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": ROWS}, indent=1))
    return 1 if any(r["ok"] is False for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
