"""Stage b of distillation: the target's features at every position of prompt + response, into a TargetCache.

    responses.jsonl ─► prefill graph, chunk by chunk (B = 1 slot, write_index advancing)
                    ─► features[1,C,F] rows of the requested sources ─► CacheWriter (fp16) ─► cache/

The artifact must output the sources (export with `extra_features=feature_sources`). A finished cache
whose manifest names the same responses file hash, target and sources is reused as is.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.distill.cache import MANIFEST, CacheWriter, TargetCache
from specrt.distill.generate import meta_path, read_responses
from specrt.exporter.export import sha256_file
from specrt.runtime import calls
from specrt.runtime.backends import load_runner

MIN_RESPONSE_TOKENS = 8  # shorter responses teach a block-drafting head next to nothing


def feature_columns(manifest: io.Manifest, feature_sources: Sequence[int | str]) -> np.ndarray:
    """Columns of the target's `features` output holding `feature_sources`, in that order."""
    have = list(manifest.features)
    missing = [s for s in feature_sources if s not in have]
    if missing or not feature_sources:
        raise SpecrtError(f"the artifact's target outputs features {have or 'none'}, distillation needs "
                          f"{list(feature_sources)}; re-export it with "
                          f"export_artifact(..., extra_features={tuple(feature_sources)!r})")
    d = manifest.model.hidden_size
    return np.concatenate([np.arange(have.index(s) * d, (have.index(s) + 1) * d) for s in feature_sources])


def _target_info(art: Path, manifest: io.Manifest) -> dict[str, Any]:
    return {"name": manifest.name, "artifact": str(art.resolve()), "config": manifest.model.to_dict(),
            "dtype": manifest.export.dtype, "sources": [asdict(f) for f in manifest.sources]}


def _reuse(cache_dir: Path, key: dict[str, Any], splits: Mapping[str, Sequence[int]]) -> bool:
    """True if `cache_dir` is a finished cache of the same inputs (its splits are rewritten if they changed)."""
    try:
        cache = TargetCache(cache_dir)
    except (SpecrtError, OSError, ValueError, KeyError):
        return False
    m = cache.manifest
    if _key(m) != key:
        return False
    wanted = _cache_splits(splits, {int(p["index"]): n for n, p in enumerate(m["provenance"])})
    if m.get("splits") != wanted:
        tmp = cache_dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(dict(m, splits=wanted), indent=1))
        os.replace(tmp, cache_dir / MANIFEST)
    return True


def _key(m: dict[str, Any]) -> dict[str, Any]:
    """What a cache depends on: the responses file's content, the target's weights, the feature sources."""
    key = {"responses_sha256": m.get("source", {}).get("sha256"), "feature_sources": m.get("feature_sources"),
           "target_sources": m.get("target", {}).get("sources")}
    if m.get("backend"):  # captured elsewhere than ONNX Runtime on the CPU (the keys of those stay as they were)
        key["backend"] = m["backend"]
    return key


def _cache_splits(splits: Mapping[str, Sequence[int]], positions: dict[int, int]) -> dict[str, list[int]]:
    """Response indices per split -> indices of the cache samples that kept them."""
    return {name: [positions[int(i)] for i in idx if int(i) in positions] for name, idx in splits.items()}


class _FeatureReader:
    """Runs the prefill graph over one sequence at a time in B=1 chunks (the engine's prefill calls)."""

    def __init__(self, art: Path, manifest: io.Manifest, columns: np.ndarray, threads: int | None,
                 backend: str = "ort", device: str = "cpu") -> None:
        self.runner = load_runner(backend, art, manifest, io.TARGET, threads=threads,
                                  **({"device": device} if backend == "torch" else {}))
        self.runner.allocate(1)
        s = columns[0]  # the usual case (sources stored contiguously) slices instead of gathering
        self.columns = slice(s, s + len(columns)) if np.array_equal(columns, np.arange(s, s + len(columns))) \
            else columns
        self.width = len(columns)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """features [len(ids), F] (fp16) of the sequence `ids`, written from cache position 0."""
        out = np.empty((len(ids), self.width), np.float16)
        start = 0
        for piece, res in calls.target.run_prefill(self.runner, 0, ids):  # the engine's prefill
            out[start:start + len(piece)] = res[io.FEATURES][0, :len(piece), self.columns]
            start += len(piece)
        return out


