"""Loss pieces of the draft-head trainers (reference/deepspec-dspark.md §3): anchors, masks, weights, L1, BCE target.

DSpark, per (anchor j, slot k) with w = eval_mask · exp(-k/4), sums over every row of a step:
    loss = (0.1·Σw·CE + 0.9·Σw·‖p_d − p_t‖₁ + 1.0·Σw·BCE(conf, acc*)) / Σw,   acc* = clamp(1 − ½‖p_d − p_t‖₁, 0, 1)
With objective "greedy" (a head served to T=0 decoding, which accepts a draft iff it is the target's argmax):
    loss = (1.0·Σw·CE(·, argmax p_t) + 0.5·Σw·‖p_d − p_t‖₁ + 1.0·Σw·BCE(conf, acc*)) / Σw,
    acc* = [argmax p_d == argmax p_t]
MTP, per response row: loss = mean(CE + KL(p_t ‖ p_mtp)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

CE_ALPHA, L1_ALPHA, CONF_ALPHA = 0.1, 0.9, 1.0  # DeepSpec's DSpark training config
# "sampled": DeepSpec's loss, for T=1 rejection sampling; "greedy": for T=0 verification (what greedy serving runs)
OBJECTIVES = ("sampled", "greedy")
GREEDY_CE_ALPHA, GREEDY_L1_ALPHA = 1.0, 0.5  # the argmax is what is accepted; the L1 keeps the rest of p_t near
DECAY_GAMMA = 4.0  # position weight exp(-k / 4), k = 0..block-1
# torch's CPU exp takes a ~10x slower path where e^x underflows fp32 (x < -87.3); e^-87 = 1.6e-38 changes no sum here
EXP_FLOOR = -87.0


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions i with loss_mask[i] and loss_mask[i+1]: an anchor is a response token followed by one."""
    m = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(anchors [n], keep [n]): up to n candidates, uniform without replacement, sorted; padding: anchor 0, keep False."""
    cand = anchor_candidates(loss_mask)
    take = np.sort(rng.choice(cand, size=min(n, len(cand)), replace=False)) if len(cand) else cand
    anchors = np.zeros(n, np.int64)
    anchors[:len(take)] = take
    return anchors, np.arange(n) < len(take)


def block_eval_mask(anchors: np.ndarray, keep: np.ndarray, loss_mask: np.ndarray, block: int) -> np.ndarray:
    """Bool [N, K]: slot k of anchor j counts iff its label anchor+k+1 exists and is a loss token (contiguous prefix)."""
    lm = np.asarray(loss_mask, dtype=bool)
    idx = anchors[:, None] + np.arange(block)[None, :] + 1
    ok = (idx < len(lm)) & lm[np.minimum(idx, len(lm) - 1)] & keep[:, None]
    return np.cumprod(ok, axis=1).astype(bool)


def position_weights(block: int, gamma: float = DECAY_GAMMA) -> Tensor:
    """exp(-k / gamma) for k = 0..block-1 (DeepSpec's loss_decay_gamma = 4)."""
    return torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)


def l1_distance(logp_draft: Tensor, p_target: Tensor) -> Tensor:
    """‖softmax(draft) − p_t‖₁ per row (the full L1 = 2·TV, not halved); the plain form of `SoftCE_L1`'s L1."""
    return (logp_draft.exp() - p_target).abs().sum(-1)


