"""DeepSpec DSpark / DFlash draft checkpoints: config.json + model.safetensors -> config + float32 weights.

The draft config is a copy of the target's HF config with `architectures: ["Qwen3DSparkModel"]` (or
`"LlamaDSparkModel"` for a Llama-family target) plus the DSpark keys; tensor names have no `model.`
prefix (reference/deepspec-dspark.md §1.2, §4). DFlash checkpoints are the same without the Markov
and confidence keys and tensors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import DSparkConfig, ModelConfig
from specrt.exporter.loaders import LoadedTarget, load_target
from specrt.exporter.loaders.hf import _open, _read_json, config_problem, weight_files

# DeepSpec `architectures[0]` -> the HF CausalLM whose decoder layers the draft uses.
_FAMILY_ARCH = {"qwen3": "Qwen3DSparkModel", "llama": "LlamaDSparkModel"}
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def expected_dspark_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSpec checkpoint of `cfg` holds, name -> shape (§1.2; no `model.` prefix)."""
    lc = cfg.layers
    d, hd, ff, v, r = lc.hidden_size, lc.head_dim, lc.intermediate_size, lc.vocab_size, cfg.markov_rank
    q, kv = lc.num_heads * hd, lc.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
                                          "fc.weight": (d, cfg.feature_dim), "hidden_norm.weight": (d,)}
    for i in range(lc.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                       p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if lc.attention_bias:  # q/k/v bias; o too where the family has one (ModelConfig.o_proj_bias)
            shapes.update({p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))})
        if lc.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if lc.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if r:
        shapes.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
        if cfg.markov_head_type == "gated":
            shapes.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
        elif cfg.markov_head_type == "rnn":
            shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d),
                           "markov_head.joint_proj.bias": (3 * r,)})
    if cfg.enable_confidence_head:
        shapes.update({"confidence_head.proj.weight": (1, d + (r if cfg.confidence_head_with_markov else 0)),
                       "confidence_head.proj.bias": (1,)})
    return shapes


SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")  # frozen copies of the target's in DeepSpec