def capture_features(art_dir: str | Path, responses_jsonl: str | Path, cache_dir: str | Path, *,
                     feature_sources: Sequence[int | str], splits: Mapping[str, Sequence[int]],
                     min_response_tokens: int = MIN_RESPONSE_TOKENS, threads: int | None = None,
                     progress: bool = True, backend: str = "ort", device: str = "cpu") -> Path:
    """Write a TargetCache of every response with >= `min_response_tokens` tokens; `splits` maps split
    names to response indices (e.g. `PromptSplit.indices`). Returns the existing cache if it matches.
    `backend`, `device`: where the target runs; a cache captured elsewhere than ONNX Runtime on the CPU records
    where (its numerics differ), so neither resumes nor reuses the other's."""
    art, responses, cache_dir = Path(art_dir), Path(responses_jsonl), Path(cache_dir)
    manifest = io.load_manifest(art)
    sources = list(feature_sources)
    columns = feature_columns(manifest, sources)
    if not responses.is_file():
        raise SpecrtError(f"responses file not found: {responses} (run the generation stage first)")
    if cache_dir.exists() and any(cache_dir.iterdir()) and not (cache_dir / MANIFEST).is_file():
        raise SpecrtError(f"{cache_dir} exists and is not a target cache; refusing to replace it")
    source = {"responses": str(responses.resolve()), "sha256": sha256_file(responses)}
    target = _target_info(art, manifest)
    placement = {} if backend == "ort" else {"backend": f"{backend}:{device}"}
    key = _key({"source": source, "feature_sources": sources, "target": target, **placement})
    if _reuse(cache_dir, key, splits):
        return cache_dir
    rows = sorted(read_responses(responses), key=lambda r: int(r["index"]))
    capacity = manifest.export.max_seq - 1  # the last cache position takes the padding writes
    short = [r for r in rows if len(r["response_ids"]) < min_response_tokens]
    long = [r for r in rows if len(r["response_ids"]) >= min_response_tokens
            and len(r["prompt_ids"]) + len(r["response_ids"]) > capacity]
    kept = [r for r in rows if len(r["response_ids"]) >= min_response_tokens
            and len(r["prompt_ids"]) + len(r["response_ids"]) <= capacity]
    if not kept:
        raise SpecrtError(f"{responses}: no response has >= {min_response_tokens} tokens and fits the "
                          f"artifact's {capacity} cache positions; nothing to distill from")
    reader = _FeatureReader(art, manifest, columns, threads, backend, device)
    # an interrupted capture of the same inputs resumes after its last whole sample
    writer = CacheWriter(cache_dir, feature_dim=len(columns), key=dict(key, kept=len(kept),
                                                                          min_response_tokens=min_response_tokens))
    resumed = writer.done
    try:
        tokens, t0 = 0, time.perf_counter()
        with tqdm(kept[resumed:], desc="features", unit="sample", disable=not progress, initial=resumed,
                  total=len(kept)) as bar:
            for r in bar:
                ids = np.asarray([*r["prompt_ids"], *r["response_ids"]], np.int64)
                writer.add(ids, len(r["prompt_ids"]), reader.read(ids))
                tokens += len(ids)
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.1f}", refresh=False)
        elapsed = time.perf_counter() - t0
        meta = meta_path(responses)
        positions = {int(r["index"]): n for n, r in enumerate(kept)}
        return writer.finish({
            "target": target, "source": source, "feature_sources": sources, **placement,
            "hidden_size": manifest.model.hidden_size,
            "splits": _cache_splits(splits, positions),
            "provenance": [{"index": int(r["index"]), "file": r.get("file"), "row": r.get("row"),
                            "finish_reason": r.get("finish_reason")} for r in kept],
            "generation": json.loads(meta.read_text()) if meta.is_file() else {},
            "counts": {"responses": len(rows), "kept": len(kept), "dropped_short": len(short),
                       "dropped_too_long": len(long), "min_response_tokens": min_response_tokens},
            "capture": {"tokens": tokens, "seconds": round(elapsed, 3),
                        "tokens_per_s": round(tokens / elapsed, 1) if elapsed else 0.0,
                        "resumed_after_samples": resumed}})
    finally:
        writer.close()
