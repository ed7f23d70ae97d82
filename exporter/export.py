"""`specrt export`: model source -> artifact directory (manifest, shared weights, fixed-shape graphs)."""
from __future__ import annotations

import dataclasses
import hashlib
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.model_config import ModelConfig
from specrt.exporter.heads import HeadPlan, dspark_plan, feature_layout, mtp_plan
from specrt.exporter.loaders import LoadedTarget, load_target
from specrt.exporter.onnx.builder import GraphBuilder, WeightStore
from specrt.blocks import Blocks, GGUFRows
from specrt.exporter.onnx.quant import Stack, pack_weights, select_rows, stored_bytes
from specrt.outdir import check_out, staged
from specrt.exporter.onnx.target import FINAL, build_target_graph, stacked_types, target_cache_len, target_weights


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_graph(art: Path, g: GraphBuilder, name: str, signature: tuple, s: io.ExportSettings,
                 buckets: dict[str, tuple[io.Bucket, ...]], bar: tqdm) -> io.GraphSpec:
    """Save one graph family as `{name}.onnx` (named axes) with the buckets it is run at."""
    file = f"{name}.onnx"
    inputs, outputs = signature
    spec = io.GraphSpec(name=name, file=file, max_seq=s.max_seq, inputs=inputs, outputs=outputs, buckets=buckets)
    _save(g.model(name), spec, art / file)
    bar.update(1)
    return spec


def _save(model: onnx.ModelProto, spec: io.GraphSpec, path: Path) -> None:
    """Save a graph file that records the cache length and buckets it was exported for (io.check_graph_meta)."""
    onnx.helper.set_model_props(model, {io.GRAPH_META: io.graph_meta(spec)})
    onnx.save(model, path)


def _write_target(art: Path, store: WeightStore, cfg: ModelConfig, s: io.ExportSettings,
                  features: list[int | str], bar: tqdm) -> io.GraphSpec:
    g = GraphBuilder(store, accuracy_level=s.accuracy_level, kernels=s.kernels)
    build_target_graph(g, cfg, max_seq=s.max_seq, dtype=s.dtype, features=features, attention=s.attention,
                       kv_dtype=s.cache_dtype)
    signature = io.target_signature(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                    vocab_size=cfg.vocab_size, max_seq=s.max_seq, dtype=s.dtype,
                                    feature_dim=len(features) * cfg.hidden_size,
                                    cache_len=target_cache_len(s.attention, s.max_seq), cache_dtype=s.cache_dtype)
    return _write_graph(art, g, io.TARGET, signature, s, io.target_buckets(s), bar)


def _write_head(art: Path, store: WeightStore, head: HeadPlan, s: io.ExportSettings, bar: tqdm) -> io.GraphSpec:
    """The head's graph family and its greedy variant (`{name}.greedy.onnx`, the same weights)."""
    g = GraphBuilder(store, accuracy_level=s.accuracy_level, kernels=s.kernels)
    head.build(g, False)
    spec = _write_graph(art, g, head.name, head.signature, s, io.head_buckets(s), bar)
    greedy = GraphBuilder(store, accuracy_level=s.accuracy_level, kernels=s.kernels)
    head.build(greedy, True)
    file = f"{head.name}.greedy.onnx"
    _save(greedy.model(f"{head.name}.greedy"), spec, art / file)
    bar.update(1)
    return dataclasses.replace(spec, greedy_file=file)


def _bytes_per_token(store: WeightStore, cfg: ModelConfig, tensors: dict[str, "np.ndarray | Blocks"]) -> int:
    """Weight bytes one decoded token reads: every target matmul, the LM head and one embedding row."""
    embed = "model.embed_tokens.weight"
    matrices = [n for n, w in tensors.items()
                if n != embed and (isinstance(w, (Blocks, GGUFRows, Stack)) or np.ndim(w) == 2)]
    head = stored_bytes(store, embed) if cfg.tie_word_embeddings else 0  # untied: lm_head is among the matrices
    return sum(stored_bytes(store, n) for n in matrices) + head + stored_bytes(store, embed) // cfg.vocab_size


def _check_graphs(art: Path, graphs: dict[str, io.GraphSpec], bar: tqdm) -> None:
    for g in graphs.values():
        for file in filter(None, (g.file, g.greedy_file)):
            onnx.checker.check_model(str(art / file), full_check=True)
            bar.update(1)