@dataclass
class LoadedDSpark:
    """A loaded draft head: config, float32 weights under DeepSpec names, provenance."""

    config: DSparkConfig
    weights: dict[str, np.ndarray]
    source_files: list[Path] = field(default_factory=list)
    shared: tuple[str, ...] = ()  # of SHARED_WITH_TARGET: absent from the checkpoint, the target's tensors are used

    def with_target(self, target_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The full DeepSpec weight dict: the shared tensors filled in from the target's weights."""
        embed = target_weights["model.embed_tokens.weight"]
        fill = {"embed_tokens.weight": embed, "lm_head.weight": target_weights.get("lm_head.weight", embed)}
        return {**self.weights, **{n: fill[n] for n in self.shared}}


def load_dspark(path: str | Path, target: ModelConfig) -> LoadedDSpark:
    """Load and validate a DeepSpec DSpark/DFlash checkpoint directory against `target`."""
    ckpt = Path(path).expanduser()
    if not ckpt.is_dir():
        raise SpecrtError(f"draft checkpoint not found: {ckpt} (expected a DeepSpec checkpoint directory)")
    config_path = ckpt / CONFIG_FILE
    if not config_path.is_file():
        raise SpecrtError(f"{ckpt}: no {CONFIG_FILE} (not a DeepSpec checkpoint directory)")
    hf = _read_json(config_path)
    try:
        cfg = DSparkConfig.from_hf(hf)
        cfg.check_target(target)
    except SpecrtError as e:
        raise SpecrtError(f"{config_path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise SpecrtError(f"{config_path}: {config_problem(e, hf)}") from None
    files, index_files = weight_files(ckpt)
    wanted, located = expected_dspark_shapes(cfg), {}
    for f in files:
        with _open(f) as st:
            for key in st.keys():
                located[key] = (f, tuple(st.get_slice(key).get_shape()))
    # specrt's compact layout leaves out embed_tokens / lm_head: they are then the target's own (frozen in training)
    shared = [n for n in SHARED_WITH_TARGET if n not in located]
    for name, want in wanted.items():
        if name in shared:
            continue
        if name not in located:
            raise SpecrtError(f"{ckpt}: missing tensor {name} (expected shape {list(want)})")
        if located[name][1] != want:
            raise SpecrtError(f"{ckpt}: tensor {name} has shape {list(located[name][1])}, expected {list(want)}")
    extra = sorted(set(located) - set(wanted))
    if extra:  # e.g. Markov tensors in a checkpoint whose config says markov_rank 0
        raise SpecrtError(f"{ckpt}: unexpected tensors {extra[:4]} for config markov_rank={cfg.markov_rank}, "
                          f"markov_head_type={cfg.markov_head_type!r}, confidence={cfg.enable_confidence_head}")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        with _open(f) as st:
            for name in (n for n in wanted if n not in shared and located[n][0] == f):
                try:
                    weights[name] = st.get_tensor(name).float().numpy()  # bf16 / fp16 / fp32 -> fp32
                except Exception as e:  # safetensors raises plain errors on bad data offsets
                    raise SpecrtError(f"{f} is corrupt or truncated: {e}") from None
    return LoadedDSpark(config=cfg, weights=weights, source_files=[config_path, *index_files, *files],
                        shared=tuple(shared))


def save_deepspec_checkpoint(out_dir: str | Path, config_dict: dict[str, Any], weights: dict[str, Any], *,
                             dtype: str | None = None) -> Path:
    """Write config.json + model.safetensors exactly as DeepSpec's trainer does (single file, plain names).

    `weights` holds numpy arrays or torch tensors; `dtype` ("bfloat16", "float32", ...) casts them all.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, w in weights.items():
        t = torch.from_numpy(np.ascontiguousarray(w)) if isinstance(w, np.ndarray) else w.detach()
        t = (t.to(getattr(torch, dtype)) if dtype else t).contiguous()
        # DeepSpec stores separate embed/lm_head copies even when a tied target makes them equal
        tensors[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    (out / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def _hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A HF config.json dict for `cfg` (used when only a ModelConfig is at hand)."""
    return cfg.to_hf()


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Up to 3 feature layers spread over 1..n-2 (the last layer is excluded), DeepSpec style."""
    n = num_target_layers
    if n <= 4:
        return tuple(range(-1, n - 1))[-3:]
    return tuple(sorted({1 + round(i * (n - 3) / 2) for i in range(3)}))


def random_dspark_checkpoint(out_dir: str | Path, target_dir_or_cfg: str | Path | LoadedTarget | ModelConfig, *,
                             layers: int = 1, block_size: int = 4, target_layer_ids: tuple[int, ...] | None = None,
                             markov_rank: int = 16, head_type: str = "vanilla", confidence: bool = True,
                             mask_token_id: int | None = None, init_std: float = 0.02, seed: int = 0,
                             dtype: str = "float32") -> Path:
    """Write a random-init DeepSpec checkpoint for a (tiny) target; embed/lm_head are the target's own.

    `markov_rank=0, confidence=False` gives a DFlash checkpoint. Linear/Embedding weights ~ N(0, init_std);
    norm weights and biases are perturbed around 1 and 0 so every code path is exercised.
    """
    target_w: dict[str, np.ndarray] = {}
    if isinstance(target_dir_or_cfg, (str, Path)):  # HF dir (its config.json is copied), GGUF file or preset
        loaded = load_target(target_dir_or_cfg)
        tcfg, target_w = loaded.config, loaded.weights
        hf_path = Path(target_dir_or_cfg) / CONFIG_FILE
        hf = _read_json(hf_path) if hf_path.is_file() else _hf_config(tcfg)
    elif isinstance(target_dir_or_cfg, LoadedTarget):
        tcfg, target_w = target_dir_or_cfg.config, target_dir_or_cfg.weights
        hf = _hf_config(tcfg)
    else:
        tcfg, hf = target_dir_or_cfg, _hf_config(target_dir_or_cfg)
    if tcfg.family not in _FAMILY_ARCH:
        raise SpecrtError(f"no DSpark draft layout for a {tcfg.family} target; supported: {', '.join(_FAMILY_ARCH)}")
    hf = dict(hf, architectures=[_FAMILY_ARCH[tcfg.family]], num_target_layers=tcfg.num_layers,
              num_hidden_layers=layers, layer_types=["full_attention"] * layers, block_size=block_size,
              tie_word_embeddings=False, num_anchors=512, markov_rank=markov_rank, enable_confidence_head=confidence,
              mask_token_id=tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
              target_layer_ids=list(target_layer_ids or default_layer_ids(tcfg.num_layers)))
    if markov_rank:
        hf["markov_head_type"] = head_type
    if confidence:
        hf["confidence_head_with_markov"] = markov_rank > 0
    cfg = DSparkConfig.from_hf(hf)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_dspark_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * rng.standard_normal(shape)
        else:
            weights[name] = init_std * rng.standard_normal(shape)
    if "model.embed_tokens.weight" in target_w:
        weights["embed_tokens.weight"] = target_w["model.embed_tokens.weight"]
        weights["lm_head.weight"] = target_w.get("lm_head.weight", target_w["model.embed_tokens.weight"])
    weights = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    hf["dtype"] = dtype
    return save_deepspec_checkpoint(out_dir, hf, weights, dtype=dtype)
