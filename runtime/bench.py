"""`specrt bench`: specrt and baselines on the same model and prompts, side by side in one run."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.runtime.engine import Engine, Request, RunStats
from specrt.runtime.sampling import SamplingParams


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
        return row


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
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def hf_baseline(source: Path, threads: int | None = None) -> Callable:
    """Load the artifact's source model with transformers; returns generate(ids, max_new, eos) -> (ids, t_prefill, t_total)."""
    import torch
    import transformers as tf

    if threads:
        torch.set_num_threads(threads)
    if source.suffix == ".gguf":
        model = tf.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()

    @torch.inference_mode()
    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float, float]:
        x = torch.tensor([ids])
        kw = dict(do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                  attention_mask=torch.ones_like(x))
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new_tokens, **kw)
        t2 = time.perf_counter()
        return out[0, len(ids):].tolist(), t1 - t0, t2 - t1

    return generate


def run_hf(generate: Callable, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
           progress: bool = True) -> MethodResult:
    res = MethodResult("hf")
    for ids in tqdm(prompts, desc="transformers", unit="prompt", disable=not progress):
        out, t_prefill, t_total = generate(ids, max_new_tokens, eos)
        res.outputs.append(out)
        res.generated_tokens += len(out)
        res.decode_tokens += len(out) - 1
        # decode time = the full generate minus a 1-token generate (prefill + first token) on the same prompt
        res.prefill_s += t_prefill
        res.decode_s += max(t_total - t_prefill, 1e-9)
    return res


def artifact_source(engine: Engine) -> Path:
    sources = engine.manifest.sources
    if not sources:
        raise SpecrtError("the artifact records no source model, so no transformers baseline can be loaded")
    path = Path(sources[0].path)
    if path.name in ("config.json",) or path.suffix == ".safetensors" or path.name.endswith(".json"):
        path = path.parent
    if not path.exists():
        raise SpecrtError(f"the artifact's source model {path} no longer exists (needed for --baseline hf)")
    return path
