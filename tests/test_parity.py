"""`specrt parity`: the artifact's target against transformers on the same source model."""
from __future__ import annotations

import numpy as np

from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine
from specrt.tools.parity import parity


def test_float_export_matches_transformers(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3")
    art = export_artifact(src, tmp_path / "art", ExportSettings(2, 96, 16, 5), progress=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 21)]
    with Engine(art, threads=1) as engine:
        report = parity(engine, prompts, max_new_tokens=12, source=src, threads=1, progress=False)
    assert report["weights"] in ("float", "fp32") and report["prompts"] == 2
    assert report["identical"] == 2 and report["first_divergence_min"] is None
    assert report["max_abs_logit_diff"] < 1e-3  # fp32 vs fp32: rounding only (the next test shows it is measured)
    assert all(r["generated"] == 12 and r["teacher_forced_argmax_divergence"] is None
               for r in report["per_prompt"])


def test_a_perturbed_artifact_diverges(tiny_model_dir, tmp_path):
    """Parity is measured, not assumed: scaling the artifact's LM head shows up in the report."""
    from safetensors.numpy import load_file, save_file

    src = tiny_model_dir("llama", tie=False)
    bent = tmp_path / "bent"
    bent.mkdir()
    for f in src.iterdir():
        (bent / f.name).write_bytes(f.read_bytes())
    w = load_file(bent / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] + np.random.default_rng(1).normal(size=w["lm_head.weight"].shape
                                                                                ).astype(np.float32)
    save_file(w, bent / "model.safetensors", metadata={"format": "pt"})
    art = export_artifact(bent, tmp_path / "art", ExportSettings(1, 96, 16, 5), progress=False)
    with Engine(art, threads=1) as engine:
        report = parity(engine, [[5, 6, 7, 8, 9]], max_new_tokens=12, source=src, threads=1, progress=False)
    assert report["max_abs_logit_diff"] > 0.1 and report["identical"] == 0
