"""`specrt bench`: specrt and baselines on the same model and prompts, side by side in one run."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.runtime.engine import Engine, Request, RunStats
from specrt.runtime.sampling import SamplingParams

BASELINES = ("hf", "llama.cpp")
# Baselines with their own arithmetic (llama.cpp: quantized weights, f16 KV cache): their tokens are reported
# (first_difference), never required to equal specrt ar's. hf runs the same fp32 weights and must match.
REPORTED_ONLY = ("llama.cpp",)
LLAMA_CPP_INSTALL = "pip install 'specrt[llama]' (builds llama.cpp from source, ~15 min on 2 cores)"


@dataclass
class MethodResult:
    method: str
    outputs: list[list[int]] = field(default_factory=list)
    generated_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stats: RunStats | None = None  # speculative methods: rounds pooled over all prompts

    def add(self, outputs: list[list[int]], generated: int, decoded: int, prefill_s: float, decode_s: float,
            stats: RunStats | None) -> None:
        """Accumulate more prompts: token and time sums; speculative rounds concatenated."""
        self.outputs += outputs
        self.generated_tokens += generated
        self.decode_tokens += decoded
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        if stats is not None and self.stats is not None:
            self.stats.gamma = stats.gamma
            self.stats.rounds += stats.rounds
            self.stats.decode_s += stats.decode_s
            self.stats.draft_s += stats.draft_s
            self.stats.verify_s += stats.verify_s

    def row(self, reference: "MethodResult | None") -> dict:
        tps = self.decode_tokens / self.decode_s if self.decode_s else 0.0
        e2e = self.generated_tokens / (self.prefill_s + self.decode_s) if self.prefill_s + self.decode_s else 0.0
        row = {"method": self.method, "tokens_per_s": round(tps, 3), "end_to_end_tokens_per_s": round(e2e, 3),
               "generated_tokens": self.generated_tokens, "prefill_s": round(self.prefill_s, 3),
               "decode_s": round(self.decode_s, 3)}
        if self.stats is not None and self.stats.method != "ar":
            spec = self.stats.to_dict()
            row.update(tau=spec["tau"], rounds=spec["rounds"], gamma=spec["gamma"],
                       per_position_acceptance=spec["per_position_acceptance"], draft_s=spec["draft_s"],
                       verify_s=spec["verify_s"])
        if reference is not None:
            ref = reference.row(None)
            row["speedup"] = round(tps / ref["tokens_per_s"], 3) if ref["tokens_per_s"] else None
            row["end_to_end_speedup"] = (round(e2e / ref["end_to_end_tokens_per_s"], 3)
                                         if ref["end_to_end_tokens_per_s"] else None)
            if self.method in BASELINES:
                row["first_difference"] = difference_summary(self.outputs, reference.outputs)
        return row


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


def identical(results: list[MethodResult]) -> bool:
    """Whether every result that must match (all but REPORTED_ONLY baselines) has the first one's tokens."""
    return all(r.outputs == results[0].outputs for r in results if r.method not in REPORTED_ONLY)


def run_specrt(engine: Engine, prompts: list[list[int]], params: SamplingParams,
               progress: bool = True, desc: str | None = None) -> MethodResult:
    """Batch-1 runs, one prompt at a time (the latency setting of the goals)."""
    res = MethodResult(engine.method, stats=RunStats(method=engine.method))
    desc = desc or f"specrt {engine.method}"
    for i, ids in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=not progress)):
        outputs, stats = engine.generate([Request(prompt_ids=ids, params=params, id=i)])
        res.add([outputs[0].output_ids], stats.generated_tokens, stats.decode_tokens, stats.prefill_s,
                stats.decode_s, stats)
    return res


def pooled(results: list[MethodResult]) -> MethodResult:
    """One method's results over several prompt sets as one (token and time sums, rounds concatenated)."""
    first = results[0]
    res = MethodResult(first.method, stats=RunStats(method=first.method) if first.stats is not None else None)
    for r in results:
        res.add(r.outputs, r.generated_tokens, r.decode_tokens, r.prefill_s, r.decode_s, r.stats)
    return res


def plot_report(report: dict, path: str | Path) -> Path:
    """Per-position conditional acceptance per method (pooled over the prompt sets) and τ per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in report["pooled"] if "per_position_acceptance" in r]
    if not spec:
        raise SpecrtError("--plot needs at least one speculative method (mtp or dspark) in --methods")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    right.legend()
    fig.suptitle(f"greedy, batch 1, {report['max_new_tokens']} new tokens", fontsize=9)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write as PNG (folders made) and close a matplotlib figure; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def parse_baselines(values: Iterable[str]) -> list[str]:
    """`--baseline` values (repeated and/or comma-separated) -> the baselines to run, in order, `none` dropped."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    bad = [n for n in names if n not in ("none", *BASELINES)]
    if bad:
        raise SpecrtError(f"--baseline: unknown baseline {bad[0]!r}; choose from none, {', '.join(BASELINES)}")
    if "none" in names and len(set(names)) > 1:
        raise SpecrtError("--baseline none cannot be combined with another baseline")
    return list(dict.fromkeys(n for n in names if n != "none"))


