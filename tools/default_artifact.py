"""The demo's default artifact: the default model exported with default settings and its shipped heads, profiled
once, cached under the specrt cache directory."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from specrt import artifact as io
from specrt.configs.fetch import cache_dir
from specrt.configs.presets import heads_key, default_settings, preset_heads, resolve_model
from specrt.exporter.export import export_artifact
from specrt.runtime.profile import save_profile
from specrt.runtime.measure import measure


def default_artifact(*, progress: bool = True) -> Path:
    """The default model exported with default settings, cached under the specrt cache directory."""
    settings = default_settings()
    heads = preset_heads("smollm2")
    key = hashlib.sha256(json.dumps([asdict(settings), io.FORMAT_VERSION, io.MANIFEST_REVISION, io.GRAPHS_REVISION,
                                     heads_key(heads)]).encode()).hexdigest()
    art = cache_dir() / "artifacts" / f"smollm2-{key[:10]}"
    if (art / io.MANIFEST).is_file():
        return art
    export_artifact(resolve_model("smollm2", progress=progress), art, settings, progress=progress, **heads)
    # the cost table the default scheduler (sps) reads, measured once on this machine, carefully (as `specrt
    # export` does): the runtime refines it online, but it decides the first rounds
    save_profile(art, measure(art, progress=progress))
    return art
