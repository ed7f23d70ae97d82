"""The draft sampling rule in torch: the reference the draft graphs' in-graph sampling is tested against."""
from __future__ import annotations

import torch
from torch import Tensor


def sample_draft(logits: Tensor, temperature: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """(token [...] i64, probs [..., V] f32) for logits [..., V], temperature [...] and uniform noise [...].

    T = temperature if > 0 else 1; probs = softmax(logits / T); token = min(#(cdf <= noise * cdf[-1]), V-1)
    if temperature > 0, else the first argmax (the rule of specrt/artifact.py, as exporter/onnx/sampling.py).
    """
    lf, hot = logits.float(), temperature > 0
    t = torch.where(hot, temperature, torch.ones_like(temperature)).float().unsqueeze(-1)
    probs = torch.softmax(lf / t, dim=-1)
    cdf = probs.cumsum(-1)
    sampled = (cdf <= noise.float().unsqueeze(-1) * cdf[..., -1:]).sum(-1).clamp(max=lf.shape[-1] - 1)
    return torch.where(hot, sampled, lf.argmax(-1)), probs
