"""`train_dspark`: distil a DSpark head from a TargetCache, teacher-forced as DeepSpec trains it (reference §3).

Per step, `batch_seqs` sequences each give `batch_anchors / batch_seqs` anchors (response positions whose
successor is a response token). One forward covers every anchor of a sequence at once:

    context  = hidden_norm(fc(cache features of positions < C))          [B, C, d]   K/V in every layer
    block j  = [x_anchor, M, .., M] at positions anchor_j .. anchor_j+K-1  [B, N*K, d] queries
    mask     = context s < anchor_j  |  same block (non-causal)           [B, N*K, C + N*K]
    logits   = lm_head(h) + W2·W1[prev] (prev = ground truth)  vs  p_t = softmax(lm_head(final hidden at anchor+k))

The shared training loop (`run_training`, `TrainResult`) lives here too; train_mtp.py reuses it.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.distill.cache import TargetCache
from specrt.distill.losses import (LossParts, block_eval_mask, dspark_loss, position_weights,
                                            sample_anchors, tau_probabilistic, warmup_cosine)
from specrt.exporter.loaders.deepspec import _FAMILY_ARCH, save_deepspec_checkpoint
from specrt.model_config import DSparkConfig
from specrt.models.dspark import DSparkDraft
from specrt.exporter.onnx.target import FINAL  # the feature source holding the target's final-normed hidden

STATE_FILE, LOG_FILE = "training_state.pt", "train_log.json"
EVAL_SEED = 1 << 30  # rng stream of the fixed held-out anchors, apart from the per-step streams


# -- the loop both trainers share --------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What a distillation run produced: the saved head, loss curve, held-out evaluations and τ estimates."""

    out_dir: Path
    steps: int
    history: list[dict[str, float]]  # per step: step, lr, loss, ce, dist (L1 or KL), conf, grad_norm
    evals: list[dict[str, Any]]  # step 0 (untrained head) and every eval_every steps: tau, acc per slot, loss
    config: dict[str, Any]  # hyper-parameters and decisions (mask token, splits, head dtype)
    steps_per_s: float = 0.0  # this process's training speed (resumed runs: the steps it ran)

    @property
    def tau(self) -> float:
        return self.evals[-1]["tau"]

    @property
    def tau_initial(self) -> float:
        return self.evals[0]["tau"]


def bf16_is_fast() -> bool:
    """True on CPUs with native bf16 matmuls (AVX512-BF16 / AMX), where they run about 2.5x faster than fp32."""
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def train_device(name: str) -> torch.device:
    """The device a head trains on ("cpu", "cuda[:N]"), or a one-line error when it cannot be used here."""
    from specrt.runtime.backends.torch import device_of

    return device_of(name)


def on_device(batch, device: torch.device):
    """A batch dataclass with its tensors (and tuples of tensors) on `device`."""
    if device.type == "cpu":
        return batch

    def move(x):
        return tuple(t.to(device, non_blocking=True) for t in x) if isinstance(x, tuple) else \
            x.to(device, non_blocking=True) if isinstance(x, Tensor) else x

    return replace(batch, **{f.name: move(getattr(batch, f.name)) for f in fields(batch)})


class FrozenHead:
    """The target's lm_head as the trainers use it: frozen, in bf16 where that is fast (`dtype` None: on a GPU, or
    a CPU with native bf16 matmuls), else fp32."""

    def __init__(self, weight: Tensor, dtype: torch.dtype | None = None) -> None:
        if dtype is None:
            dtype = torch.bfloat16 if weight.device.type == "cuda" or bf16_is_fast() else torch.float32
        self.weight = weight.detach() if dtype == weight.dtype else weight.detach().to(dtype)

    def __call__(self, h: Tensor, extra: Tensor | None = None, extra_weight: Tensor | None = None) -> Tensor:
        """lm_head(h) [+ extra @ extra_weight.T, e.g. the Markov bias W2·W1[prev]] in the head's dtype, as fp32."""
        dt = self.weight.dtype
        out = F.linear(h.to(dt), self.weight)
        if extra is not None:
            out = out + F.linear(extra.to(dt), extra_weight.to(dt))
        return out.float()


