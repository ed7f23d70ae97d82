"""The torch backend against ONNX Runtime: same outputs, same cache semantics, and `specrt compare`."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specrt import artifact as io
from specrt.artifact import ExportSettings, load_manifest
from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.runtime.backends import infer, load_runner
from specrt.tools.compare import compare_artifact, compare_outputs, parse_backends, random_feeds

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
ATOL = 1e-4  # fp32
# kind, tie, DSpark head (None: the family has no DSpark layout), MTP (own head, feedback)
CASES = {"llama": ("llama", True, dict(head_type="gated", markov_rank=16, confidence=True), (False, "post")),
         "llama_untied_dflash": ("llama", False, dict(markov_rank=0, confidence=False), (True, "pre")),
         "qwen2": ("qwen2", True, None, (True, "post")),
         "qwen3": ("qwen3", False, dict(head_type="rnn", markov_rank=16, confidence=True), (False, "pre"))}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny graphs: one thread is fastest and leaves the other cores alone; restore torch's setting after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def arts(tiny_model_dir, tmp_path_factory):
    """case name -> artifact with the case's heads (made on first use)."""
    made: dict[str, Path] = {}
    settings = ExportSettings(batch=4, max_seq=64, prefill_chunk=8, verify_len=4)

    def make(case: str) -> Path:
        if case not in made:
            root = tmp_path_factory.mktemp(f"backends_{case}")
            if case == "fixture":
                made[case] = export_artifact(FIXTURE / "target", root / "art", settings, draft=FIXTURE / "draft",
                                             progress=False)
                return made[case]
            kind, tie, dspark, (own_head, feedback) = CASES[case.removesuffix("_fp16")]
            target = tiny_model_dir(kind, tie=tie, num_layers=3)
            draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, **dspark) \
                if dspark is not None else None
            mtp = random_mtp_checkpoint(root / "mtp", target, own_head=own_head)
            dtype = "float16" if case.endswith("_fp16") else "float32"
            made[case] = export_artifact(target, root / "art", replace(settings, dtype=dtype), draft=draft, mtp=mtp,
                                         mtp_feedback=feedback, progress=False)
        return made[case]

    return make


def runners(art: Path, family: str, slots: int = 4) -> dict:
    m = load_manifest(art)
    out = {b: load_runner(b, art, m, family, threads=1) for b in ("ort", "torch")}
    for r in out.values():
        r.allocate(slots)
    return out


@pytest.mark.parametrize("case", [*CASES, "fixture"])
def test_every_family_agrees_with_ort(arts, case):
    """Every family, every bucket use (largest bucket), two calls (the second reads the cache)."""
    art = arts(case)
    result = compare_artifact(art, ("ort", "torch"), atol=ATOL, threads=1)
    worst = max(result.diffs, key=lambda d: d.max_abs)
    assert result.ok, [d for d in result.diffs if not d.ok]
    assert worst.max_abs < ATOL
    families = {d.family for d in result.diffs}
    assert families == set(load_manifest(art).graphs)
    assert {(d.family, d.use) for d in result.diffs} >= {("target", "prefill"), ("target", "decode"),
                                                         ("target", "verify")}
    assert all(d.mismatches == 0 for d in result.diffs)  # no near ties on these seeds: tokens identical


def test_float16_agrees_with_ort(arts):
    """A float16 export: the torch modules in half precision, the DSpark context and rope in fp32 like the graphs."""
    result = compare_artifact(arts("qwen3_fp16"), ("ort", "torch"), threads=1)
    assert result.atol == 5e-2 and result.ok, [d for d in result.diffs if not d.ok]
    assert {d.family for d in result.diffs} == {"target", "dspark", "mtp"}


