"""The target cache: token sequences (prompt + target response) with the target's features, on disk.

    cache/
      manifest.json   version, target config, feature sources, sizes, splits, provenance
      samples.npy     int64 [N, 3]: token offset, length, prompt length of each sample
      tokens.npy      int32 [total tokens]
      features.bin    float16 [total tokens, F] (memory-mapped): per position, the concatenated
                      feature sources (DSpark target-layer outputs, then "final" = final-normed hidden)

Response tokens (positions >= prompt length) are the ones heads train on. A cache is written into a
temporary sibling directory and renamed into place when complete, so a finished cache is never partial.
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
    """Write side: append samples, then `finish(manifest)` renames the cache into place."""

    def __init__(self, path: str | Path, feature_dim: int) -> None:
        self.path = Path(path)
        self.tmp = self.path.parent / f".{self.path.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.feature_dim = feature_dim
        self._features = open(self.tmp / "features.bin", "wb")
        self._tokens: list[np.ndarray] = []
        self._rows: list[tuple[int, int, int]] = []
        self._offset = 0

    def add(self, ids: np.ndarray, prompt_len: int, features: np.ndarray) -> None:
        if features.shape != (len(ids), self.feature_dim):
            raise ValueError(f"features {features.shape} do not match {len(ids)} tokens x {self.feature_dim}")
        self._features.write(np.ascontiguousarray(features, dtype=np.float16).tobytes())
        self._tokens.append(np.asarray(ids, np.int32))
        self._rows.append((self._offset, len(ids), prompt_len))
        self._offset += len(ids)

    def finish(self, manifest: dict[str, Any]) -> Path:
        self._features.close()
        np.save(self.tmp / "samples.npy", np.asarray(self._rows, np.int64).reshape(-1, 3))
        np.save(self.tmp / "tokens.npy", np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32))
        full = dict(manifest, version=CACHE_VERSION, num_samples=len(self._rows), total_tokens=self._offset,
                    feature_dim=self.feature_dim)
        (self.tmp / MANIFEST).write_text(json.dumps(full, indent=1))
        if self.path.exists():
            shutil.rmtree(self.path)
        self.tmp.rename(self.path)
        return self.path

    def abort(self) -> None:
        self._features.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
