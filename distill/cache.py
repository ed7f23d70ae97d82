"""The target cache: token sequences (prompt + target response) with the target's features, on disk.

    cache/
      manifest.json   version, target config, feature sources, sizes, splits, provenance
      samples.npy     int64 [N, 3]: token offset, length, prompt length of each sample
      tokens.npy      int32 [total tokens]
      features.bin    float16 [total tokens, F] (memory-mapped): per position, the concatenated
                      feature sources (DSpark target-layer outputs, then "final" = final-normed hidden)

Response tokens (positions >= prompt length) are the ones heads train on. A cache is written into a
temporary sibling directory (`.NAME.partial`) and renamed into place when complete, so a finished cache is never
partial. Each sample written is flushed with a progress record (`progress.json`: the inputs' key and the samples
and bytes written), so a capture that was interrupted resumes after its last whole sample.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrt.errors import SpecrtError

CACHE_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class CacheSample:
    ids: np.ndarray  # int32 [T]
    prompt_len: int
    features: np.ndarray  # float16 [T, F] (memmap view)

    @property
    def loss_mask(self) -> np.ndarray:
        """1 for response positions."""
        mask = np.zeros(len(self.ids), np.uint8)
        mask[self.prompt_len:] = 1
        return mask


class TargetCache:
    """Read side: memory-mapped samples of a finished cache."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise SpecrtError(f"{self.path} is not a finished target cache (no {MANIFEST})")
        self.manifest: dict[str, Any] = json.loads((self.path / MANIFEST).read_text())
        if self.manifest.get("version") != CACHE_VERSION:
            raise SpecrtError(f"{self.path}: target cache version {self.manifest.get('version')}, "
                              f"expected {CACHE_VERSION}; regenerate it")
        self.samples = np.load(self.path / "samples.npy")
        self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
        width = int(self.manifest["feature_dim"])
        self.features = np.memmap(self.path / "features.bin", dtype=np.float16, mode="r",
                                  shape=(int(self.manifest["total_tokens"]), width))

    @property
    def feature_sources(self) -> list[int | str]:
        return list(self.manifest["feature_sources"])

    def feature_slice(self, sources: list[int | str]) -> slice:
        """Columns of `features` holding `sources` (which must be contiguous in the cache)."""
        d = int(self.manifest["hidden_size"])
        all_sources = self.feature_sources
        try:
            start = all_sources.index(sources[0])
        except ValueError:
            raise SpecrtError(f"target cache {self.path} has no feature {sources[0]!r} "
                              f"(it has {all_sources})") from None
        if all_sources[start:start + len(sources)] != list(sources):
            raise SpecrtError(f"target cache {self.path}: features {sources} are not stored contiguously")
        return slice(start * d, (start + len(sources)) * d)

    def split(self, name: str) -> list[int]:
        return list(self.manifest["splits"][name])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> CacheSample:
        off, n, prompt_len = (int(x) for x in self.samples[i])
        return CacheSample(ids=np.asarray(self.tokens[off:off + n]), prompt_len=prompt_len,
                           features=self.features[off:off + n])


class CacheWriter:
    """Write side: append samples, then `finish(manifest)` renames the cache into place. A partial cache of the same
    `key` (an interrupted capture of the same inputs) is kept: `done` samples are already written; anything else
    there is discarded."""

    PROGRESS = "progress.json"

    def __init__(self, path: str | Path, feature_dim: int, key: Any = None) -> None:
        self.path = Path(path)
        self.tmp = self.path.parent / f".{self.path.name}.partial"
        self.feature_dim, self.key = feature_dim, json.loads(json.dumps(key))  # as progress.json holds it
        self.done = self._offset = 0
        progress = self._progress()
        if progress is not None and progress.get("key") == key and progress.get("feature_dim") == feature_dim:
            self.done, self._offset = int(progress["samples"]), int(progress["tokens"])
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)
        sizes = {"features.bin": self._offset * feature_dim * 2, "tokens.bin": self._offset * 4,
                 "samples.bin": self.done * 3 * 8}
        self._files = {}
        for name, size in sizes.items():  # a sample written after the last progress record is dropped
            f = open(self.tmp / name, "ab")
            f.truncate(size)
            self._files[name] = f

    def _progress(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.tmp / self.PROGRESS).read_text())
        except (OSError, ValueError):
            return None

    def add(self, ids: np.ndarray, prompt_len: int, features: np.ndarray) -> None:
        if features.shape != (len(ids), self.feature_dim):
            raise ValueError(f"features {features.shape} do not match {len(ids)} tokens x {self.feature_dim}")
        self._files["features.bin"].write(np.ascontiguousarray(features, dtype=np.float16).tobytes())
        self._files["tokens.bin"].write(np.asarray(ids, np.int32).tobytes())
        self._files["samples.bin"].write(np.asarray([self._offset, len(ids), prompt_len], np.int64).tobytes())
        for f in self._files.values():
            f.flush()
        self._offset += len(ids)
        self.done += 1
        record = self.tmp / f".{self.PROGRESS}.tmp"
        record.write_text(json.dumps({"key": self.key, "feature_dim": self.feature_dim, "samples": self.done,
                                      "tokens": self._offset}))
        os.replace(record, self.tmp / self.PROGRESS)

    def finish(self, manifest: dict[str, Any]) -> Path:
        self.close()
        rows = np.fromfile(self.tmp / "samples.bin", np.int64).reshape(-1, 3)
        np.save(self.tmp / "samples.npy", rows)
        np.save(self.tmp / "tokens.npy", np.fromfile(self.tmp / "tokens.bin", np.int32))
        for name in ("samples.bin", "tokens.bin", self.PROGRESS):
            (self.tmp / name).unlink()
        full = dict(manifest, version=CACHE_VERSION, num_samples=len(rows), total_tokens=self._offset,
                    feature_dim=self.feature_dim)
        (self.tmp / MANIFEST).write_text(json.dumps(full, indent=1))
        if self.path.exists():
            shutil.rmtree(self.path)
        self.tmp.rename(self.path)
        return self.path

    def close(self) -> None:
        """Stop writing; what was written stays for a later capture of the same inputs to resume."""
        for f in self._files.values():
            f.close()