def frozen_param(w: np.ndarray) -> nn.Parameter:
    """A frozen parameter over the target's array (shared memory when it is a writable float32 array)."""
    a = np.asarray(w, dtype=np.float32)
    return nn.Parameter(torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else a.copy()),
                        requires_grad=False)


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """HF post_init as DeepSpec uses it: Linear / Embedding ~ N(0, std), biases 0 (RMSNorm weights stay 1)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def train_eval_split(cache: TargetCache, min_response: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample ids: splits "train" and "val" (or "valid"/"test"); else the last 5% are held out."""
    splits = cache.manifest.get("splits") or {}
    held = next((list(splits[k]) for k in ("val", "valid", "test") if splits.get(k)), None)
    other = set(held or []) | set(splits.get("calib") or [])
    train = list(splits.get("train") or [i for i in range(len(cache)) if i not in other])
    usable = {i for i, (_, n, p) in enumerate(cache.samples) if n - p >= min_response}
    train = [i for i in train if i in usable]
    if held is None:
        cut = max(1, len(train) // 20)
        train, held = train[:-cut], train[-cut:]
    held = [i for i in held if i in usable]
    if not train or not held:
        raise SpecrtError(f"target cache {cache.path}: needs training and held-out samples with >= {min_response} "
                          f"response tokens (found {len(train)} and {len(held or [])})")
    return train, held


def save_state(path: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, history: list, evals: list,
               config: dict[str, Any]) -> None:
    """The training checkpoint: step, trainable weights, optimizer state, curves and settings (atomic write)."""
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": trainable, "optimizer": opt.state_dict(), "history": history,
                "evals": evals, "config": config}, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a half checkpoint


def load_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, config: dict[str, Any]) -> dict[str, Any]:
    """Restore `save_state`'s checkpoint into model and optimizer; refuse one written with other settings."""
    state = torch.load(path, weights_only=True, map_location=next(model.parameters()).device)
    if state["config"] != config:
        diff = sorted(k for k in config.keys() | state["config"].keys() if config.get(k) != state["config"].get(k))
        raise SpecrtError(f"{path} was written with other settings ({', '.join(diff)}); "
                          "pass the same settings, or resume=False to start over")
    model.load_state_dict(state["model"], strict=False)
    opt.load_state_dict(state["optimizer"])
    return state


