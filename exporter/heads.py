"""Draft heads in an export: load a DSpark/DFlash or MTP checkpoint, add its tensors and graphs.

A head declares which target features it consumes; the target graphs then output the union of
those features (`features[B,T,F]`), and the manifest records each head's slice of F.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.onnx.builder import GraphBuilder
from specrt.exporter.onnx.target import FINAL

Builder = Callable[[GraphBuilder, bool], None]  # emits the head's graph (named axes B/C; greedy variant or not)
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
    # tensors the exporter cuts from the target's (in the target's weight form): name -> (target tensor, rows)
    row_subsets: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)


def _config_dict(cfg: Any) -> dict[str, Any]:
    return {k: (v.to_dict() if isinstance(v, ModelConfig) else v) for k, v in asdict(cfg).items()}


def token_counts_path(draft: str | Path, given: str | Path | None = None) -> Path:
    """Where a head's token counts are: `given`, else token_counts.npy in the head's directory or its parent
    (the shipped heads share one file: specrt/heads/smollm2/token_counts.npy)."""
    from specrt.exporter.vocab import COUNTS_FILE

    if given is not None:
        return Path(given)
    draft = Path(draft)
    for p in (draft / COUNTS_FILE, draft.parent / COUNTS_FILE):
        if p.is_file():
            return p
    raise SpecrtError(f"--draft-vocab needs the token counts of the head's distillation data: no {COUNTS_FILE} "
                      f"in {draft} or its parent (`specrt distill` writes it); give --token-counts FILE")


def _vocabulary(kind: str, path: str | Path, target: ModelConfig, s: io.ExportSettings,
                token_counts: str | Path | None, source_files: list[Path]) -> tuple[np.ndarray | None, dict]:
    """A head's draft vocabulary (FR-Spec) when `s.draft_vocab` asks for one: (ids, HeadSpec fields); the counts
    file joins `source_files`."""
    from specrt.exporter.vocab import coverage, draft_vocab, read_counts

    if not s.draft_vocab:
        return None, {}
    counts_file = token_counts_path(path, token_counts)
    counts = read_counts(counts_file, target.vocab_size)
    ids = draft_vocab(counts, s.draft_vocab, keep=target.eos_token_ids)
    source_files.append(counts_file)
    print(f"specrt: {kind} draft vocabulary: the {len(ids)} most frequent tokens of {counts_file} "
          f"({coverage(counts, ids):.1%} of its tokens)", file=sys.stderr)
    return ids, {"vocab_ids": tuple(int(t) for t in ids)}


def dspark_plan(path: str | Path, target: ModelConfig, target_weights: dict[str, np.ndarray],
                s: io.ExportSettings, token_counts: str | Path | None = None) -> HeadPlan:
    """A DeepSpec DSpark (or DFlash) checkpoint as a head; γ is the block size. With `s.draft_vocab`, its LM and
    Markov heads keep the `s.draft_vocab` most frequent tokens of `token_counts` (and the target's EOS)."""
    from specrt.exporter.loaders.deepspec import load_dspark
    from specrt.exporter.onnx.dspark import build_dspark_graph, dspark_signature, dspark_weights, vocab_head_source

    loaded = load_dspark(path, target)
    cfg = loaded.config
    source_files = list(loaded.source_files)
    ids, info_vocab = _vocabulary("DSpark", path, target, s, token_counts, source_files)

    def build(g: GraphBuilder, greedy: bool) -> None:
        build_dspark_graph(g, cfg, target, max_seq=s.max_seq, dtype=s.dtype, attention=s.attention, vocab_ids=ids,
                           greedy=greedy)

    info = {"kind": "dflash" if not cfg.markov_rank and not cfg.enable_confidence_head else "dspark",
            "steps": cfg.block_size, "confidence": cfg.enable_confidence_head,
            "temperatures": tuple(cfg.confidence_temperatures), "config": _config_dict(cfg), **info_vocab}
    tensors = dspark_weights(cfg, loaded.weights, target_weights, ids)
    subsets = {}
    if ids is not None and (src := vocab_head_source(tensors, target)) is not None:
        subsets["dspark.lm_head.weight"] = (src, ids)
    return HeadPlan(name="dspark", features=list(cfg.target_layer_ids), tensors=tensors, build=build,
                    signature=dspark_signature(cfg, max_seq=s.max_seq, dtype=s.dtype, draft_vocab=s.draft_vocab
                                               if ids is not None else 0),
                    info=info, source_files=source_files, row_subsets=subsets)


def mtp_plan(path: str | Path, target: ModelConfig, target_weights: dict[str, np.ndarray],
             s: io.ExportSettings, steps: int, feedback: str = "post",
             token_counts: str | Path | None = None) -> HeadPlan:
    """A DeepSeek-style MTP checkpoint as a head, chained `steps` times per proposal. With `s.draft_vocab`, its
    head keeps the `s.draft_vocab` most frequent tokens of `token_counts` (and the target's EOS)."""
    from specrt.exporter.loaders.mtp import load_mtp
    from specrt.exporter.onnx.mtp import OWN_HEAD, build_mtp_graph, mtp_weights, target_head

    loaded = load_mtp(path, target)
    cfg = loaded.config
    source_files = list(loaded.source_files)
    ids, info_vocab = _vocabulary("MTP", path, target, s, token_counts, source_files)

    def build(g: GraphBuilder, greedy: bool) -> None:
        build_mtp_graph(g, cfg, target, steps=steps, max_seq=s.max_seq, dtype=s.dtype, feedback=feedback,
                        attention=s.attention, vocab_ids=ids, greedy=greedy)

    signature = io.mtp_signature(num_kv_heads=cfg.layer.num_kv_heads, head_dim=cfg.layer.head_dim,
                                 hidden_size=target.hidden_size, vocab_size=target.vocab_size, steps=steps,
                                 max_seq=s.max_seq, dtype=s.dtype, draft_vocab=len(ids) if ids is not None else 0)
    info = {"kind": "mtp", "steps": steps, "feedback": feedback, "config": _config_dict(cfg), **info_vocab}
    tensors = mtp_weights(cfg, loaded.weights, target_weights)
    subsets = {}
    if ids is not None:  # the graph reads its head as OWN_HEAD: the own head's rows, or the target head's
        if OWN_HEAD in tensors:
            tensors[OWN_HEAD] = tensors[OWN_HEAD][ids]
        else:
            subsets[OWN_HEAD] = (target_head(target), ids)
    return HeadPlan(name="mtp", features=[FINAL], tensors=tensors, build=build, signature=signature, info=info,
                    source_files=source_files, row_subsets=subsets)


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