@pytest.mark.parametrize("family", ["target", "dspark", "mtp"])
def test_cache_matches_ort_in_place(arts, family):
    """Three calls of different buckets on both backends leave identical caches, written in place."""
    art = arts("llama")
    m, rs = load_manifest(art), runners(art, family)
    torch_runner = rs["torch"]
    before = [(k.ctypes.data, v.ctypes.data) for k, v in torch_runner.cache]
    rng = np.random.default_rng(1)
    start = np.array([3])
    spec = m.graphs[family]
    for use in ("prefill", *[u for u in spec.buckets if u != "prefill"]):
        bucket = spec.bucket(use, B=1)
        feeds, start = random_feeds(m, family, bucket, 1, rng, start)
        outs = {b: dict(infer(r, 2, feeds)) for b, r in rs.items()}
        for name, ref in outs["ort"].items():
            np.testing.assert_allclose(outs["torch"][name], ref, atol=ATOL, rtol=0, err_msg=f"{use} {name}")
    assert [(k.ctypes.data, v.ctypes.data) for k, v in torch_runner.cache] == before  # never reallocated
    for (tk, tv), name in zip(torch_runner.cache, [t.name for t in spec.cache_inputs()][::2]):
        ok, ov = rs["ort"]._cache[name], rs["ort"]._cache[name.replace(".key", ".value")]
        np.testing.assert_allclose(tk, ok, atol=ATOL, rtol=0)
        np.testing.assert_allclose(tv, ov, atol=ATOL, rtol=0)
        assert np.abs(tk[2]).sum() > 0 and not tk[[0, 1, 3]].any()  # only slot 2 was written


def test_slot_offsets(arts):
    """A call on slots 1..2 of 4 writes only their cache rows and reads only them."""
    art = arts("qwen3")
    m = load_manifest(art)
    rs = runners(art, "target")
    r = rs["torch"]
    bucket = m.graphs["target"].bucket("decode", B=2)
    feeds, start = random_feeds(m, "target", bucket, 1, np.random.default_rng(0), np.array([0, 5]))
    out = {b: dict(infer(x, 1, feeds)) for b, x in rs.items()}
    np.testing.assert_allclose(out["torch"][io.LOGITS], out["ort"][io.LOGITS], atol=ATOL, rtol=0)
    for k, v in r.cache:
        assert not k[0].any() and not v[0].any() and not k[3].any()
        assert k[1, :, 0].any() and k[2, :, 5].any() and not k[1, :, 1:].any()
    # the same call on slots 0..1 of a fresh runner (an empty cache there too) gives the same outputs
    fresh = runners(art, "target")["torch"]
    np.testing.assert_array_equal(dict(infer(fresh, 0, feeds))[io.LOGITS], out["torch"][io.LOGITS])
    with pytest.raises(ValueError, match="outside the allocated"):
        r.inputs(3, bucket)


def test_buffers_are_made_once(arts):
    """inputs() hands out the same host buffers per (slot, bucket); allocate() of the same size keeps the cache."""
    art = arts("qwen2")
    m = load_manifest(art)
    r = load_runner("torch", art, m, "mtp", threads=1)
    r.allocate(2)
    bucket = m.graphs["mtp"].bucket("propose", B=2, C=2)
    feeds = r.inputs(0, bucket)
    assert r.inputs(0, bucket) is feeds and set(feeds) == {t.name for t in m.graphs["mtp"].host_inputs()}
    feeds[io.MTP_POSITIONS][:] = [[0, 1], [0, 1]]
    feeds[io.MTP_LAST_ROW][:] = 1
    out = r.run(0, bucket)
    assert set(out) == {io.DRAFT_TOKENS, io.DRAFT_LOGITS, io.DRAFT_PROBS}
    assert out[io.DRAFT_TOKENS].dtype == np.int64 and out[io.DRAFT_PROBS].dtype == np.float32
    cache = r.cache[0][0]
    r.allocate(2)
    assert r.cache[0][0].ctypes.data == cache.ctypes.data and cache.any()
    r.allocate(3)
    assert r.cache[0][0].shape[0] == 3 and not r.cache[0][0].any()


def test_the_ort_caches_are_zeroed_disjoint_views_of_one_block():
    """Each cache array is a zeroed, C-contiguous array of its shape and dtype, on its own cache lines, in one block
    that starts on a 2 MiB boundary; writing one leaves the others zero."""
    from specrt.runtime.backends.ort import HUGE_PAGE, _cache_block
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    tensors = [("past.0.key", (2, 3, 65, 64), f32), ("past.0.value", (2, 3, 65, 64), f32),
               ("past.1.key", (2, 1, 7, 5), f16), ("past.1.value", (2, 1, 7, 5), f16)]
    cache = _cache_block(tensors)
    assert list(cache) == [name for name, _, _ in tensors]
    starts = []
    for (name, shape, dtype), buf in zip(tensors, cache.values()):
        assert buf.shape == shape and buf.dtype == dtype and buf.flags.c_contiguous and buf.flags.writeable
        assert not buf.any() and buf.ctypes.data % 64 == 0
        starts.append((buf.ctypes.data, buf.ctypes.data + buf.nbytes))
    assert starts[0][0] % HUGE_PAGE == 0
    assert all(end <= nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))  # in order, none overlapping
    for buf in cache.values():
        buf[...] = 1
    assert all(buf.all() for buf in cache.values())
    cache["past.0.value"][...] = 0
    assert cache["past.0.key"].all() and cache["past.1.key"].all()


