"""`specrt distill` end to end on a tiny target, the compact checkpoints it writes, and multi-set `specrt bench`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from specrt import artifact as io
from specrt.cli import main
from specrt.distill.generate import read_responses
from specrt.exporter.vocab import COUNTS_FILE, read_counts
from specrt.exporter.loaders import load_target
from specrt.exporter.loaders.deepspec import load_dspark
from specrt.exporter.loaders.mtp import load_mtp

WORDS = "the a cat dog sat ran on under mat log and then it was big small red blue".split()
STAGE_FILES = ("responses.jsonl", "cache/features.bin", "cache/manifest.json")


@pytest.fixture(scope="module")
def target(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny 4-layer llama with a word-level tokenizer and a chat template, so text prompts work."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("distill_target") / "model"
    shutil.copytree(tiny_model_dir("llama", num_layers=4), d)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>",
         "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return d


def prompts_file(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"turns": [" ".join(rng.choice(WORDS, int(rng.integers(3, 9))))]}) + "\n"
                            for _ in range(n)))
    return path


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


COMMON = ("--max-new-tokens", 20, "--gen-batch", 2, "--max-seq-len", 64, "--steps", 6, "--quiet", "--json")


@pytest.fixture(scope="module")
def distilled(target, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distill_run")
    prompts = prompts_file(root / "train.jsonl", 24, seed=0)
    work = root / "work"
    out = {"root": root, "work": work, "prompts": prompts, "dspark": root / "dspark", "mtp": root / "mtp"}
    r = invoke("distill", target, "--head", "dspark", "--prompts", prompts, "--out", out["dspark"], "--work", work,
               "--block", 3, "--markov-rank", 8, *COMMON)
    assert r.exit_code == 0, r.output
    out["dspark_report"] = json.loads(r.stdout)
    out["mtimes"] = {f: (work / f).stat().st_mtime_ns for f in STAGE_FILES}
    r = invoke("distill", target, "--head", "mtp", "--prompts", prompts, "--out", out["mtp"], "--work", work, *COMMON)
    assert r.exit_code == 0, r.output
    out["mtp_report"] = json.loads(r.stdout)
    return out


def test_dspark_checkpoint_is_compact_calibrated_and_reported(target, distilled):
    ck, report = distilled["dspark"], distilled["dspark_report"]
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["block_size"] == 3 and cfg["markov_rank"] == 8 and cfg["dtype"] == "bfloat16"
    assert len(cfg["confidence_temperatures"]) == 3 and min(cfg["confidence_temperatures"]) > 0
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names and "fc.weight" in names
    tcfg = load_target(target).config
    loaded = load_dspark(ck, tcfg)
    assert set(loaded.shared) == {"embed_tokens.weight", "lm_head.weight"}
    assert loaded.config.confidence_temperatures == tuple(cfg["confidence_temperatures"])
    assert report["head"] == "dspark" and report["train"]["steps"] == 6
    assert len(report["train"]["loss_curve"]) == 6 and report["train"]["evals"][0]["step"] == 0
    assert report["tau"]["untrained"] >= 1.0 and report["tau"]["trained"] >= 1.0
    cal = report["calibration"]
    assert len(cal["temperatures"]) == len(cal["ece_before"]) == len(cal["ece_after"]) == 3
    assert report["prompts"]["train"] + report["prompts"]["calib"] == 24
    assert set(report["seconds"]) == {"target", "generate", "features", "train", "save", "calibrate", "total"}
    assert report["checkpoint_bytes"] == sum(f.stat().st_size for f in ck.iterdir() if f.name not in ("report.json", ".specrt-output.json"))
    assert json.loads((ck / "report.json").read_text())["tau"] == report["tau"]
    counts = read_counts(ck / COUNTS_FILE, tcfg.vocab_size)  # the train responses' tokens, for --draft-vocab
    rows = read_responses(distilled["work"] / "responses.jsonl")
    assert counts.sum() == report["token_counts"]["tokens"] > 0
    assert counts.sum() < sum(len(r["response_ids"]) for r in rows)  # calib responses are not counted
    # the estimate up front: the prompts' tokens as generation prefilled them, at most max-new-tokens each, timed calls
    est = report["estimate"]
    assert est["prompts"] == 24 and est["generate_tokens"] == 24 * 20 and est["train_steps"] == 6
    assert est["prompt_tokens"] == sum(len(r["prompt_ids"]) for r in rows)
    assert est["feature_tokens"] == est["prompt_tokens"] + 24 * 20
    assert est["slots"] == 2 and est["step_ms"] > 0 and est["prefill_tok_s"] > 0
    assert est["generate_s"] > 0 and est["features_s"] > 0


def test_mtp_reuses_the_work_dir_and_saves_bf16(target, distilled):
    work = distilled["work"]
    assert {f: (work / f).stat().st_mtime_ns for f in STAGE_FILES} == distilled["mtimes"]
    report = distilled["mtp_report"]
    assert report["head"] == "mtp" and report["calibration"] is None
    # the resumed stage only checks the finished responses: it adds far less than generating them again
    before = distilled["dspark_report"]["seconds"]["generate"]
    assert report["seconds"]["generate"] - before < 0.5 * before + 0.2
    with safe_open(str(distilled["mtp"] / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(n).get_dtype()) for n in f.keys()} == {"BF16"}
    loaded = load_mtp(distilled["mtp"], load_target(target).config)
    assert not loaded.config.has_own_embed and not loaded.config.has_own_head


def test_more_responses_per_prompt_reuse_the_first_and_train_on_all(target, distilled, tmp_path):
    """--responses-per-prompt 2 keeps the greedy responses.jsonl of an earlier run, samples a second response per
    prompt with DeepSpec's sampling, and trains, calibrates and counts tokens on both, split by prompt."""
    work = tmp_path / "work"
    shutil.copytree(distilled["work"], work, ignore=shutil.ignore_patterns("train-*", "timings.json"))
    first = (work / "responses.jsonl").read_bytes()
    single_cache = (work / "cache" / "features.bin").stat().st_mtime_ns
    r = invoke("distill", target, "--head", "dspark", "--prompts", distilled["prompts"], "--out", tmp_path / "ck",
               "--work", work, "--block", 3, "--markov-rank", 8, "--responses-per-prompt", 2, *COMMON)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert (work / "responses.jsonl").read_bytes() == first  # generated once, by the earlier run
    assert (work / "cache" / "features.bin").stat().st_mtime_ns == single_cache  # an MTP run after still has it
    greedy, sampled = read_responses(work / "responses.jsonl"), read_responses(work / "responses.1.jsonl")
    assert len(greedy) == len(sampled) == 24
    by_index = {int(row["index"]): row for row in sampled}
    assert all(by_index[int(g["index"])]["prompt_ids"] == g["prompt_ids"] for g in greedy)
    assert sum(by_index[int(g["index"])]["response_ids"] != g["response_ids"] for g in greedy) >= 12
    merged = read_responses(work / "responses.x2.jsonl")
    assert [(row["sample"], row["index"]) for row in merged] == [(k, k * 24 + i) for k in (0, 1) for i in range(24)]
    gen = report["cache"]["generation"]
    assert gen[0]["temperature"] == 0.0 and gen[1]["temperature"] == 0.7
    manifest = json.loads((work / "cache.x2" / "manifest.json").read_text())
    prompt_of = [p["index"] % 24 for p in manifest["provenance"]]
    calib = {prompt_of[i] for i in manifest["splits"]["calib"]}
    train = {prompt_of[i] for i in manifest["splits"]["train"]}
    assert calib and train and not calib & train  # both samples of a prompt sit in its split
    assert len(manifest["splits"]["calib"]) == 2 * len(calib)
    assert report["prompts"]["train"] + report["prompts"]["calib"] == 24
    assert report["token_counts"]["tokens"] > distilled["dspark_report"]["token_counts"]["tokens"]