def run_training(model: nn.Module, step_loss: Callable[[int], LossParts], evaluate: Callable[[], dict[str, Any]],
                 save: Callable[[], None], *, out_dir: Path, config: dict[str, Any], steps: int, lr: float,
                 warmup: float, save_every: int, eval_every: int, progress: bool, resume: bool,
                 desc: str) -> TrainResult:
    """AdamW (wd 0), warmup then cosine, clip 1.0; checkpoint (with optimizer state) every `save_every` steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    state_path, start, history, evals = out_dir / STATE_FILE, 0, [], []
    if resume and state_path.is_file():
        state = load_state(state_path, model, opt, config)
        start, history, evals = state["step"], state["history"], state["evals"]
    else:
        evals.append({"step": 0, **evaluate()})  # the untrained head: the baseline τ
    t0 = time.perf_counter()
    torch.set_flush_denormal(True)  # Adam moments of rarely seen rows (Markov W1) decay into slow denormals
    try:
        with tqdm(total=steps, initial=start, desc=desc, unit="step", disable=not progress) as bar:
            for step in range(start, steps):
                scale = warmup_cosine(step, steps, warmup)
                for g in opt.param_groups:
                    g["lr"] = lr * scale
                parts = step_loss(step)
                opt.zero_grad(set_to_none=True)
                parts.total.backward()
                grad_norm = nn.utils.clip_grad_norm_(params, 1.0).item()
                opt.step()
                history.append({"step": step + 1, "lr": lr * scale, **parts.scalars(), "grad_norm": grad_norm})
                if (step + 1) % eval_every == 0 or step + 1 == steps:
                    evals.append({"step": step + 1, **evaluate()})
                if (step + 1) % save_every == 0 or step + 1 == steps:
                    save_state(state_path, step + 1, model, opt, history, evals, config)
                bar.update(1)
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", tau=f"{evals[-1]['tau']:.2f}")
    finally:
        torch.set_flush_denormal(False)
    rate = (steps - start) / max(time.perf_counter() - t0, 1e-9)
    save()
    result = TrainResult(out_dir, steps, history, evals, config, rate)
    log = {k: v for k, v in asdict(result).items() if k != "out_dir"}
    (out_dir / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    return result


# -- DSpark batches -----------------------------------------------------------------------------------------------


@dataclass
class DSparkBatch:
    """Anchors of B sequences (padded): ids [B,T], ctx features [B,C,F], final hidden [B,T,d], anchors [B,N],
    eval mask `valid` [B,N,K] (contiguous valid prefix) and labels ids[anchor+k+1] [B,N,K] (clamped)."""

    ids: Tensor
    ctx: Tensor
    final: Tensor
    anchors: Tensor
    valid: Tensor
    labels: Tensor


def make_batch(cache: TargetCache, samples: list[int], n_anchors: int, block: int, rng: np.random.Generator,
               ctx_cols: slice, final_cols: slice) -> DSparkBatch:
    """Sample anchors in each sequence and gather what the loss needs (context only up to the last anchor)."""
    seqs = [cache[i] for i in samples]
    picks = [sample_anchors(s.loss_mask, n_anchors, rng) for s in seqs]
    b, t = len(seqs), max(len(s.ids) for s in seqs)
    c = max(1, max(int(a.max()) for a, _ in picks))  # block j reads context < anchor_j
    ids = np.zeros((b, t), np.int64)
    ctx = np.zeros((b, c, ctx_cols.stop - ctx_cols.start), np.float32)
    final = np.zeros((b, t, final_cols.stop - final_cols.start), np.float32)
    valid = np.zeros((b, n_anchors, block), bool)
    for i, (s, (anchors, keep)) in enumerate(zip(seqs, picks)):
        n = len(s.ids)
        ids[i, :n] = s.ids
        ctx[i, :min(c, n)] = s.features[:min(c, n), ctx_cols]
        final[i, :n] = s.features[:, final_cols]
        valid[i] = block_eval_mask(anchors, keep, s.loss_mask, block)
    anchors = np.stack([a for a, _ in picks])
    label_pos = np.minimum(anchors[..., None] + np.arange(block) + 1, t - 1)
    labels = np.take_along_axis(ids, label_pos.reshape(b, -1), 1).reshape(label_pos.shape)
    return DSparkBatch(*(torch.from_numpy(x) for x in (ids, ctx, final, anchors, valid, labels)))


def target_probs(head: FrozenHead, final: Tensor, rows: Tensor) -> Tensor:
    """p_t = softmax(lm_head(final hidden)) at flat rows b*T + pos [R]; each distinct row is computed once."""
    uniq, inverse = torch.unique(rows, return_inverse=True)
    with torch.no_grad():
        return torch.softmax(head(final.reshape(-1, final.shape[-1])[uniq]), dim=-1)[inverse]


@dataclass
class BlockRows:
    """The valid (anchor, slot) rows of a batch: Markov-corrected logits [R,V], labels, p_t [R,V], confidence
    logits [R] (or None), slot k [R] and loss weight exp(-k/4) [R]."""

    logits: Tensor
    labels: Tensor
    p_target: Tensor
    conf: Tensor | None
    slot: Tensor
    weights: Tensor


def block_rows(model: DSparkDraft, head: FrozenHead, batch: DSparkBatch) -> BlockRows:
    """Teacher-forced forward of every anchor in the batch; only rows that carry weight reach the V-wide head."""
    k = model.config.block_size
    anchor_ids = batch.ids.gather(1, batch.anchors)
    h = model.forward_train(batch.ctx, batch.anchors, anchor_ids)  # [B,N,K,d]
    prev = torch.cat([anchor_ids.unsqueeze(-1), batch.labels[..., :-1]], -1)  # ground truth (teacher forcing)
    mk, v = model.markov_head, batch.valid
    prev_emb = mk.markov_w1(prev) if mk is not None else None
    # the Markov bias W2·W1[prev] joins the head's matmul, in the head's dtype
    logits = head(h[v]) if mk is None else head(h[v], mk.features(prev_emb, h)[v], mk.markov_w2.weight)
    conf = model.confidence_logits(h, prev_emb)[v] if model.confidence_head is not None else None
    dev = v.device
    slot = torch.arange(k, device=dev).expand_as(v)[v]
    pos = batch.anchors.unsqueeze(-1) + torch.arange(k, device=dev)
    rows = (torch.arange(v.shape[0], device=dev).view(-1, 1, 1) * batch.ids.shape[1] + pos)[v]
    return BlockRows(logits, batch.labels[v], target_probs(head, batch.final, rows), conf, slot,
                     position_weights(k).to(dev)[slot])


def block_loss(model: DSparkDraft, head: FrozenHead, batch: DSparkBatch,
               objective: str = "sampled") -> tuple[LossParts, Tensor]:
    """DSpark's loss over the batch's valid (anchor, slot) rows; also the slot index k of each row."""
    r = block_rows(model, head, batch)
    return dspark_loss(r.logits, r.labels, r.p_target, r.conf, r.weights, objective), r.slot


@torch.no_grad()
def evaluate_blocks(model: DSparkDraft, head: FrozenHead, batches: list[DSparkBatch],
                    objective: str = "sampled") -> dict[str, Any]:
    """Held-out loss, acc* per slot and DeepSpec's tau_probabilistic = mean over blocks of 1 + Σ_k Π_{i≤k} acc*_i
    (with the "greedy" objective acc* is the argmax match, so tau is what T=0 verification would accept)."""
    k, taus, losses = model.config.block_size, [], []
    acc_sum, acc_n = torch.zeros(k), torch.zeros(k)
    for batch in batches:
        parts, slot = block_loss(model, head, batch, objective)
        valid, slot, row_acc = batch.valid.cpu(), slot.cpu(), parts.acc.float().cpu()
        acc = torch.zeros(valid.shape)
        acc[valid] = row_acc
        blocks = valid[..., 0]
        taus.append(tau_probabilistic(acc, valid.float())[blocks])
        losses.append(parts.total.item())
        acc_sum += torch.zeros(k).index_add_(0, slot, row_acc)
        acc_n += torch.bincount(slot, minlength=k)
    return {"tau": torch.cat(taus).mean().item(), "loss": float(np.mean(losses)),
            "acc": (acc_sum / acc_n.clamp(min=1)).tolist()}


# -- the trainer --------------------------------------------------------------------------------------------------


def choose_mask_token(cache: TargetCache, vocab_size: int) -> int:
    """The largest id that never occurs in the cache (else the last id): a real, frozen embedding row that no
    training token collides with. DeepSpec uses a padding row (151669); most vocabularies have none to spare."""
    unused = np.flatnonzero(np.bincount(np.asarray(cache.tokens), minlength=vocab_size)[:vocab_size] == 0)
    return int(unused[-1]) if len(unused) else vocab_size - 1


def dspark_hf_config(target_cfg: ModelConfig, *, layers: int, block: int, target_layer_ids: list[int],
                     mask_token_id: int, markov_rank: int, head_type: str, confidence: bool,
                     num_anchors: int) -> dict[str, Any]:
    """The DeepSpec config.json of the head: the target's HF config plus the DSpark keys (reference §4)."""
    if target_cfg.family not in _FAMILY_ARCH:
        raise SpecrtError(f"no DSpark draft layout for a {target_cfg.family} target; "
                          f"supported: {', '.join(_FAMILY_ARCH)}")
    hf = dict(target_cfg.to_hf(), architectures=[_FAMILY_ARCH[target_cfg.family]], dtype="float32",
              num_target_layers=target_cfg.num_layers, num_hidden_layers=layers,
              layer_types=["full_attention"] * layers, block_size=block, tie_word_embeddings=False,
              num_anchors=num_anchors, markov_rank=markov_rank, enable_confidence_head=confidence,
              mask_token_id=mask_token_id, target_layer_ids=list(target_layer_ids))
    if markov_rank:
        hf["markov_head_type"] = head_type
    if confidence:
        hf["confidence_head_with_markov"] = markov_rank > 0
    return hf