def test_truncated_weights_are_one_line_errors(arts, tmp_path):
    art = shutil.copytree(arts("qwen2"), tmp_path / "art")
    m = load_manifest(art)
    with open(art / io.WEIGHTS_FILE, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(SpecrtError, match="truncated"):
        load_runner("torch", art, m, "target")


def test_compare_cli(arts):
    art = str(arts("llama"))
    cli = CliRunner()
    res = cli.invoke(main, ["compare", art, "--threads", "1"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[1].split()[:3] == ["family", "use", "call"] and lines[-1].startswith("PASSED")
    assert any(line.split()[:2] == ["mtp", "propose"] for line in lines)
    res = cli.invoke(main, ["compare", art, "--threads", "1", "--json", "--bucket-seed", "3"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and report["reference"] == "ort" and report["seed"] == 3
    assert {r["family"] for r in report["results"]} == {"target", "dspark", "mtp"}
    res = cli.invoke(main, ["compare", art, "--threads", "1", "--atol", "0"])  # nothing is bit-exact
    assert res.exit_code == 1 and "backends disagree" in res.output
    assert res.output.strip().splitlines()[-1].startswith("specrt: error: backends disagree")
    for backends in ("ort,tensorrtx", "ort"):
        res = cli.invoke(main, ["compare", art, "--backends", backends])
        assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
        assert res.output.startswith("specrt: error:")
    with pytest.raises(SpecrtError, match="unknown backend 'x'"):
        parse_backends("torch,x")


def test_token_flips_only_pass_at_near_ties():
    """A greedy flip between two logits within atol is explained; later slots of that block are not compared."""
    logits = np.array([[[0.0, 1.0, 1.0000001, -1.0], [0.0, 0.0, 5.0, 0.0]]], np.float32)  # [B=1, K=2, V=4]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ref = {io.DRAFT_TOKENS: np.array([[2, 2]]), io.DRAFT_LOGITS: logits, io.DRAFT_PROBS: probs}
    feeds = {io.TEMPERATURE: np.zeros(1, np.float32), io.NOISE: np.zeros((1, 2), np.float32)}
    diverged = dict(ref, **{io.DRAFT_TOKENS: np.array([[1, 0]]), io.DRAFT_LOGITS: logits + [[[0], [9]]]})
    got = compare_outputs(ref, diverged, feeds, 1e-3)
    assert got[io.DRAFT_TOKENS] == (0.0, 2, 0, True) and got[io.DRAFT_LOGITS][3]  # slot 1 follows the flip
    wrong = dict(ref, **{io.DRAFT_TOKENS: np.array([[0, 2]])})  # logit 0.0 is no tie with 1.0000001
    assert compare_outputs(ref, wrong, feeds, 1e-3)[io.DRAFT_TOKENS] == (0.0, 1, 1, False)
    # sampled: token = #(cdf <= noise * total); cdf = .25 .5 .75 1 and noise .5 -> 2; 1 is a tie at .5, 0 is not
    flat = np.zeros((1, 2, 4), np.float32)
    ref = {io.DRAFT_TOKENS: np.array([[2, 2]]), io.DRAFT_LOGITS: flat, io.DRAFT_PROBS: np.full((1, 2, 4), 0.25)}
    feeds = {io.TEMPERATURE: np.ones(1, np.float32), io.NOISE: np.full((1, 2), 0.5, np.float32)}
    flips = dict(ref, **{io.DRAFT_TOKENS: np.array([[2, 1]])})
    assert compare_outputs(ref, flips, feeds, 1e-3)[io.DRAFT_TOKENS] == (0.0, 1, 0, True)
    flips = dict(ref, **{io.DRAFT_TOKENS: np.array([[0, 2]])})
    assert compare_outputs(ref, flips, feeds, 1e-3)[io.DRAFT_TOKENS] == (0.0, 1, 1, False)
