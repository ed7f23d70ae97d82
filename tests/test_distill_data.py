"""Distillation data: eval-disjoint prompt splits, resumable response generation, feature capture vs torch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.distill import features as features_mod
from specrt.distill.cache import TargetCache
from specrt.distill.data import (EVAL_ROWS, TOO_LONG, Prompt, PromptSplit, assert_disjoint_from_eval,
                                          capture_features, eval_prompts, generate_responses, read_responses,
                                          training_prompts)
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders import load_target
from specrt.models.llama import Transformer

SETTINGS = io.ExportSettings(batch=2, max_seq=64, prefill_chunk=8, verify_len=2)
SOURCES = (-1, 0, "final")  # tiny llama has 2 layers: embedding output, layer 0, final-normed hidden


@pytest.fixture(scope="module")
def arts(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama exported with the feature sources ("feat") and without ("plain")."""
    model = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("distill_arts")
    return {"model": model,
            "feat": export_artifact(model, root / "feat", SETTINGS, extra_features=SOURCES, progress=False),
            "plain": export_artifact(model, root / "plain", SETTINGS, progress=False)}


def id_prompts(n: int, seed: int = 0) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    return [Prompt("tiny", r, ids=tuple(int(t) for t in rng.integers(3, 256, int(rng.integers(4, 13)))))
            for r in range(n)]


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# -- prompt splits -------------------------------------------------------------------------------------


def test_splits_disjoint_from_eval_and_deterministic():
    split = training_prompts()
    evals = eval_prompts()
    eval_texts = {t for ts in evals.values() for t in ts}
    assert set(evals) == {"gsm8k", "humaneval", "math500", "mbpp", "mt-bench"}
    assert all(p.row >= EVAL_ROWS and p.text not in eval_texts for p in split.prompts)
    assert not set(split.train) & set(split.calib)
    assert sorted(split.train + split.calib) == list(range(len(split.prompts)))
    assert 0.08 < len(split.calib) / len(split.prompts) < 0.12
    assert training_prompts() == split
    small = training_prompts(limit=50, seed=3)
    assert len(small.prompts) == 50 and small == training_prompts(limit=50, seed=3)
    assert {f: sum(p.file == f for p in small.prompts) for f in evals} == dict.fromkeys(evals, 10)
    assert small != training_prompts(limit=50, seed=4)
    with pytest.raises(SpecrtError, match="eval rows"):
        assert_disjoint_from_eval(PromptSplit((Prompt("gsm8k", 3, text="x"),), (0,), ()))


def test_explicit_prompt_files_drop_eval_duplicates(tmp_path):
    ds = tmp_path / "datasets"
    ds.mkdir()
    (ds / "a.jsonl").write_text("".join(json.dumps({"turns": [f"a{i}"]}) + "\n" for i in range(5)))
    mine = tmp_path / "mine.jsonl"  # row 1 repeats an eval row of a.jsonl: it must not be trained on
    mine.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("m0", "a1", "m2", "a4")))
    split = training_prompts(ds, prompt_files=[mine], eval_rows=2, calib_fraction=0.0)
    assert [(p.file, p.row, p.text) for p in split.prompts] == [(str(mine), 0, "m0"), (str(mine), 2, "m2"),
                                                                (str(mine), 3, "a4")]
    both = training_prompts(ds, files=["a"], prompt_files=[mine], eval_rows=2, calib_fraction=0.0)
    assert [p.text for p in both.prompts] == ["a2", "a3", "a4", "m0", "m2", "a4"]


# -- stage a: responses ---------------------------------------------------------------------------


def test_generate_resumes_without_duplicates(arts, tmp_path):
    prompts = [*id_prompts(6), Prompt("tiny", 6, ids=tuple(range(3, 73)))]  # the last exceeds 63 positions
    whole = generate_responses(arts["feat"], prompts, tmp_path / "whole.jsonl", max_new_tokens=12, progress=False)
    part = tmp_path / "part.jsonl"
    generate_responses(arts["feat"], prompts[:3], part, max_new_tokens=12, progress=False)
    with open(part, "a") as f:  # an interrupted write
        f.write('{"index": 3, "file": "tiny", "row"')
    assert [r["index"] for r in read_responses(part)] == [0, 1, 2]
    generate_responses(arts["feat"], prompts, part, max_new_tokens=12, progress=False)
    generate_responses(arts["feat"], prompts, part, max_new_tokens=12, progress=False)  # nothing left to do
    a, b = lines(whole), lines(part)
    assert sorted(r["index"] for r in b) == list(range(7))
    assert sorted(a, key=lambda r: r["index"]) == sorted(b, key=lambda r: r["index"])
    for r in a:
        p = prompts[r["index"]]
        assert (r["file"], r["row"], r["prompt_ids"]) == ("tiny", p.row, list(p.ids))
        if r["index"] == 6:
            assert r["finish_reason"] == TOO_LONG and r["response_ids"] == []
        else:
            assert 1 <= len(r["response_ids"]) <= 12 and r["finish_reason"] in ("eos", "length")
    with pytest.raises(SpecrtError, match="other settings"):
        generate_responses(arts["feat"], prompts, part, max_new_tokens=12, sampling="deepspec", progress=False)
    with pytest.raises(SpecrtError, match="another prompt list"):
        generate_responses(arts["feat"], id_prompts(7, seed=1), part, max_new_tokens=12, progress=False)