def export_artifact(source: str | Path, out: str | Path, settings: io.ExportSettings, *,
                    draft: str | Path | None = None, mtp: str | Path | None = None, mtp_feedback: str = "post",
                    extra_features: tuple[int | str, ...] = (), token_counts: str | Path | None = None,
                    progress: bool = True, force: bool = False) -> Path:
    """Export `source` (HF dir, GGUF file or preset name) into the artifact directory `out`.

    `token_counts`: the file a `settings.draft_vocab` is chosen from (default: beside each head).

    Everything is written to a temporary sibling directory that is renamed into place at the end, so
    an interrupted export never leaves a directory that looks like a finished artifact.
    """
    out = Path(out)
    check_out(out, sources=[source, draft, mtp], force=force, command="export")  # before anything is written
    if settings.draft_vocab and draft is None and mtp is None:
        raise SpecrtError("--draft-vocab reduces a draft head's vocabulary; give --draft or --mtp (or a preset "
                          "with heads)")
    dtype = np.dtype(settings.dtype)
    with staged(out, "export") as tmp:  # beside `out`, swapped in at the end; removed on any failure or SIGTERM
        n_graphs = 1 + 2 * (draft is not None) + 2 * (mtp is not None)  # a head: its graph and greedy variant
        steps = 2 + 2 * n_graphs + 1
        with tqdm(total=steps, desc=f"export {Path(source).name}", unit="step", disable=not progress) as bar:
            loaded: LoadedTarget = load_target(source)
            cfg = loaded.config
            bar.update(1)
            store = WeightStore(tmp / io.WEIGHTS_FILE)
            heads: list[HeadPlan] = []
            if draft is not None:
                heads.append(dspark_plan(draft, cfg, loaded.weights, settings, token_counts))
                room = heads[-1].info["steps"] + io.FIRST_TOP - 1  # the block, and a tree's alternatives to its first
                if settings.verify_len - 1 > room:
                    raise SpecrtError(f"--gamma {settings.verify_len - 1} exceeds the DSpark block size "
                                      f"{heads[-1].info['steps']} plus {io.FIRST_TOP - 1} alternatives to its first "
                                      "draft (a draft tree's)")
            if mtp is not None:
                heads.append(mtp_plan(mtp, cfg, loaded.weights, settings, steps=settings.verify_len - 1,
                                      feedback=mtp_feedback, token_counts=token_counts))
            # the target outputs what the heads read, plus any extra sources asked for (distillation)
            features = feature_layout(heads, cfg.hidden_size)
            for f in extra_features:
                if f != FINAL and not (isinstance(f, int) and -1 <= f < cfg.num_layers):
                    raise SpecrtError(f"feature source {f!r}: use a layer id in -1..{cfg.num_layers - 1} or 'final'")
            features += [f for f in dict.fromkeys(extra_features) if f not in features]
            if settings.weights == "gguf" and loaded.blocks is None:
                raise SpecrtError(f"--weights gguf keeps a GGUF file's own blocks, and {source} is not a GGUF "
                                  "file; use --weights int4 or int8")
            # gguf: the file's blocks where it has them (stacked block rows), float tensors elsewhere
            # (a GGUF's float weights are made when read: only those without blocks here)
            source_weights = {n: loaded.blocks[n] if n in loaded.blocks else loaded.weights[n] for n in loaded.weights} \
                if settings.weights == "gguf" else loaded.weights
            tensors = target_weights(cfg, source_weights)
            target_tensors = dict(tensors)
            for head in heads:  # tensors a head shares with the target (embedding, head) keep the target's form
                for name, w in head.tensors.items():
                    tensors.setdefault(name, w)
                for name, (src, rows) in head.row_subsets.items():  # e.g. a draft vocabulary's LM head rows
                    tensors[name] = select_rows(target_tensors[src], rows)
            packed = pack_weights(tensors, settings.weights, dtype=dtype, gguf_names=target_tensors,
                                  kernels=settings.kernels, types=stacked_types(loaded.tensor_types))
            for name in sorted(packed):
                store.add(name, packed[name])
            del packed
            weights_bytes = store.close()
            bar.update(1)
            graphs = {io.TARGET: _write_target(tmp, store, cfg, settings, features, bar)}
            for head in heads:
                graphs[head.name] = _write_head(tmp, store, head, settings, bar)
            _check_graphs(tmp, graphs, bar)
            tok_info = loaded.tokenizer.save(tmp / io.TOKENIZER_DIR) if loaded.tokenizer else None
            files = [*loaded.source_files, *(f for h in heads for f in h.source_files)]
            sources = tuple(io.SourceFile(path=str(Path(p).resolve()), size=Path(p).stat().st_size,
                                          sha256=sha256_file(Path(p))) for p in files)
            weights = io.WeightsInfo(file=io.WEIGHTS_FILE, bytes=weights_bytes,
                                     created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     bytes_per_token=_bytes_per_token(store, cfg, target_tensors))
            manifest = io.Manifest(model=cfg, export=settings, graphs=graphs, tokenizer=tok_info, sources=sources,
                                   weights=weights, name=loaded.name, specrt_version=version("specrt"),
                                   features=tuple(features),
                                   heads={h.name: io.HeadSpec(name=h.name, **h.info) for h in heads})
            manifest.save(tmp)
            bar.update(1)
    return out