def train_dspark(cache: TargetCache, target_weights: dict[str, np.ndarray], target_cfg: ModelConfig,
                 out_dir: str | Path, *, layers: int = 1, block: int = 7, markov_rank: int = 64,
                 head_type: str = "vanilla", confidence: bool = True,
                 target_layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None,
                 steps: int = 5000, batch_anchors: int = 64, batch_seqs: int = 2, lr: float = 6e-4,
                 warmup: float = 0.04, seed: int = 0, threads: int | None = None, head_dtype: str | None = None,
                 save_every: int = 200, eval_every: int | None = None, eval_anchors: int = 256,
                 progress: bool = True, resume: bool = True, objective: str = "sampled",
                 device: str = "cpu") -> TrainResult:
    """Train a DSpark head on the cache's train split; save it in DeepSpec's layout to `out_dir`.

    `objective`: "sampled" (DeepSpec's loss, for T=1 rejection sampling) or "greedy" (for T=0 verification; see
    `losses.dspark_loss`). `device`: where it trains ("cuda": batches are gathered on the host, moved per step).
    `target_layer_ids` default: every layer feature in the cache. `head_dtype` None = bf16 where the CPU has it.
    The defaults take about 55 minutes for SmolLM2-135M on 2 CPU cores (~1.5 steps/s with bf16, evals included).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = list(target_layer_ids or [f for f in cache.feature_sources if f != FINAL])
    ctx_cols, final_cols = cache.feature_slice(ids), cache.feature_slice([FINAL])
    if int(cache.manifest["hidden_size"]) != target_cfg.hidden_size:
        raise SpecrtError(f"target cache hidden size {cache.manifest['hidden_size']} does not match the target's "
                          f"{target_cfg.hidden_size}")
    mask_id = choose_mask_token(cache, target_cfg.vocab_size) if mask_token_id is None else mask_token_id
    per_seq = math.ceil(batch_anchors / batch_seqs)
    hf = dspark_hf_config(target_cfg, layers=layers, block=block, target_layer_ids=ids, mask_token_id=mask_id,
                          markov_rank=markov_rank, head_type=head_type, confidence=confidence, num_anchors=per_seq)
    cfg = DSparkConfig.from_hf(hf)
    cfg.check_target(target_cfg)
    train, held = train_eval_split(cache, min_response=2)
    dev = train_device(device)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    try:
        torch.manual_seed(seed)
        model = DSparkDraft(cfg)
        init_weights(model)
        embed = target_weights["model.embed_tokens.weight"]
        model.embed_tokens.weight = frozen_param(embed)  # frozen copies of the target's (DeepSpec §1.6)
        model.lm_head.weight = frozen_param(target_weights.get("lm_head.weight", embed))
        model.to(dev)
        head = FrozenHead(model.lm_head.weight, getattr(torch, head_dtype) if head_dtype else None)
        eval_rng = np.random.default_rng([seed, EVAL_SEED])
        held = list(eval_rng.permutation(held)[:16])
        per_eval = max(1, eval_anchors // len(held))
        eval_batches = [on_device(make_batch(cache, held[i:i + batch_seqs], per_eval, block, eval_rng, ctx_cols,
                                             final_cols), dev) for i in range(0, len(held), batch_seqs)]

        def step_loss(step: int) -> LossParts:
            rng = np.random.default_rng([seed, step])  # a function of the step alone: resuming replays exactly
            picked = list(rng.choice(train, size=min(batch_seqs, len(train)), replace=False))
            batch = on_device(make_batch(cache, picked, per_seq, block, rng, ctx_cols, final_cols), dev)
            return block_loss(model, head, batch, objective)[0]

        config = {"kind": "dspark", "layers": layers, "block": block, "markov_rank": markov_rank,
                  "head_type": head_type, "confidence": confidence, "target_layer_ids": ids,
                  "mask_token_id": mask_id, "steps": steps, "batch_anchors": batch_anchors,
                  "batch_seqs": batch_seqs, "lr": lr, "warmup": warmup, "seed": seed,
                  "head_dtype": str(head.weight.dtype).removeprefix("torch."), "train_samples": len(train),
                  "eval_samples": len(held)}
        if objective != "sampled":  # the configs of heads trained before the option stay as they were
            config["objective"] = objective
        return run_training(model, step_loss, lambda: evaluate_blocks(model, head, eval_batches, objective),
                            lambda: save_deepspec_checkpoint(out, hf, {k: v.cpu() for k, v in
                                                                       model.state_dict().items()}), out_dir=out,
                            config=config, steps=steps, lr=lr, warmup=warmup, save_every=save_every,
                            eval_every=eval_every or max(1, steps // 10), progress=progress, resume=resume,
                            desc="distill dspark")
    finally:
        torch.set_num_threads(old_threads)
