"""Named models (`specrt export smollm2`) and the demo's cached default artifact."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.exporter.fetch import PRESETS, cache_dir


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """A preset name (downloaded on first use) or an existing path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path](progress=progress)
    path = Path(name_or_path)
    if not path.exists():
        raise SpecrtError(f"model not found: {name_or_path} (not a path, and not a preset: "
                          f"{', '.join(PRESETS)})")
    return path


def default_settings() -> io.ExportSettings:
    return io.ExportSettings(batch=4, max_seq=1024, prefill_chunk=64, verify_len=8)


def default_artifact(*, progress: bool = True) -> Path:
    """The default model exported with default settings, cached under the specrt cache directory."""
    settings = default_settings()
    key = hashlib.sha256(json.dumps([asdict(settings), io.FORMAT_VERSION]).encode()).hexdigest()[:10]
    art = cache_dir() / "artifacts" / f"smollm2-{key}"
    if (art / io.MANIFEST).is_file():
        return art
    from specrt.exporter.export import export_artifact

    return export_artifact(resolve_model("smollm2", progress=progress), art, settings, progress=progress)
