"""Training prompts for distillation, kept disjoint from the benchmark rows.

Benchmarks report on the first `EVAL_ROWS` rows of each file in `datasets/`. Training uses only the rows
after them (or every row of explicit `--prompts` files), minus any row whose text equals an eval row's
text, so no evaluation prompt is ever trained on. The held-out "calib" part (confidence calibration) is
chosen per file with a seeded generator, so a split is a pure function of its arguments.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.datasets import DATASETS_DIR
from specrt.errors import SpecrtError
from specrt.runtime.prompts import read_conversations, read_prompts_file

EVAL_ROWS = 20
SPLITS = ("train", "calib")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One training prompt: text (rendered with the chat template later) or raw ids, and its provenance."""

    file: str  # dataset name (file stem) for datasets/, the path for explicit prompt files
    row: int  # index among the file's prompts (the numbering `read_prompts_file` uses)
    text: str | None = None
    ids: tuple[int, ...] | None = None
    history: tuple[str, ...] = ()  # a multi-turn prompt's earlier turns (user, assistant, ...) before `text`

    def __post_init__(self) -> None:
        if (self.text is None) == (self.ids is None):
            raise ValueError("a Prompt has exactly one of text and ids")
        if len(self.history) % 2 or (self.history and self.text is None):
            raise ValueError("a Prompt's history is (user, assistant) pairs before a text turn")

    @property
    def turns(self) -> tuple[str, ...]:
        """The conversation up to the turn to answer (user, assistant, ..., user)."""
        return (*self.history, self.text) if self.text is not None else ()

    @property
    def first(self) -> str | None:
        """The conversation's first user turn (the one eval rows are compared with)."""
        return self.history[0] if self.history else self.text


@dataclass(frozen=True, slots=True)
class PromptSplit:
    """All training prompts in a fixed order, and which of them are "train" and "calib" (indices)."""

    prompts: tuple[Prompt, ...]
    train: tuple[int, ...]
    calib: tuple[int, ...]

    @property
    def indices(self) -> dict[str, list[int]]:
        """Split name -> prompt indices (= response indices of `generate_responses`)."""
        return {"train": list(self.train), "calib": list(self.calib)}


def dataset_files(datasets_dir: str | Path = DATASETS_DIR, files: Sequence[str] | None = None) -> list[Path]:
    """The prompt files of `datasets_dir` (all `*.jsonl`, or the named ones, e.g. ("gsm8k", "mbpp"))."""
    root = Path(datasets_dir)
    if not root.is_dir():
        raise SpecrtError(f"datasets directory not found: {root}")
    if files is None:
        paths = sorted(root.glob("*.jsonl"))
    else:
        paths = [root / (f if f.endswith(".jsonl") else f"{f}.jsonl") for f in files]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            have = ", ".join(p.stem for p in sorted(root.glob("*.jsonl")))
            raise SpecrtError(f"no dataset {', '.join(missing)} in {root} (have: {have})")
    if not paths:
        raise SpecrtError(f"{root} has no *.jsonl prompt files")
    return paths


def eval_prompts(datasets_dir: str | Path = DATASETS_DIR, *, eval_rows: int = EVAL_ROWS) -> dict[str, list[str]]:
    """Dataset name -> the texts benchmarks report on (the first `eval_rows` rows of each file).

    An installed wheel has no `datasets/` (it lives in the repository): then there is nothing to hold out."""
    if Path(datasets_dir) == DATASETS_DIR and not DATASETS_DIR.is_dir():
        return {}
    return {p.stem: read_prompts_file(p, eval_rows) for p in dataset_files(datasets_dir)} if eval_rows else {}


