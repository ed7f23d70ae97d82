"""Draft heads in an export: load a DSpark/DFlash or MTP checkpoint, add its tensors and graphs.

A head declares which target features it consumes; the target graphs then output the union of
those features (`features[B,T,F]`), and the manifest records each head's slice of F.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrt import artifact as io
from specrt.exporter.config import ModelConfig
from specrt.exporter.onnx.builder import GraphBuilder
from specrt.exporter.onnx.target import FINAL

Builder = Callable[[GraphBuilder], None]  # emits the head's graph (named axes B/C) into the builder
Signature = tuple[tuple[io.TensorSpec, ...], tuple[io.TensorSpec, ...]]


@dataclass
class HeadPlan:
    """Everything the exporter needs from one draft head."""

    name: str  # "dspark" | "mtp"
    features: list[int | str]  # target feature sources, in the order the head consumes them
    tensors: dict[str, np.ndarray]
    build: Builder
    signature: Signature
    info: dict[str, Any] = field(default_factory=dict)  # HeadSpec fields but the feature slice
    source_files: list[Path] = field(default_factory=list)


def _config_dict(cfg: Any) -> dict[str, Any]:
    return {k: (v.to_dict() if isinstance(v, ModelConfig) else v) for k, v in asdict(cfg).items()}


def dspark_plan(path: str | Path, target: ModelConfig, target_weights: dict[str, np.ndarray],
                s: io.ExportSettings) -> HeadPlan:
    """A DeepSpec DSpark (or DFlash) checkpoint as a head; γ is the block size."""
    from specrt.exporter.loaders.deepspec import load_dspark
    from specrt.exporter.onnx.dspark import build_dspark_graph, dspark_signature, dspark_weights

    loaded = load_dspark(path, target)
    cfg = loaded.config

    def build(g: GraphBuilder) -> None:
        build_dspark_graph(g, cfg, target, max_seq=s.max_seq, dtype=s.dtype, attention=s.attention)

    info = {"kind": "dflash" if not cfg.markov_rank and not cfg.enable_confidence_head else "dspark",
            "steps": cfg.block_size, "confidence": cfg.enable_confidence_head,
            "temperatures": tuple(cfg.confidence_temperatures), "config": _config_dict(cfg)}
    return HeadPlan(name="dspark", features=list(cfg.target_layer_ids),
                    tensors=dspark_weights(cfg, loaded.weights, target_weights), build=build,
                    signature=dspark_signature(cfg, max_seq=s.max_seq, dtype=s.dtype), info=info,
                    source_files=list(loaded.source_files))


def mtp_plan(path: str | Path, target: ModelConfig, target_weights: dict[str, np.ndarray],
             s: io.ExportSettings, steps: int, feedback: str = "post") -> HeadPlan:
    """A DeepSeek-style MTP checkpoint as a head, chained `steps` times per proposal."""
    from specrt.exporter.loaders.mtp import load_mtp
    from specrt.exporter.onnx.mtp import build_mtp_graph, mtp_weights

    loaded = load_mtp(path, target)
    cfg = loaded.config

    def build(g: GraphBuilder) -> None:
        build_mtp_graph(g, cfg, target, steps=steps, max_seq=s.max_seq, dtype=s.dtype, feedback=feedback,
                        attention=s.attention)

    signature = io.mtp_signature(num_kv_heads=cfg.layer.num_kv_heads, head_dim=cfg.layer.head_dim,
                                 hidden_size=target.hidden_size, vocab_size=target.vocab_size, steps=steps,
                                 max_seq=s.max_seq, dtype=s.dtype)
    info = {"kind": "mtp", "steps": steps, "feedback": feedback, "config": _config_dict(cfg)}
    return HeadPlan(name="mtp", features=[FINAL], tensors=mtp_weights(cfg, loaded.weights, target_weights),
                    build=build, signature=signature, info=info, source_files=list(loaded.source_files))


def feature_layout(heads: list[HeadPlan], hidden: int) -> list[int | str]:
    """The target's feature sources (union, in head order) and each head's offset/width into F."""
    sources: list[int | str] = []
    for h in heads:
        if all(f in sources for f in h.features) and h.features:
            start = sources.index(h.features[0])
            if sources[start:start + len(h.features)] == h.features:
                h.info.update(feature_offset=start * hidden, feature_dim=len(h.features) * hidden)
                continue
        h.info.update(feature_offset=len(sources) * hidden, feature_dim=len(h.features) * hidden)
        sources += h.features
    return sources


def dspark_block_size(path: str | Path) -> int | None:
    """The block size in a DSpark checkpoint's config.json (the default gamma), if readable."""
    import json

    try:
        return int(json.loads((Path(path) / "config.json").read_text())["block_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the loader reports what is wrong with the checkpoint