def test_distill_trains_on_responses_generated_before(target, distilled, tmp_path):
    """--responses: a work dir's responses and a committed-style copy (gzip'd, `<name>.meta.json`) of them, checked
    against the target, renumbered into one file and split by prompt (a prompt's rows on one side); a file another
    model generated, or without its settings, is refused in one line."""
    import gzip

    src = distilled["work"] / "responses.jsonl"
    copy = tmp_path / "corpus" / "base-greedy-20.jsonl.gz"
    copy.parent.mkdir()
    copy.write_bytes(gzip.compress(src.read_bytes()))
    meta = json.loads((distilled["work"] / "responses.jsonl.meta.json").read_text())
    (tmp_path / "corpus" / "base-greedy-20.meta.json").write_text(json.dumps(meta))
    work = tmp_path / "work"
    r = invoke("distill", target, "--head", "dspark", "--responses", src, "--responses", copy, "--out",
               tmp_path / "ck", "--work", work, "--block", 3, "--markov-rank", 8, *COMMON)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    rows = read_responses(work / "responses.given.jsonl")
    assert [row["index"] for row in rows] == list(range(48))
    manifest = json.loads((work / "cache.given" / "manifest.json").read_text())
    prompt_of = {row["index"]: row["prompt"] for row in rows}
    train = {prompt_of[p["index"]] for i, p in enumerate(manifest["provenance"]) if i in manifest["splits"]["train"]}
    calib = {prompt_of[p["index"]] for i, p in enumerate(manifest["provenance"]) if i in manifest["splits"]["calib"]}
    assert train and calib and not train & calib
    assert report["prompts"]["train"] + report["prompts"]["calib"] == 48
    assert report["estimate"]["generate_tokens"] == 0 and report["estimate"]["feature_tokens"] == sum(
        len(row["prompt_ids"]) + len(row["response_ids"]) for row in rows)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(src.read_bytes())
    (tmp_path / "foreign.jsonl.meta.json").write_text(json.dumps(dict(meta, target_sources=["0" * 64])))
    bare = tmp_path / "bare.jsonl"
    bare.write_bytes(src.read_bytes())
    for args, message in ((("--responses", foreign), "was generated by another model"),
                          (("--responses", bare), "has no generation settings beside it"),
                          (("--responses", bare, "--prompts", distilled["prompts"]), "not both"),
                          ((), "give at least one --prompts")):
        r = invoke("distill", target, "--head", "mtp", *args, "--out", tmp_path / "ck2", "--work", tmp_path / "w2",
                   "--quiet")
        assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "ck2").exists() and not (tmp_path / "w2").exists()


