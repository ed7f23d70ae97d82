"""specrt::ConfidenceTruncate for TensorRT: an OpenAI-Triton kernel, and its TensorRT plugin (Quick Deployable
Plugin, `tensorrt.plugin`) compiled ahead of time, so an engine runs it without Python.

The kernel follows plugins/confidence_truncate.py (the reference): one program per batch row computes every
row's survival as exp(cumsum(log sigmoid(logit / T))) in one [B, G] tile (B <= 64, G <= 64: a few KB), writes
its own row, and its verify length; in budget mode it ranks its row's pairs against the whole tile (the same
arithmetic in every program, so ties resolve identically everywhere).

Parameter order is what TensorRT's AOT plugins expect: input pointers, then extra scalars, then output pointers.
    inputs   logits f32 [B, G], temperatures f32 [G], threshold f32 [], budget i64 []
    scalars  B, G (i32)
    outputs  survival f32 [B, G], lengths i64 [B]

Off a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which
is how the tests check it against the reference. `register_plugin()` needs `tensorrt` (>= 10.8, which has
`tensorrt.plugin.aot_impl`) and a CUDA device to compile for.
"""
from __future__ import annotations

import triton
import triton.language as tl

from specrt.plugins.confidence_truncate import DOMAIN, OP

PLUGIN_ID = f"{DOMAIN}::{OP}"
MAX_GAMMA = 64  # the tile: powers of two >= G and >= B, up to these
MAX_BATCH = 64


@triton.jit
def confidence_truncate_kernel(logits_ptr, temps_ptr, threshold_ptr, budget_ptr, B, G, survival_ptr, lengths_ptr,
                               BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0)
    rows = tl.arange(0, BLOCK_B)
    k = tl.arange(0, BLOCK_G)
    valid = (rows[:, None] < B) & (k[None, :] < G)
    flat = rows[:, None] * G + k[None, :]
    z = tl.load(logits_ptr + flat, mask=valid, other=0.0) / tl.load(temps_ptr + k, mask=k < G, other=1.0)[None, :]
    # log sigmoid(z) without overflow: min(z, 0) - log(1 + exp(-|z|)); every row's survival, the same arithmetic
    log_sig = tl.where(valid, tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z))), 0.0)
    surv = tl.exp(tl.cumsum(log_sig, axis=1))  # [BLOCK_B, BLOCK_G]
    mine = rows[:, None] == row
    a = tl.sum(tl.where(mine, surv, 0.0), axis=0)  # this program's row, [BLOCK_G]
    mask = k < G
    tl.store(survival_ptr + row * G + k, a, mask=mask)
    threshold = tl.load(threshold_ptr)
    budget = tl.load(budget_ptr)
    kept = tl.sum(tl.where(mask & (a >= threshold), 1, 0), axis=0)
    # budget mode: admitted when fewer than `budget` pairs are better (larger, or equal at a lower flat index)
    me = row * G + k
    better = (surv[None, :, :] > a[:, None, None]) | ((surv[None, :, :] == a[:, None, None])
                                                      & (flat[None, :, :] < me[:, None, None]))
    rank = tl.sum(tl.sum(tl.where(better & valid[None, :, :], 1, 0), axis=2), axis=1)  # [BLOCK_G]
    admitted = tl.sum(tl.where(mask & (rank < budget) & (a > 0.0), 1, 0), axis=0)
    length = tl.where(budget < 0, kept, admitted)
    tl.store(lengths_ptr + row, length.to(tl.int64))


def blocks(batch: int, gamma: int) -> dict[str, int]:
    """The kernel's tile: powers of two holding the batch and the draft positions."""
    if not 1 <= gamma <= MAX_GAMMA or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"ConfidenceTruncate supports 1..{MAX_BATCH} rows of 1..{MAX_GAMMA} draft positions, "
                         f"got {batch} x {gamma}")
    return {"BLOCK_B": triton.next_power_of_2(batch), "BLOCK_G": triton.next_power_of_2(gamma)}


def launch(logits, temperatures, threshold, budget):
    """Run the kernel on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns (survival, lengths)."""
    import torch

    b, g = logits.shape
    survival = torch.empty_like(logits)
    lengths = torch.empty(b, dtype=torch.int64, device=logits.device)
    confidence_truncate_kernel[(b,)](logits, temperatures, threshold, budget, b, g, survival, lengths,
                                     **blocks(b, g))
    return survival, lengths


def register_plugin() -> None:
    """Register specrt::ConfidenceTruncate with TensorRT (descriptor + AOT implementation). Idempotent."""
    import numpy as np
    import tensorrt.plugin as trtp

    if getattr(register_plugin, "done", False):
        return

    @trtp.register(PLUGIN_ID)
    def _desc(logits: trtp.TensorDesc, temperatures: trtp.TensorDesc, threshold: trtp.TensorDesc,
              budget: trtp.TensorDesc, plugin_namespace: str, plugin_version: str
              ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        survival = logits.like()
        lengths = trtp.from_shape_expr((logits.shape_expr[0],), dtype=np.int64)  # noqa: the documented helper
        return survival, lengths

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(logits: trtp.TensorDesc, temperatures: trtp.TensorDesc, threshold: trtp.TensorDesc,
             budget: trtp.TensorDesc, plugin_namespace: str, plugin_version: str,
             outputs: tuple[trtp.TensorDesc], tactic: int):
        batch, gamma = logits.shape_expr[0], logits.shape_expr[1]  # a dynamic batch: compiled for MAX_BATCH
        if not gamma.is_constant:
            raise ValueError("ConfidenceTruncate needs a static number of draft positions")
        src = triton.compiler.ASTSource(
            fn=confidence_truncate_kernel,
            signature={"logits_ptr": "*fp32", "temps_ptr": "*fp32", "threshold_ptr": "*fp32",
                       "budget_ptr": "*i64", "B": "i32", "G": "i32", "survival_ptr": "*fp32",
                       "lengths_ptr": "*i64", "BLOCK_B": "constexpr", "BLOCK_G": "constexpr"},
            constexprs=blocks(batch.constant_value() if batch.is_constant else MAX_BATCH, gamma.constant_value()))
        compiled = triton.compile(src)
        params = trtp.KernelLaunchParams()
        params.grid_x = logits.shape_expr[0]  # one program per batch row
        params.block_x = compiled.metadata.num_warps * 32
        params.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(logits.shape_expr[0])
        extra[1] = trtp.SymInt32(gamma)
        return compiled.metadata.name, compiled.asm["ptx"], params, extra

    register_plugin.done = True
