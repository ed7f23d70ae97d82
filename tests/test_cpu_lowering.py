"""The cpu attention lowering (`--attention cpu`): ONNX Runtime on CPU, attention sized by the valid cache
length, fused norms. Every graph family must compute what the standard lowering computes, call after call,
and every decoding method must produce the standard export's tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specrt import artifact as io
from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.runtime.backends import infer, load_runner
from specrt.tools.compare import compare_outputs, random_feeds
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams
from test_export import TRT_OPS
from test_speculative import copy_mtp

ATOL = 1e-4
SETTINGS = dict(batch=4, max_seq=64, prefill_chunk=16, verify_len=5)
LOWERINGS = ("standard", "cpu")
CPU_OPS = {"RMSNormalization", "SkipSimplifiedLayerNormalization"}  # what the standard lowering never emits


@pytest.fixture(scope="module")
def arts(tiny_model_dir, tmp_path_factory):
    """(kind, lowering) -> artifact of one tiny target (3 layers) with a random DSpark head (block 4) and a
    copy-MTP head, gamma 4; both lowerings from the same checkpoints."""
    made: dict[tuple[str, str], Path] = {}
    heads: dict[str, tuple[Path, Path]] = {}

    def make(kind: str, lowering: str) -> Path:
        if (kind, lowering) not in made:
            target = tiny_model_dir(kind, num_layers=3)
            if kind not in heads:
                root = tmp_path_factory.mktemp(f"heads_{kind}")
                heads[kind] = (random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, markov_rank=16),
                               copy_mtp(random_mtp_checkpoint(root / "mtp_random", target), root / "mtp", target))
            draft, mtp = heads[kind]
            out = tmp_path_factory.mktemp(f"{kind}_{lowering}") / "art"
            made[kind, lowering] = export_artifact(target, out, ExportSettings(**SETTINGS, attention=lowering),
                                                   draft=draft, mtp=mtp, progress=False)
        return made[kind, lowering]

    return make


def _ops(art: Path) -> dict[str, set[str]]:
    m = io.load_manifest(art)
    # specrt::ConfidenceTruncate (its own domain) is a TensorRT plugin in either lowering: left out here
    return {g.name: {n.op_type for n in onnx.load(str(art / g.file), load_external_data=False).graph.node
                     if n.domain != "specrt"} for g in m.graphs.values()}


# -- settings, manifest, graph form --------------------------------------------------------------------------


def test_settings_accept_standard_and_cpu_only():
    assert ExportSettings(**SETTINGS, attention="cpu").attention == "cpu"
    with pytest.raises(SpecrtError, match="attention lowering"):
        ExportSettings(**SETTINGS, attention="gqa")


def test_manifest_records_the_lowering_and_only_cpu_graphs_change(arts):
    """The cpu graphs carry the fused norms, row scatters and a cache window (the heads: a Slice of it; the
    target: a cache of the axis S the runtime sizes); the standard ones stay TensorRT-parsable."""
    std, cpu = arts("llama", "standard"), arts("llama", "cpu")
    assert io.load_manifest(std).export.attention == "standard"
    assert io.load_manifest(cpu).export.attention == "cpu"
    for family, used in _ops(std).items():
        assert used <= TRT_OPS and not used & CPU_OPS, family
    for family, used in _ops(cpu).items():
        assert "RMSNormalization" in used, family
        model = onnx.load(str(cpu / f"{family}.onnx"), load_external_data=False)
        spec = io.load_manifest(cpu).graphs[family]
        slices = [n.name for n in model.graph.node if n.op_type == "Slice" and "/cache_window/" in n.name]
        if family == io.TARGET:
            assert spec.sized_cache and not slices
            assert all(t.shape[2] == io.CACHE_LEN for t in spec.cache_inputs())
        else:
            assert not spec.sized_cache and len(slices) >= len(spec.cache_inputs()), family  # every layer's k, v
        assert "SkipSimplifiedLayerNormalization" in used, family  # the post-attention residual add, fused
        if family != "dspark":  # the decoder-layer caches (target, MTP) are written a row of D at a time
            assert "ScatterND" in used and "ScatterElements" not in used, family


def test_cli_exports_the_cpu_lowering(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    args = ["export", str(tiny_model_dir("llama")), "--out", str(out), "--batch", "2", "--max-seq-len", "64",
            "--prefill-chunk", "16", "--attention", "cpu", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert io.load_manifest(out).export.attention == "cpu"
    assert "RMSNormalization" in _ops(out)["target"]
    result = CliRunner().invoke(main, ["export", str(tiny_model_dir("llama")), "--out", str(tmp_path / "x"),
                                       "--attention", "gqa"])
    assert result.exit_code != 0 and "gqa" in result.output


# -- numerical parity, call after call -----------------------------------------------------------------------


def _calls(spec: io.GraphSpec, slots: int, max_seq: int) -> list[tuple[str, int, io.Bucket, np.ndarray | None]]:
    """(use, first slot, bucket, forced start or None) in runtime order: each slot prefilled alone (odd slots
    twice, so the slots' lengths differ), then every other use at all slots, at two slots from slot 1 and at
    its smallest size, and last a call whose padding rows run past the end of the cache."""
    calls = [("prefill", s, spec.bucket("prefill"), None) for s in range(slots) for _ in range(1 + s % 2)]
    for use in [u for u in spec.buckets if u != "prefill"]:
        packed = "P" in spec.buckets[use][0]  # the target: a token budget per B and T

        def dense(b: int, z: dict) -> dict:  # every cell of the B x T grid computed
            return {**z, "P": b * z["T"]} if packed else z

        sizes = [{a: n for a, n in b.items() if a in ("T", "C")} for b in spec.buckets[use]]
        big, small = max(sizes, key=lambda z: sum(z.values())), min(sizes, key=lambda z: sum(z.values()))
        calls += [(use, 0, spec.bucket(use, B=slots, **dense(slots, big)), None),
                  (use, 1, spec.bucket(use, B=2, **dense(2, big)), None),
                  (use, 0, spec.bucket(use, B=slots, **small), None)]
        if packed:  # the smallest token budget of the largest grid
            calls.append((use, 0, spec.bucket(use, B=slots, **big), None))
    calls.append((use, 0, spec.bucket(use, B=slots, **dense(slots, big)),
                  np.array([max_seq - 3, 7, max_seq - 2, 0])[:slots]))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("family", ["target", "dspark", "mtp"])
def test_every_call_matches_the_standard_lowering(arts, kind, family):
    """Prefill, decode / verify / propose with per-slot different write indices and padding rows, sub-batches
    at a slot offset, writes past the end of the cache: outputs and the whole cache agree after every call."""
    runners = {}
    for lowering in LOWERINGS:
        art = arts(kind, lowering)
        m = io.load_manifest(art)
        runners[lowering] = load_runner("ort", art, m, family, threads=1)
        runners[lowering].allocate(SETTINGS["batch"])
    spec, rng = m.graphs[family], np.random.default_rng(0)
    start = np.zeros(SETTINGS["batch"], np.int64)
    for i, (use, slot, bucket, forced) in enumerate(_calls(spec, SETTINGS["batch"], SETTINGS["max_seq"])):
        rows = slice(slot, slot + bucket["B"])
        if forced is not None:
            start[rows] = forced[:bucket["B"]]
        feeds, nxt = random_feeds(m, family, bucket, i, rng, start[rows].copy())
        start[rows] = np.minimum(nxt, SETTINGS["max_seq"] - 8)  # keep later calls inside the cache
        out = {lowering: {k: v.copy() for k, v in infer(r, slot, feeds).items()} for lowering, r in runners.items()}
        for name, (worst, _, unexplained, ok) in compare_outputs(out["standard"], out["cpu"], feeds, ATOL).items():
            assert ok, f"call {i} ({use} {bucket}): {name} differs by {worst} ({unexplained} tokens)"
        for name, ref in runners["standard"]._cache.items():
            got = runners["cpu"]._cache[name]  # a sized cache holds the positions written so far
            assert got.shape[2] >= min(int(start.max()) + 1, ref.shape[2])
            np.testing.assert_allclose(got, ref[:, :, :got.shape[2]], rtol=0, atol=ATOL,
                                       err_msg=f"call {i} ({use} {bucket}): {name}")
            assert not ref[:, :, got.shape[2]:].any(), f"call {i}: {name} written past the sized cache"


def test_attention_reads_only_the_cache_window(arts):
    """Head caches: positions past the window are never read: NaN there leaves the cpu lowering's MTP call
    untouched (the standard lowering multiplies every position, masked or not)."""
    art = arts("llama", "cpu")
    m = io.load_manifest(art)
    runner = load_runner("ort", art, m, "mtp", threads=1)
    rng = np.random.default_rng(0)
    results = []
    for poison in (0.0, np.nan):
        runner.allocate(2)
        for buf in runner._cache.values():
            buf[:] = 0.5
            buf[:, :, 32:] = poison  # past the window: the last position the chained steps write is < 20
        feeds, _ = random_feeds(m, "mtp", runner.spec.bucket("propose", B=2, C=1), 0, np.random.default_rng(0),
                                np.array([3, 10]))
        results.append({k: v.copy() for k, v in infer(runner, 0, feeds).items()})
    for name, ref in results[0].items():
        assert np.isfinite(results[1][name]).all(), name
        np.testing.assert_array_equal(results[1][name], ref, err_msg=name)


def test_target_cache_grows_with_the_sequences(tiny_model_dir, tmp_path):
    """The target's cache is sized by the runtime: it starts at one GROWTH block, grows (contents kept) as the
    sequences pass it, and stays short of S_MAX for short sequences; decoding across the growth points gives
    the standard export's tokens."""
    from specrt.runtime.backends.ort import GROWTH
    target = tiny_model_dir("llama", num_layers=2)
    settings = dict(batch=2, max_seq=4 * GROWTH, prefill_chunk=16, verify_len=5)
    arts = {lw: export_artifact(target, tmp_path / lw, ExportSettings(**settings, attention=lw), progress=False)
            for lw in LOWERINGS}
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (GROWTH + 7, 20)]
    params = SamplingParams(max_new_tokens=GROWTH + 10, ignore_eos=True)
    got = {}
    for lowering, art in arts.items():
        engine = Engine(art, method="ngram", threads=1)
        if lowering == "cpu":
            engine.target.allocate(2)
            assert engine.target.cache_length == GROWTH
        outs, _ = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
        got[lowering] = [o.output_ids for o in outs]
        if lowering == "cpu":  # the longest sequence ends at 2 * GROWTH + 17 positions
            assert engine.target.cache_length == 3 * GROWTH < settings["max_seq"]
    assert got["cpu"] == got["standard"]


# -- decoding: the standard export's tokens ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "ngram", "mtp", "dspark"])
def test_greedy_tokens_identical_to_the_standard_export(arts, method):
    """Four requests of different lengths (one longer than a prefill chunk), batched: the same greedy tokens."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 23, 9, 14)]
    prompts[2] = prompts[2] + prompts[2][:6]  # a repeat, so n-gram lookup proposes something
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = {}
    for lowering in LOWERINGS:
        engine = Engine(arts("llama", lowering), method=method, threads=1)
        outs, stats = engine.generate([Request(prompt_ids=p, params=params, id=i) for i, p in enumerate(prompts)])
        got[lowering] = [o.output_ids for o in outs]
    assert got["cpu"] == got["standard"]
    assert all(len(ids) == 24 for ids in got["cpu"])
