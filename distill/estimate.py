"""`specrt distill`'s time estimate, up front: each stage's work (tokens to generate, tokens to prefill for features,
optimizer steps) at rates timed on this machine before it starts.

    generate  at most prompts x responses x max-new-tokens tokens, at the work target's decoding step over its
              slots (a full batch: the rate continuous batching keeps while the queue is long), plus the prompts'
              prefill; responses that end early at EOS make it shorter
    features  every response's prompt and response tokens, at the work target's prefill chunk (batch 1, as
              capture runs)
    train     its optimizer steps; their rate is the progress bar's once training runs (the model is not built
              before then)

The two graph calls are timed after a warm-up call (median of three), a second or two; stages a resumed run has
already finished are estimated too (they then take no time).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.runtime import calls
from specrt.runtime.backends import load_runner


@dataclass(frozen=True)
class Estimate:
    prompts: int  # the prompts to answer, or the responses given
    prompt_tokens: int
    generate_tokens: int  # at most (0: responses given)
    feature_tokens: int
    slots: int
    step_ms: float  # a decoding step of `slots` slots
    prefill_tok_s: float
    train_steps: int

    @property
    def generate_s(self) -> float:
        if not self.generate_tokens:
            return 0.0
        return self.generate_tokens / (self.slots / (self.step_ms / 1e3)) + self.prompt_tokens / self.prefill_tok_s

    @property
    def features_s(self) -> float:
        return self.feature_tokens / self.prefill_tok_s

    def to_dict(self) -> dict:
        return {**asdict(self), "generate_s": round(self.generate_s, 3), "features_s": round(self.features_s, 3)}

    def line(self) -> str:
        parts = []
        if self.generate_tokens:
            parts.append(f"generate <= {self.generate_tokens:,} tokens ~{_minutes(self.generate_s)} (a decoding step "
                         f"of {self.slots} slots: {self.step_ms:.1f} ms)")
        parts.append(f"features {self.feature_tokens:,} tokens ~{_minutes(self.features_s)} (prefill "
                     f"{self.prefill_tok_s:.0f} tokens/s)")
        parts.append(f"train {self.train_steps} steps (its rate shows once it runs)")
        what = "prompts" if self.generate_tokens else "responses given"
        return f"estimate for {self.prompts:,} {what}, on this machine now: " + "; ".join(parts)


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def time_calls(art: str | Path, *, threads: int | None = None, repeats: int = 3, backend: str = "ort",
               device: str = "cpu") -> tuple[int, float, float]:
    """(slots, ms of a decoding step over all of them, tokens/s of a prefill chunk) of the artifact's target, timed
    now on `backend` and `device`: the median of `repeats` calls after a warm-up call each."""
    manifest = io.load_manifest(art)
    target = load_runner(backend, Path(art), manifest, io.TARGET, threads=threads, spin=True,
                         **({"device": device} if backend == "torch" else {}))
    b = manifest.export.batch
    target.allocate(b)
    token, position = min(100, manifest.model.vocab_size - 1), 64

    def timed(bucket: io.Bucket) -> float:
        feeds = target.inputs(0, bucket)
        t = feeds[io.INPUT_IDS].shape[1]
        calls.target.grid(feeds, np.full(b if t == 1 else 1, token), np.full(b if t == 1 else 1, position),
                          np.full((b if t == 1 else 1, t - 1), token), np.arange(len(feeds[io.TOKEN_ROWS])))
        target.run(0, bucket)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target.run(0, bucket)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    step = timed(target.spec.bucket("decode", B=b))
    chunk = target.spec.bucket("prefill")
    prefill = timed(chunk)
    return b, step * 1e3, chunk["T"] / prefill


def estimate(art: str | Path, *, prompts: int, prompt_tokens: int, generate_tokens: int, feature_tokens: int,
             train_steps: int, threads: int | None = None, backend: str = "ort", device: str = "cpu") -> Estimate:
    slots, step_ms, prefill = time_calls(art, threads=threads, backend=backend, device=device)
    return Estimate(prompts, prompt_tokens, generate_tokens, feature_tokens, slots, round(step_ms, 3),
                    round(prefill, 1), train_steps)