def load_baselines(names: list[str], source: Path, *, threads: int | None = None, n_ctx: int = 2048,
                   device: str = "cpu", dtype: str | None = None) -> dict[str, Callable]:
    """Load each named baseline on the artifact's source model: {name: generate(ids, max_new, eos)}; hf on
    `device` in `dtype` (default float32)."""
    loaders = {"hf": lambda: hf_baseline(source, threads=threads, device=device, dtype=dtype),
               "llama.cpp": lambda: llama_cpp_baseline(source, threads=threads, n_ctx=n_ctx)}
    return {name: loaders[name]() for name in names}


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


def hf_baseline(source: Path, threads: int | None = None, device: str = "cpu", dtype: str | None = None
                ) -> Callable:
    """Load the artifact's source model with transformers; returns generate(ids, max_new, eos) -> (ids, t_prefill, t_total).

    t_total is a full generate(); t_prefill a 1-token generate() (prompt + first token) on the same prompt."""
    import torch

    model = load_hf_model(source, threads).to(device, getattr(torch, dtype or "float32"))
    done = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float, float]:
        x = torch.tensor([ids], device=model.device)
        kw = dict(do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                  attention_mask=torch.ones_like(x))
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        done()
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new_tokens, **kw)
        done()
        t2 = time.perf_counter()
        return out[0, len(ids):].tolist(), t1 - t0, t2 - t1

    return generate


def require_llama_cpp() -> ModuleType:
    """The llama_cpp module, or a one-line SpecrtError saying how to install the optional extra."""
    try:
        import llama_cpp
    except ModuleNotFoundError as e:
        if e.name not in ("llama_cpp", None):
            raise SpecrtError(f"--baseline llama.cpp: llama-cpp-python cannot be imported: {e}") from None
        raise SpecrtError(f"--baseline llama.cpp needs llama-cpp-python: {LLAMA_CPP_INSTALL}") from None
    except (ImportError, OSError) as e:  # e.g. the compiled libllama is missing or was built for another CPU
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecrtError(f"--baseline llama.cpp: llama-cpp-python cannot be loaded: {line}") from None
    return llama_cpp


def llama_cpp_baseline(source: Path, threads: int | None = None, n_ctx: int = 2048) -> Callable:
    """Load the artifact's source GGUF with llama-cpp-python; returns generate(ids, max_new, eos) like hf_baseline's.

    Greedy from the given token ids (never re-tokenized); t_prefill: prompt + first token, t_total: the whole run."""
    llama_cpp = require_llama_cpp()
    if source.suffix != ".gguf":
        raise SpecrtError(f"--baseline llama.cpp runs GGUF models; the artifact's source is {source}")
    n = threads or max(1, len(os.sched_getaffinity(0)))  # ONNX Runtime's default intra-op threads too
    try:
        llm = llama_cpp.Llama(model_path=str(source), n_threads=n, n_threads_batch=n, n_ctx=n_ctx,
                              n_batch=min(n_ctx, 512), logits_all=False, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise SpecrtError(f"llama.cpp cannot load {source}: {e}") from None

    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float, float]:
        stop, out = set(eos), []
        llm.reset()  # a fresh context per prompt: no KV prefix reuse from the previous prompt
        # temp 0: llama.cpp's greedy sampler (argmax); neutral penalties make its penalties sampler a no-op
        tokens = llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, frequency_penalty=0.0,
                              presence_penalty=0.0, reset=False)
        t0 = time.perf_counter()
        t_first = None
        for token in tokens:
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(token))
            if token in stop or len(out) >= max_new_tokens:  # like specrt: the EOS that ends a request is kept
                break
        t_end = time.perf_counter()
        tokens.close()
        return out, (t_first or t_end) - t0, t_end - t0

    return generate


def run_baseline(method: str, generate: Callable, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                 progress: bool = True) -> MethodResult:
    """Batch-1 runs of a baseline's generate(); decode time is its total minus its prefill (prompt + first token)."""
    res = MethodResult(method)
    desc = {"hf": "transformers"}.get(method, method)
    for ids in tqdm(prompts, desc=desc, unit="prompt", disable=not progress):
        out, t_prefill, t_total = generate(ids, max_new_tokens, eos)
        res.outputs.append(out)
        res.generated_tokens += len(out)
        res.decode_tokens += len(out) - 1
        res.prefill_s += t_prefill
        res.decode_s += max(t_total - t_prefill, 1e-9)
    return res


def run_hf(generate: Callable, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
           progress: bool = True) -> MethodResult:
    """transformers generate() (see hf_baseline), one prompt at a time."""
    return run_baseline("hf", generate, prompts, max_new_tokens, eos, progress)


def run_llama_cpp(generate: Callable, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                  progress: bool = True) -> MethodResult:
    """llama.cpp greedy generation (see llama_cpp_baseline), one prompt at a time."""
    return run_baseline("llama.cpp", generate, prompts, max_new_tokens, eos, progress)


def artifact_source(engine: Engine) -> Path:
    """The source model the artifact was exported from (a GGUF file or a Hugging Face directory)."""
    sources = engine.manifest.sources
    if not sources:
        raise SpecrtError("the artifact records no source model, so no --baseline can be loaded")
    path = Path(sources[0].path)
    if path.name in ("config.json",) or path.suffix == ".safetensors" or path.name.endswith(".json"):
        path = path.parent
    if not path.exists():
        raise SpecrtError(f"the artifact's source model {path} no longer exists (needed for --baseline)")
    return path