def test_distilled_heads_export_and_bench_identically(target, distilled, tmp_path):
    art = tmp_path / "art"
    r = invoke("export", target, "--out", art, "--draft", distilled["dspark"], "--mtp", distilled["mtp"],
               "--batch", 1, "--max-seq-len", 96, "--prefill-chunk", 8, "--quiet")
    assert r.exit_code == 0, r.output
    manifest = io.load_manifest(art)
    temperatures = json.loads((distilled["dspark"] / "config.json").read_text())["confidence_temperatures"]
    assert list(manifest.heads["dspark"].temperatures) == temperatures  # typed: the STS temperatures per position
    assert manifest.heads["dspark"].config["confidence_temperatures"] == temperatures
    a = prompts_file(tmp_path / "set_a.jsonl", 3, seed=5)
    b = prompts_file(tmp_path / "set_b.jsonl", 2, seed=6)
    plot = tmp_path / "plot.png"
    r = invoke("bench", art, "--prompts", a, "--prompts", b, "--methods", "dspark,mtp", "--max-new-tokens", 16,
               "--scheduler", "fixed", "--plot", plot, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["identical"] and report["prompts"] == 5
    assert [(row["dataset"], row["method"]) for row in report["results"]] == \
        [(s, m) for s in ("set_a", "set_b") for m in ("ar", "dspark", "mtp")]
    for row in report["results"]:
        assert {"method", "tokens_per_s", "speedup"} <= set(row)
        if row["method"] != "ar":
            assert row["tau"] >= 1.0 and len(row["per_position_acceptance"]["conditional"]) == 3
    pooled = {row["method"]: row for row in report["pooled"]}
    by_set = [row for row in report["results"] if row["method"] == "dspark"]
    assert pooled["dspark"]["rounds"] == sum(row["rounds"] for row in by_set)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["plot"] == str(plot)


@pytest.mark.parametrize("args, message", [
    (("--prompts", "nope.jsonl"), "prompts file not found: nope.jsonl"),
    (("--steps", "0"), "--steps must be >= 1"),
    (("--max-new-tokens", "64", "--max-seq-len", "64"), "leaves no room for a prompt"),
    (("--head", "mtp", "--layers", "2"), "exactly one layer"),
    (("--head", "mtp", "--objective", "greedy"), "is for --head dspark"),
    (("--weights", "gguf"), "is not a GGUF file"),
    (("--backend", "ort", "--device", "cuda"), "runs the target on the torch backend"),
    (("--device", "tpu"), "unknown device 'tpu'"),
])
def test_distill_bad_input_is_one_line(target, distilled, tmp_path, args, message):
    base = {"--head": "dspark", "--prompts": str(distilled["prompts"]), "--steps": "2", "--max-new-tokens": "8",
            "--max-seq-len": "64", "--gen-batch": "2"}
    it = iter(args)
    base.update(dict(zip(it, it)))
    out = tmp_path / "ck"
    r = invoke("distill", target, "--out", out, "--work", tmp_path / "w", "--quiet",
               *[x for kv in base.items() for x in kv])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_distill_refuses_existing_out_and_foreign_work(target, distilled, tiny_model_dir, tmp_path):
    r = invoke("distill", target, "--head", "mtp", "--prompts", distilled["prompts"], "--out", distilled["mtp"],
               "--work", distilled["work"], *COMMON)
    assert r.exit_code == 1 and "already exists; pass --force" in r.output
    other = tmp_path / "other"
    shutil.copytree(target, other)
    r = invoke("distill", other, "--head", "mtp", "--prompts", distilled["prompts"], "--out", tmp_path / "ck",
               "--work", distilled["work"], *COMMON)
    assert r.exit_code == 1 and "was made for another target" in r.output


def test_bench_plot_needs_png_and_speculative_method(target, distilled, tmp_path):
    r = invoke("bench", tmp_path / "missing", "--prompts", distilled["prompts"], "--plot", tmp_path / "x.svg")
    assert r.exit_code == 1 and "PNG" in r.output


def test_distill_a_gguf_file_end_to_end(tmp_path):
    """`specrt distill MODEL.gguf`: a GGUF file the project never saw (a random llama written here, byte-level BPE and
    a chat template in the file) gets a head, reports each stage and its estimate, and the head exports beside that
    file's target and decodes as plain decoding does."""
    from test_llama_cpp import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "mine.gguf", seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"the {w} and then"]}) + "\n" for w in WORDS))
    out = tmp_path / "head"
    r = invoke("distill", gguf, "--head", "dspark", "--prompts", prompts, "--out", out, "--work", tmp_path / "work",
               "--block", 3, "--markov-rank", 8, *COMMON)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["estimate"]["generate_tokens"] > 0 and report["token_counts"]["tokens"] > 0
    art = tmp_path / "art"
    r = invoke("export", gguf, "--out", art, "--draft", out, "--batch", 1, "--max-seq-len", 96, "--prefill-chunk", 8,
               "--quiet")
    assert r.exit_code == 0, r.output
    r = invoke("bench", art, "--prompts", prompts, "--limit", 3, "--methods", "dspark", "--max-new-tokens", 16,
               "--scheduler", "fixed", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["identical"]


def test_distill_on_the_torch_backend_gives_the_onnx_runtime_responses(target, distilled, tmp_path):
    """`--backend torch` (what `--device cuda` runs; here on the CPU): the target generates and gives features on
    the exporter's torch modules, the same greedy responses as ONNX Runtime's and features within float rounding of
    them; the cache records where it was captured, so it is neither resumed nor reused by a run elsewhere."""
    from specrt.distill.cache import TargetCache

    work = tmp_path / "work"
    r = invoke("distill", target, "--head", "mtp", "--prompts", distilled["prompts"], "--out", tmp_path / "mtp",
               "--work", work, "--backend", "torch", *COMMON)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["backend"] == "torch"
    assert read_responses(work / "responses.jsonl") == read_responses(distilled["work"] / "responses.jsonl")
    mine, theirs = TargetCache(work / "cache"), TargetCache(distilled["work"] / "cache")
    assert mine.manifest["backend"] == "torch:cpu" and "backend" not in theirs.manifest
    np.testing.assert_array_equal(mine.tokens, theirs.tokens)
    np.testing.assert_allclose(np.asarray(mine.features, np.float32), np.asarray(theirs.features, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_distill_on_a_gpu_that_is_not_there_is_one_line(target, distilled, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --device cuda is valid here")
    r = invoke("distill", target, "--head", "mtp", "--prompts", distilled["prompts"], "--out", tmp_path / "ck",
               "--work", tmp_path / "w", "--device", "cuda", "--quiet")
    assert r.exit_code == 1 and "no CUDA GPU is visible" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "ck").exists() and not (tmp_path / "w").exists()