# -- stage b: features ----------------------------------------------------------------------------


def torch_features(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The oracle: concatenated raw layer outputs (-1, 0) and the final-normed hidden from the torch module."""
    target = load_target(model_dir)
    model = Transformer.from_weights(target.config, target.weights)
    model.setup_caches(1, SETTINGS.max_seq)
    with torch.no_grad():
        _, hidden, caps = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.long),
                                capture_layers=[-1, 0])
    return torch.cat([*caps, hidden], dim=-1)[0].numpy()


def write_responses(path: Path, shapes: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = [{"index": i, "file": "tiny", "row": i, "prompt_ids": rng.integers(3, 256, p).tolist(),
             "response_ids": rng.integers(3, 256, r).tolist(), "finish_reason": "length"}
            for i, (p, r) in enumerate(shapes)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_captured_features_match_torch(arts, tmp_path):
    # (prompt, response) lengths: chunk-aligned, ragged, too short (dropped), too long (dropped), one token
    rows = write_responses(tmp_path / "r.jsonl", [(5, 11), (7, 20), (6, 3), (40, 30), (1, 8)])
    cache_dir = capture_features(arts["feat"], tmp_path / "r.jsonl", tmp_path / "cache", feature_sources=SOURCES,
                                 splits={"train": [0, 1, 2, 3], "calib": [4]}, progress=False)
    cache = TargetCache(cache_dir)
    m = cache.manifest
    assert m["counts"] == {"responses": 5, "kept": 3, "dropped_short": 1, "dropped_too_long": 1,
                           "min_response_tokens": 8}
    assert m["splits"] == {"train": [0, 1], "calib": [2]}
    assert [p["index"] for p in m["provenance"]] == [0, 1, 4]
    assert m["feature_sources"] == list(SOURCES) and m["hidden_size"] == 64 and len(cache) == 3
    for sample, r in zip((cache[i] for i in range(3)), (rows[0], rows[1], rows[4])):
        ids = r["prompt_ids"] + r["response_ids"]
        assert sample.ids.tolist() == ids and sample.prompt_len == len(r["prompt_ids"])
        assert sample.features.shape == (len(ids), 3 * 64) and sample.features.dtype == np.float16
        assert sample.loss_mask.sum() == len(r["response_ids"])
        np.testing.assert_allclose(sample.features.astype(np.float32), torch_features(arts["model"], ids),
                                   rtol=1e-3, atol=1e-3)
    final = cache.feature_slice(["final"])
    assert (final.start, final.stop) == (128, 192)


def test_generated_cache_and_resume(arts, tmp_path, monkeypatch):
    prompts = id_prompts(5, seed=2)
    out = generate_responses(arts["feat"], prompts, tmp_path / "r.jsonl", max_new_tokens=10, progress=False)
    responses = {r["index"]: r for r in lines(out)}
    split = {"train": [0, 1, 2], "calib": [3, 4]}
    path = capture_features(arts["feat"], out, tmp_path / "cache", feature_sources=[0, "final"], splits=split,
                            min_response_tokens=1, progress=False)
    cache = TargetCache(path)
    assert cache.manifest["generation"]["sampling"] == "greedy"
    assert cache.split("train") == [0, 1, 2] and cache.split("calib") == [3, 4]
    for n, prov in enumerate(cache.manifest["provenance"]):
        r = responses[prov["index"]]
        assert cache[n].prompt_len == len(prompts[prov["index"]].ids) == len(r["prompt_ids"])
        assert len(cache[n].ids) == len(r["prompt_ids"]) + len(r["response_ids"])
    # The stage is cached: same responses, target and sources -> no graph runs; new splits are rewritten.
    monkeypatch.setattr(features_mod, "_FeatureReader", None)
    again = capture_features(arts["feat"], out, tmp_path / "cache", feature_sources=[0, "final"],
                             splits={"train": [4], "calib": [0]}, min_response_tokens=1, progress=False)
    assert again == path and TargetCache(again).split("train") == [4] and TargetCache(again).split("calib") == [0]
    with pytest.raises(TypeError):  # other sources -> recomputed (here: the patched-out reader is called)
        capture_features(arts["feat"], out, tmp_path / "cache", feature_sources=[-1], splits=split,
                         min_response_tokens=1, progress=False)


def test_an_interrupted_capture_resumes_after_its_last_whole_sample(arts, tmp_path, monkeypatch):
    """A capture interrupted after its third sample (Ctrl-C) keeps what it wrote; the next capture of the same inputs
    computes only the rest, and the cache is the uninterrupted capture's, byte for byte. Other inputs start over."""
    prompts = id_prompts(6, seed=4)
    out = generate_responses(arts["feat"], prompts, tmp_path / "r.jsonl", max_new_tokens=8, progress=False)
    split = {"train": [0, 1, 2, 3], "calib": [4, 5]}
    whole = capture_features(arts["feat"], out, tmp_path / "whole", feature_sources=[0, "final"], splits=split,
                             min_response_tokens=1, progress=False)
    read = features_mod._FeatureReader.read
    calls = []

    def interrupted(self, ids):
        calls.append(len(ids))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return read(self, ids)

    monkeypatch.setattr(features_mod._FeatureReader, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        capture_features(arts["feat"], out, tmp_path / "cache", feature_sources=[0, "final"], splits=split,
                         min_response_tokens=1, progress=False)
    assert not (tmp_path / "cache").exists() and (tmp_path / ".cache.partial").is_dir()
    calls.clear()
    monkeypatch.setattr(features_mod._FeatureReader, "read", lambda self, ids: calls.append(len(ids)) or read(self, ids))
    path = capture_features(arts["feat"], out, tmp_path / "cache", feature_sources=[0, "final"], splits=split,
                            min_response_tokens=1, progress=False)
    assert len(calls) == 3 and not (tmp_path / ".cache.partial").exists()
    for name in ("features.bin", "tokens.npy", "samples.npy"):
        assert (path / name).read_bytes() == (whole / name).read_bytes(), name
    assert TargetCache(path).manifest["capture"]["resumed_after_samples"] == 3
    # a partial capture of other inputs (here: other feature sources) is not resumed
    monkeypatch.setattr(features_mod._FeatureReader, "read", interrupted)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        capture_features(arts["feat"], out, tmp_path / "other", feature_sources=[0], splits=split,
                         min_response_tokens=1, progress=False)
    calls.clear()
    monkeypatch.setattr(features_mod._FeatureReader, "read", lambda self, ids: calls.append(len(ids)) or read(self, ids))
    capture_features(arts["feat"], out, tmp_path / "other", feature_sources=[0, "final"], splits=split,
                     min_response_tokens=1, progress=False)
    assert len(calls) == 6


def test_artifact_without_features_is_rejected(arts, tmp_path):
    write_responses(tmp_path / "r.jsonl", [(5, 11)])
    with pytest.raises(SpecrtError, match="extra_features"):
        capture_features(arts["plain"], tmp_path / "r.jsonl", tmp_path / "c", feature_sources=SOURCES,
                         splits={"train": [0]}, progress=False)
    with pytest.raises(SpecrtError, match=r"needs \[1\]"):
        capture_features(arts["feat"], tmp_path / "r.jsonl", tmp_path / "c", feature_sources=[1],
                         splits={"train": [0]}, progress=False)
    assert not (tmp_path / "c").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SpecrtError, match="not a target cache"):
        capture_features(arts["feat"], tmp_path / "r.jsonl", tmp_path / "mine", feature_sources=SOURCES,
                         splits={"train": [0]}, progress=False)
    assert (tmp_path / "mine" / "notes.txt").is_file()


def test_given_responses_hold_out_whole_prompts_of_every_file(tmp_path):
    """Responses generated before are split by prompt into train, calib and a held-out "val" drawn from every file's
    prompts (training evaluates on it; the tail of train would hold the last file's only): a prompt's responses, in
    any file, on one side."""
    from specrt.distill.generate import given_responses

    files = []
    for k, name in enumerate(("code", "chat")):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"index": i, "file": name, "row": i % 50, "prompt_ids": [1, 2],
                                         "response_ids": [3] * 9, "finish_reason": "eos"}) + "\n"
                             for i in range(100)))  # each prompt twice (a greedy and a sampled response)
        (tmp_path / f"{name}.jsonl.meta.json").write_text(json.dumps({"target_sources": ["a" * 64]}))
        files.append(f)
    out, splits = given_responses(files, tmp_path / "given.jsonl", target_sources=["a" * 64], calib_fraction=0.1,
                                  seed=0, val_fraction=0.2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompt = {r["index"]: r["prompt"] for r in rows}
    sides = {name: {prompt[i] for i in idx} for name, idx in splits.items()}
    assert sorted(splits) == ["calib", "train", "val"] and len(sides["val"]) == 20 and len(sides["calib"]) == 10
    assert not sides["val"] & sides["train"] and not sides["val"] & sides["calib"] and not sides["calib"] & sides["train"]
    assert {q.split(":")[0] for q in sides["val"]} == {"code", "chat"}
    assert sorted(i for idx in splits.values() for i in idx) == list(range(200))
    assert len(splits["val"]) == 2 * len(sides["val"])  # both responses of each held-out prompt
