"""Named models (`specrt export smollm2`), their shipped heads and export defaults (the demo's artifact is built
by specrt/tools/default_artifact.py)."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from specrt import artifact as io
from specrt import native
from specrt.errors import SpecrtError
from specrt.configs.fetch import PRESETS

# trained heads shipped with specrt (package data, in specrt/ beside artifact.py; not specrt.__file__, which a
# namespace package lacks: python -m specrt.cli from a folder holding a clone named specrt)
HEADS_DIR = Path(io.__file__).resolve().parent / "heads"


def preset_heads(name: str) -> dict[str, Path]:
    """The shipped draft heads of a preset: {"draft": DSpark dir, "mtp": MTP dir}, those that exist."""
    root = HEADS_DIR / name
    found = {"draft": root / "dspark", "mtp": root / "mtp"}
    return {k: v for k, v in found.items() if (v / "config.json").is_file()} if name in PRESETS else {}


def heads_key(heads: dict[str, Path]) -> list[str]:
    """Content hashes of the head files, so a retrained head gets a new cached artifact."""
    files = [(k, f) for k, d in sorted(heads.items()) for f in sorted(d.iterdir()) if f.suffix in (".json", ".safetensors")]
    files += [("counts", d.parent / "token_counts.npy") for k, d in sorted(heads.items())
              if k == "draft" and (d.parent / "token_counts.npy").is_file()]
    return [f"{k}:{hashlib.sha256(f.read_bytes()).hexdigest()[:16]}" for k, f in files]


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """A preset name (downloaded on first use) or an existing path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path](progress=progress)
    path = Path(name_or_path)
    try:
        found = path.exists()
    except OSError as e:  # e.g. a parent directory that cannot be read
        raise SpecrtError(f"cannot access {name_or_path}: {e.strerror or e}") from None
    if not found:
        raise SpecrtError(f"model not found: {name_or_path} (not a path, and not a preset: "
                          f"{', '.join(PRESETS)})")
    return path


# Export defaults of `specrt export` and the demo's cached artifact (written once, here).
EXPORT_DEFAULTS = io.ExportSettings(batch=4, max_seq=1024, prefill_chunk=64, verify_len=8)


# A preset's weight format and attention lowering when `specrt export` is not told: the fastest that keeps
# the exactness promise on ONNX Runtime's CPU (docs/cli.md, "Weight formats"): the published GGUF blocks as they
# are, through the cpu lowering (4-bit MatMulNBits, a runtime-sized cache). A TensorRT build wants
# `--weights float --attention standard`.
PRESET_FORMAT = {"weights": "gguf", "attention": "cpu"}
# With its shipped heads, a preset's drafts score the 2048 tokens most frequent in the heads' distillation data
# (FR-Spec; docs/speculation.md, "A smaller draft vocabulary": the draft call 0.22 instead of 1.09 decoding steps, same τ).
PRESET_DRAFT_VOCAB = io.DEFAULT_DRAFT_VOCAB


def preset_kernels() -> str:
    """A preset's kernels: specrt's (libspecrt_ops) where they are built, else ONNX Runtime's stock ops."""
    return "specrt" if native.available() else "stock"


def preset_format(name: str) -> dict[str, str]:
    """{"weights", "attention", "kernels"} defaults for exporting `name`: PRESET_FORMAT and `preset_kernels` for a
    preset or a GGUF file (its own blocks on specrt's kernels, as the preset's), else float/standard/stock."""
    if name in PRESETS or str(name).lower().endswith(".gguf"):
        return {**PRESET_FORMAT, "kernels": preset_kernels()}
    return {"weights": "float", "attention": "standard", "kernels": "stock"}


def default_settings() -> io.ExportSettings:
    """The demo's artifact: the export defaults in the preset's format, with its shipped heads."""
    return dataclasses.replace(EXPORT_DEFAULTS, **PRESET_FORMAT, kernels=preset_kernels(),
                               draft_vocab=PRESET_DRAFT_VOCAB)
