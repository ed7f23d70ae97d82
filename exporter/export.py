"""`specrt export`: model source -> artifact directory (manifest, shared weights, fixed-shape graphs)."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

import specrt
from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter.config import ModelConfig
from specrt.exporter.heads import HeadPlan, dspark_plan, feature_layout, mtp_plan
from specrt.exporter.loaders import LoadedTarget, load_target
from specrt.exporter.onnx.builder import GraphBuilder, WeightStore
from specrt.exporter.onnx.target import FINAL, build_target_graph, target_weights


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def target_graph_shapes(s: io.ExportSettings) -> dict[str, tuple[int, int]]:
    """Graph name -> (T, R): prefill writes a chunk and needs one logit row, verify needs all rows."""
    return {"prefill": (s.prefill_chunk, 1), "decode": (1, 1), "verify": (s.verify_len, s.verify_len)}


def _write_target(art: Path, store: WeightStore, cfg: ModelConfig, s: io.ExportSettings,
                  features: list[int | str], bar: tqdm) -> dict[str, io.GraphSpec]:
    graphs: dict[str, io.GraphSpec] = {}
    for name, (tokens, rows) in target_graph_shapes(s).items():
        g = GraphBuilder(store)
        build_target_graph(g, cfg, batch=s.batch, tokens=tokens, rows=rows, max_seq=s.max_seq, dtype=s.dtype,
                           features=features)
        model = g.model(f"target_{name}")
        file = f"target_{name}.onnx"
        onnx.save(model, art / file)
        inputs, outputs = io.target_signature(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size, batch=s.batch, tokens=tokens, rows=rows, max_seq=s.max_seq, dtype=s.dtype,
            feature_dim=len(features) * cfg.hidden_size)
        graphs[name] = io.GraphSpec(name=name, file=file, family="target",
                                    dims={"B": s.batch, "T": tokens, "R": rows, "S": s.max_seq},
                                    inputs=inputs, outputs=outputs)
        bar.update(1)
    return graphs


def _write_head(art: Path, store: WeightStore, head: HeadPlan, s: io.ExportSettings,
                bar: tqdm) -> dict[str, io.GraphSpec]:
    """A head's graphs: `{name}_prefill` (C = prefill chunk) and `{name}` (C = verify length)."""
    graphs: dict[str, io.GraphSpec] = {}
    for name, rows in ((f"{head.name}_prefill", s.prefill_chunk), (head.name, s.verify_len)):
        g = GraphBuilder(store)
        head.build(g, rows)
        file = f"{name}.onnx"
        onnx.save(g.model(name), art / file)
        inputs, outputs = head.signature(rows)
        graphs[name] = io.GraphSpec(name=name, file=file, family=head.name,
                                    dims={"B": s.batch, "C": rows, "S": s.max_seq}, inputs=inputs, outputs=outputs)
        bar.update(1)
    head.info["graphs"] = list(graphs)
    return graphs


def _check_graphs(art: Path, graphs: dict[str, io.GraphSpec], bar: tqdm) -> None:
    for g in graphs.values():
        onnx.checker.check_model(str(art / g.file), full_check=True)
        bar.update(1)


def export_artifact(source: str | Path, out: str | Path, settings: io.ExportSettings, *,
                    draft: str | Path | None = None, mtp: str | Path | None = None, mtp_feedback: str = "post",
                    extra_features: tuple[int | str, ...] = (), progress: bool = True, force: bool = False) -> Path:
    """Export `source` (HF dir, GGUF file or preset name) into the artifact directory `out`.

    Everything is written to a temporary sibling directory that is renamed into place at the end, so
    an interrupted export never leaves a directory that looks like a finished artifact.
    """
    out = Path(out)
    if out.exists() and not force:
        raise SpecrtError(f"{out} already exists; pass --force to replace it")
    dtype = np.dtype(settings.dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        n_graphs = len(target_graph_shapes(settings)) + 2 * ((draft is not None) + (mtp is not None))
        steps = 2 + 2 * n_graphs + 1
        with tqdm(total=steps, desc=f"export {Path(source).name}", unit="step", disable=not progress) as bar:
            loaded: LoadedTarget = load_target(source)
            cfg = loaded.config
            bar.update(1)
            store = WeightStore(tmp / io.WEIGHTS_FILE)
            heads: list[HeadPlan] = []
            if draft is not None:
                heads.append(dspark_plan(draft, cfg, loaded.weights, settings))
                if settings.verify_len - 1 > heads[-1].info["block"]:
                    raise SpecrtError(f"--gamma {settings.verify_len - 1} exceeds the DSpark block size "
                                      f"{heads[-1].info['block']}")
            if mtp is not None:
                heads.append(mtp_plan(mtp, cfg, loaded.weights, settings, steps=settings.verify_len - 1,
                                      feedback=mtp_feedback))
            # the target outputs what the heads read, plus any extra sources asked for (distillation)
            features = feature_layout(heads, cfg.hidden_size)
            for f in extra_features:
                if f != FINAL and not (isinstance(f, int) and -1 <= f < cfg.num_layers):
                    raise SpecrtError(f"feature source {f!r}: use a layer id in -1..{cfg.num_layers - 1} or 'final'")
            features += [f for f in dict.fromkeys(extra_features) if f not in features]
            tensors = target_weights(cfg, loaded.weights)
            for head in heads:
                tensors.update(head.tensors)
            for name in sorted(tensors):
                store.add(name, tensors[name].astype(dtype, copy=False))
            weights_bytes = store.close()
            bar.update(1)
            graphs = _write_target(tmp, store, cfg, settings, features, bar)
            for head in heads:
                graphs.update(_write_head(tmp, store, head, settings, bar))
            _check_graphs(tmp, graphs, bar)
            tok_info = loaded.tokenizer.save(tmp / io.TOKENIZER_DIR) if loaded.tokenizer else None
            files = [*loaded.source_files, *(f for h in heads for f in h.source_files)]
            sources = [{"path": str(Path(p).resolve()), "size": Path(p).stat().st_size,
                        "sha256": sha256_file(Path(p))} for p in files]
            manifest = io.Manifest(model=cfg.to_dict(), export=settings, graphs=graphs, tokenizer=tok_info,
                                   sources=sources, name=loaded.name, specrt_version=specrt.__version__,
                                   weights={"file": io.WEIGHTS_FILE, "bytes": weights_bytes,
                                            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                   features=features, heads={h.name: h.info for h in heads})
            manifest.save(tmp)
            bar.update(1)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
