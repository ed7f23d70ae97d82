"""`specrt parity`: an artifact's target against transformers' fp32 model of the same source, per prompt.

For each prompt both decode greedily on their own (first divergence = the first generated token where
they differ), then the reference sequence (prompt + transformers' output) is run teacher-forced through
both, and the logits of every generated position are compared (max |Δlogit|, and the first position
whose argmax differs under identical inputs). A quantized artifact (--weights gguf/int4/int8) is
measured against the fp32 dequantization transformers makes of the same GGUF.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specrt import artifact as io
from specrt.runtime.backends import infer
from specrt.tools.bench import load_hf_model
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class PromptParity:
    prompt_tokens: int
    generated: int  # transformers' greedy tokens
    first_divergence: int | None  # index of the first generated token that differs (None: identical)
    teacher_forced_argmax_divergence: int | None  # first position whose argmax differs on identical inputs
    max_abs_logit_diff: float  # over the generated positions, teacher-forced


def _specrt_logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits [len(ids), V] of the artifact's target, a prefill chunk at a time (slot 0)."""
    runner = engine.target
    c = runner.spec.bucket("prefill")["T"]
    runner.allocate(max(runner.slots, 1))
    out = np.empty((len(ids), engine.vocab_size), np.float32)
    for start in range(0, len(ids), c):
        n = min(c, len(ids) - start)
        feeds = {io.INPUT_IDS: np.asarray([ids[start:start + n]], np.int64),
                 io.POSITION_IDS: np.arange(start, start + n, dtype=np.int64)[None],
                 io.WRITE_INDEX: np.array([start], np.int64),
                 io.TOKEN_ROWS: np.arange(n, dtype=np.int64), io.LOGIT_ROWS: np.arange(n, dtype=np.int64)}
        out[start:start + n] = infer(runner, 0, feeds)[io.LOGITS]
    return out


def parity(engine: Engine, prompts: list[list[int]], *, max_new_tokens: int, source: Path,
           threads: int | None = None, progress: bool = True) -> dict:
    """Per-prompt parity of `engine`'s artifact (method ar) with transformers on `source`, and a summary."""
    import torch

    model = load_hf_model(source, threads)
    eos = sorted(engine.eos_ids)
    rows: list[PromptParity] = []
    for ids in tqdm(prompts, desc="parity", unit="prompt", disable=not progress):
        x = torch.tensor([ids])
        with torch.inference_mode():
            ref = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                                 pad_token_id=eos[0] if eos else 0, attention_mask=torch.ones_like(x))[0, len(ids):]
            ref = ref.tolist()
            seq = ids + ref
            hf_logits = model(torch.tensor([seq])).logits[0].float().numpy()
        own, _ = engine.generate([Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new_tokens))])
        got = own[0].output_ids
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if first is None and len(got) != len(ref):
            first = min(len(got), len(ref))
        mine = _specrt_logits(engine, seq)
        span = slice(len(ids) - 1, len(seq) - 1)  # rows that predict the generated tokens
        diff = float(np.abs(mine[span] - hf_logits[span]).max()) if ref else 0.0
        flips = np.flatnonzero(mine[span].argmax(-1) != hf_logits[span].argmax(-1))
        rows.append(PromptParity(prompt_tokens=len(ids), generated=len(ref), first_divergence=first,
                                 teacher_forced_argmax_divergence=int(flips[0]) if flips.size else None,
                                 max_abs_logit_diff=round(diff, 6)))
    identical = sum(r.first_divergence is None for r in rows)
    diverged = [r.first_divergence for r in rows if r.first_divergence is not None]
    return {"weights": getattr(engine.manifest.export, "weights", "float"), "prompts": len(rows), "identical": identical,
            "first_divergence_min": min(diverged) if diverged else None,
            "first_divergence_mean": round(float(np.mean(diverged)), 1) if diverged else None,
            "max_abs_logit_diff": max((r.max_abs_logit_diff for r in rows), default=0.0),
            "mean_max_abs_logit_diff": round(float(np.mean([r.max_abs_logit_diff for r in rows])), 6) if rows else 0.0,
            "per_prompt": [asdict(r) for r in rows]}