def training_prompts(datasets_dir: str | Path = DATASETS_DIR, *, files: Sequence[str] | None = None,
                     prompt_files: Sequence[str | Path] = (), eval_rows: int = EVAL_ROWS,
                     calib_fraction: float = 0.1, seed: int = 0, limit: int | None = None) -> PromptSplit:
    """Rows after the first `eval_rows` of each dataset file (`files`: all when None and no `prompt_files`)
    plus every row of `prompt_files`; at most `limit` in total, spread evenly over files; split train/calib."""
    if eval_rows < 0 or not 0.0 <= calib_fraction < 1.0 or (limit is not None and limit < 1):
        raise SpecrtError(f"need eval_rows >= 0, 0 <= calib_fraction < 1, limit >= 1 "
                          f"(got {eval_rows}, {calib_fraction}, {limit})")
    per_file: list[list[Prompt]] = []
    if files is not None or not prompt_files:
        for path in dataset_files(datasets_dir, files):
            texts = read_prompts_file(path)
            per_file.append([Prompt(path.stem, r, text=t) for r, t in enumerate(texts) if r >= eval_rows])
    for path in prompt_files:
        per_file.append([Prompt(str(path), r, text=turns[-1], history=turns[:-1])
                         for r, turns in enumerate(read_conversations(path))])
    # A later row can repeat an eval row's text (mbpp has duplicates): drop those too.
    held_out = {t for texts in eval_prompts(datasets_dir, eval_rows=eval_rows).values() for t in texts}
    per_file = [[p for p in rows if p.text not in held_out and p.first not in held_out] for rows in per_file]
    rng = np.random.default_rng(seed)
    if limit is not None:
        quotas = _even_quotas([len(rows) for rows in per_file], limit)
        per_file = [[rows[i] for i in sorted(rng.choice(len(rows), q, replace=False))]
                    for rows, q in zip(per_file, quotas)]
    prompts: list[Prompt] = [p for rows in per_file for p in rows]
    if not prompts:
        raise SpecrtError("no training prompts left after holding out the eval rows")
    calib: list[int] = []
    start = 0
    for rows in per_file:  # calib rows drawn per file, so every file is represented in calibration
        k = round(calib_fraction * len(rows))
        calib += [start + int(i) for i in rng.choice(len(rows), k, replace=False)]
        start += len(rows)
    calib_set = set(calib)
    split = PromptSplit(prompts=tuple(prompts), train=tuple(i for i in range(len(prompts)) if i not in calib_set),
                        calib=tuple(sorted(calib)))
    assert_disjoint_from_eval(split, datasets_dir, eval_rows=eval_rows)
    return split


def assert_disjoint_from_eval(split: PromptSplit, datasets_dir: str | Path = DATASETS_DIR, *,
                              eval_rows: int = EVAL_ROWS) -> None:
    """Raise if any prompt is an eval row of `datasets_dir` (by file/row or by identical text)."""
    evals = eval_prompts(datasets_dir, eval_rows=eval_rows)
    texts = {t for ts in evals.values() for t in ts}
    bad = [p for p in split.prompts if (p.file in evals and p.row < eval_rows) or p.text in texts or p.first in texts]
    if bad:
        raise SpecrtError(f"{len(bad)} training prompts are eval rows (first: {bad[0].file} row {bad[0].row})")


def _even_quotas(sizes: list[int], limit: int) -> list[int]:
    """Split `limit` over files as evenly as their sizes allow (water-filling; earlier files get the rest)."""
    quotas = [0] * len(sizes)
    left = min(limit, sum(sizes))
    while left:
        open_ = [i for i, n in enumerate(sizes) if quotas[i] < n]
        share = max(1, left // len(open_))
        for i in open_:
            take = min(share, sizes[i] - quotas[i], left)
            quotas[i] += take
            left -= take
            if not left:
                break
    return quotas


def rows_label(split: PromptSplit) -> str:
    """A short summary, e.g. `gsm8k 1299, mbpp 237 (train 1382, calib 154)`."""
    counts: dict[str, int] = {}
    for p in split.prompts:
        counts[p.file] = counts.get(p.file, 0) + 1
    files = ", ".join(f"{Path(f).stem} {n}" for f, n in counts.items())
    return f"{files} (train {len(split.train)}, calib {len(split.calib)})"