def acceptance_target(l1: Tensor) -> Tensor:
    """acc* = clamp(1 − ½·L1, 0, 1), detached: the probability that a T=1 draft token is accepted."""
    return (1 - 0.5 * l1.detach()).clamp(0, 1)


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise ⟨a, b⟩ of [R,V] tensors without an [R,V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class SoftCE_L1(torch.autograd.Function):
    """Per row: (CE(logits, label), ‖softmax(logits) − p_t‖₁) in a few passes over V, with the analytic gradient
    dz = g_ce·(p − onehot) + g_l1·p⊙(s − ⟨p, s⟩), s = sign(p − p_t). Same values as `log_softmax` + `l1_distance`;
    it exists because at V = 49k these elementwise passes cost as much as the head's matmuls on a CPU."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, p_target: Tensor) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(logits, dim=-1)
        ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        p = logp.clamp_(min=EXP_FLOOR).exp_()  # the buffers are reused in place from here on
        diff = p - p_target
        l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)
        ctx.save_for_backward(p, diff.sign_(), labels)
        return ce, l1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ce: Tensor, g_l1: Tensor) -> tuple[Tensor, None, None]:
        p, sign, labels = ctx.saved_tensors
        g_ce, g_l1 = g_ce.unsqueeze(-1), g_l1.unsqueeze(-1)
        dot = row_dot(p, sign).unsqueeze(-1)  # ⟨p, s⟩
        grad = sign.mul_(g_l1).add_(g_ce - g_l1 * dot).mul_(p)  # p⊙(g_l1·s − g_l1·⟨p,s⟩ + g_ce)
        return grad.scatter_add_(-1, labels.unsqueeze(-1), -g_ce), None, None


class SoftCE_KL(torch.autograd.Function):
    """Per row: (CE(logits, label), KL(p_t ‖ softmax(logits)), ‖p − p_t‖₁) with dz = g_ce·(p − onehot) + g_kl·(p − p_t);
    the L1 (for acc*) carries no gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, logp_target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logp = torch.log_softmax(logits, dim=-1)
        p_t = logp_target.clamp(min=EXP_FLOOR).exp_()
        ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        kl = row_dot(p_t, logp_target) - row_dot(p_t, logp)
        p = logp.clamp_(min=EXP_FLOOR).exp_()
        l1 = torch.linalg.vector_norm(p - p_t, ord=1, dim=-1)
        ctx.mark_non_differentiable(l1)
        ctx.save_for_backward(p, p_t, labels)
        return ce, kl, l1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ce: Tensor, g_kl: Tensor, _: Tensor) -> tuple[Tensor, None, None]:
        p, p_t, labels = ctx.saved_tensors
        g_ce, g_kl = g_ce.unsqueeze(-1), g_kl.unsqueeze(-1)
        grad = p.mul_(g_ce + g_kl).sub_(p_t.mul_(g_kl))  # (g_ce + g_kl)·p − g_kl·p_t
        return grad.scatter_add_(-1, labels.unsqueeze(-1), -g_ce), None, None


@dataclass
class LossParts:
    """A step's loss and its pieces (weighted means); `acc` holds acc* per row, detached."""

    total: Tensor
    ce: Tensor
    dist: Tensor  # DSpark: L1; MTP: KL
    conf: Tensor | None
    acc: Tensor

    def scalars(self) -> dict[str, float]:
        out = {"loss": self.total.item(), "ce": self.ce.item(), "dist": self.dist.item()}
        return out | ({"conf": self.conf.item()} if self.conf is not None else {})


def dspark_loss(logits: Tensor, labels: Tensor, p_target: Tensor, conf_logits: Tensor | None,
                weights: Tensor, objective: str = "sampled") -> LossParts:
    """DSpark's loss over rows [R]: Markov-corrected logits [R,V], labels [R], p_t [R,V], weights [R].

    "sampled" is DeepSpec's. "greedy" trains the draft on the target's argmax (the only token T=0 verification
    accepts; it differs from the label where the response was sampled), and the confidence head on whether the
    draft's argmax is that token."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    greedy = objective == "greedy"
    if greedy:
        labels = p_target.argmax(-1)
    ce, l1 = SoftCE_L1.apply(logits.float(), labels, p_target)
    acc = (logits.argmax(-1) == labels).float() if greedy else acceptance_target(l1)
    ce_alpha, l1_alpha = (GREEDY_CE_ALPHA, GREEDY_L1_ALPHA) if greedy else (CE_ALPHA, L1_ALPHA)
    norm = weights.sum().clamp(min=1e-8)
    ce_m, l1_m = (weights * ce).sum() / norm, (weights * l1).sum() / norm
    total = ce_alpha * ce_m + l1_alpha * l1_m
    conf_m = None
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), acc, reduction="none")
        conf_m = (weights * bce).sum() / norm
        total = total + CONF_ALPHA * conf_m
    return LossParts(total, ce_m, l1_m, conf_m, acc)


def mtp_loss(logits: Tensor, labels: Tensor, logp_target: Tensor) -> LossParts:
    """Mean over rows of CE(logits, label) + KL(p_t ‖ p_mtp); acc = 1 − TV(p_mtp, p_t) per row."""
    ce, kl, l1 = SoftCE_KL.apply(logits.float(), labels, logp_target)
    return LossParts(ce.mean() + kl.mean(), ce.mean(), kl.mean(), None, acceptance_target(l1))


def tau_probabilistic(acc: Tensor, valid: Tensor) -> Tensor:
    """DeepSpec's teacher-forced τ per block: 1 + Σ_k Π_{i≤k} acc*_i over the valid prefix; acc/valid [N,K]."""
    return 1 + torch.cumprod(acc * valid, dim=-1).sum(-1)


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """LR multiplier: linear warmup over the first `warmup` fraction of steps, then cosine to 0."""
    n_warm = max(1, round(warmup * total))
    if step < n_warm:
        return (step + 1) / n_warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - n_warm) / max(1, total - n_warm))))
