"""Token frequencies of the target's responses, and the reduced draft vocabularies built from them (FR-Spec).

FR-Spec (arXiv 2502.14856): a draft head's LM head and Markov head need not span the whole vocabulary.
Restricted to the N target tokens the target itself emits most often, the draft's vocabulary-wide work
shrinks by V/N while most drafts stay possible. Exactness does not depend on the subset: a draft's
distribution q is zero outside it, and verification's residual max(0, p - q) covers every other token.

`specrt distill` writes `token_counts.npy` (int64 [V]: how often each token occurs in the training
responses of the distillation cache) beside the head; `specrt export --draft-vocab N` reads it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specrt.artifact import DEFAULT_DRAFT_VOCAB
from specrt.errors import SpecrtError

COUNTS_FILE = "token_counts.npy"


def count_tokens(responses: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: occurrences of each token id over all `responses`."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in responses:
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise SpecrtError(f"response token id outside the vocabulary (0..{vocab_size - 1})")
        np.add.at(counts, ids, 1)
    return counts


def write_counts(path: str | Path, counts: np.ndarray) -> None:
    np.save(Path(path), np.asarray(counts, np.int64), allow_pickle=False)


def _load(p: Path, mmap_mode: str | None = None) -> np.ndarray:
    try:
        return np.load(p, allow_pickle=False, mmap_mode=mmap_mode)
    except FileNotFoundError:
        raise SpecrtError(f"token counts not found: {p}") from None
    except (OSError, ValueError, TypeError) as e:
        raise SpecrtError(f"{p} is not a token-count file: {e}") from None


def read_counts(path: str | Path, vocab_size: int) -> np.ndarray:
    """Counts saved by `write_counts`, checked against the vocabulary they are for."""
    p = Path(path)
    counts = _load(p)
    if counts.shape != (vocab_size,) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise SpecrtError(f"{p} holds {counts.dtype}{list(counts.shape)}, not non-negative counts for a "
                          f"{vocab_size}-token vocabulary")
    return counts.astype(np.int64)


def default_draft_vocab(counts_files: Sequence[Path]) -> int:
    """--draft-vocab when not given: DEFAULT_DRAFT_VOCAB for heads whose token counts are `counts_files` (one per
    head; none when a head has none, which means the whole vocabulary, 0), if the vocabulary is larger."""
    if not counts_files:
        return 0
    vocab = min(len(_load(Path(p), mmap_mode="r")) for p in counts_files)
    return DEFAULT_DRAFT_VOCAB if vocab > DEFAULT_DRAFT_VOCAB else 0


def draft_vocab(counts: np.ndarray, size: int, *, keep: Iterable[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids (ties and unseen tokens by lower id, which byte-pair vocabularies
    assign to earlier, more frequent merges), always including `keep` (EOS, say); sorted ascending, int64."""
    v = len(counts)
    keep = sorted({int(t) for t in keep})
    if not len(keep) <= size <= v:
        raise SpecrtError(f"--draft-vocab must be between {max(len(keep), 1)} and the vocabulary size {v}, "
                          f"got {size}")
    order = np.lexsort((np.arange(v), -np.asarray(counts)))  # count descending, then id ascending
    chosen = set(keep)
    for t in order:
        if len(chosen) == size:
            break
        chosen.add(int(t))
    return np.array(sorted(chosen), np.int64)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Fraction of the counted tokens that fall inside `ids`."""
    total = counts.sum()
    return float(counts[ids].sum() / total) if total else 0.0
