"""Target loaders: a Hugging Face directory or a GGUF file -> config + float32 HF-named weights."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig

if TYPE_CHECKING:
    from specrt.exporter.loaders.tokenizer import TokenizerSource

__all__ = ["LoadedTarget", "LazyWeights", "load_target", "expected_shapes", "check_weights"]


class LazyWeights(Mapping):
    """Weights made when first read and kept: a GGUF's tensors dequantized to float32 only where something asks for
    them (an export that keeps the file's blocks reads the embedding and the head; training reads all). Iterating
    or `dict(...)` makes every one."""

    def __init__(self, makers: dict[str, "Callable[[], np.ndarray]"]) -> None:
        self._makers, self._made = makers, {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __iter__(self) -> "Iterator[str]":
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class LoadedTarget:
    """A loaded target model: config, float32 weights under Hugging Face names, provenance."""

    name: str
    config: ModelConfig
    weights: Mapping[str, np.ndarray]  # a dict, or for a GGUF a LazyWeights
    source_files: list[Path] = field(default_factory=list)
    tokenizer: "TokenizerSource | None" = None
    # a GGUF's own blocks: HF name -> specrt.blocks.Blocks (Q4_0/Q4_1/Q8_0) or GGUFRows (the other types specrt's
    # kernels read); None: not a GGUF
    blocks: dict | None = None
    tensor_types: dict[str, str] = field(default_factory=dict)  # a GGUF's: HF name -> its GGUF type (Q4_K, F16, ...)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a target of `cfg` must have, HF name -> HF-layout shape ([out, in])."""
    d, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d),
                                          "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def check_weights(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str | Path) -> None:
    """Raise SpecrtError unless `shapes` (name -> found shape) holds every expected tensor."""
    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            raise SpecrtError(f"{source}: missing tensor {name} (expected shape {list(want)})")
        if tuple(shapes[name]) != want:
            raise SpecrtError(f"{source}: tensor {name} has shape {list(shapes[name])}, "
                              f"expected {list(want)}")


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_target(source: str | Path) -> LoadedTarget:
    """Load a target from a HF directory, a .gguf file, or a preset name (e.g. "smollm2")."""
    path = Path(source).expanduser()
    try:
        return _load(source, path)
    except OSError as e:  # unreadable files or directories (permissions, I/O errors)
        raise SpecrtError(f"cannot read {e.filename or path}: {e.strerror or e}") from None


def _load(source: str | Path, path: Path) -> LoadedTarget:
    if not path.exists():
        from specrt.configs.fetch import PRESETS

        if isinstance(source, str) and source in PRESETS:
            path = PRESETS[source]()
        else:
            raise SpecrtError(f"model path not found: {source} (expected a Hugging Face model "
                              f"directory, a .gguf file, or a preset: {', '.join(PRESETS)})")
    if path.is_dir():
        from specrt.exporter.loaders.hf import load_hf_dir

        os.listdir(path)  # an unreadable directory fails here, named as such
        return load_hf_dir(path)
    if _is_gguf(path):
        from specrt.exporter.loaders.gguf import load_gguf

        return load_gguf(path)
    raise SpecrtError(f"{path}: not a model directory or GGUF file")
