"""Training data for `specrt distill`: prompt splits (prompts.py), the target's responses (generate.py, stage a)
and its features over them in a target cache (features.py, stage b). One import point for all three."""
from __future__ import annotations

from specrt.distill.features import MIN_RESPONSE_TOKENS, capture_features, feature_columns
from specrt.distill.generate import (SAMPLING, TOO_LONG, PromptLike, generate_responses, meta_path,
                                              read_responses, sampling_params)
from specrt.distill.prompts import (DATASETS_DIR, EVAL_ROWS, SPLITS, Prompt, PromptSplit,
                                             assert_disjoint_from_eval, dataset_files, eval_prompts, rows_label,
                                             training_prompts)

__all__ = ["DATASETS_DIR", "EVAL_ROWS", "MIN_RESPONSE_TOKENS", "SAMPLING", "SPLITS", "TOO_LONG", "Prompt",
           "PromptLike", "PromptSplit", "assert_disjoint_from_eval", "capture_features", "dataset_files",
           "eval_prompts", "feature_columns", "generate_responses", "meta_path", "read_responses", "rows_label",
           "sampling_params", "training_prompts"]
