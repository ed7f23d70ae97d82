"""The C++ runtime (runtime/cpp: libspecrt and its C API, specrt.h), built here with CMake against ONNX Runtime's
headers (scripts/cpp_deps.sh: Debian's libonnxruntime-dev 1.21 through a private APT configuration) and the
onnxruntime wheel's library, driven through `specrt-cpp` (which uses only the C API) and ctest's C program:

- greedy output token-identical to the Python engine for every method and scheduler, several requests in flight,
  on tiny Llama and Qwen3 targets (standard and cpu attention, whose cache grows), a tiny target with DSpark and MTP
  heads, DeepSpec's own checkpoint, and the default model; where the round's choices are deterministic (fixed and
  threshold lengths) also the same rounds with as many drafts accepted;
- sampled output following the target's distribution (chi-square against the exact distribution of the first three
  tokens, computed by transformers' model of the same checkpoint), for plain decoding and every drafter;
- bad artifacts, options and requests: one-line errors and exit 1, never a crash."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specrt.artifact import ExportSettings
from specrt.exporter.export import export_artifact
from specrt.exporter.loaders.deepspec import random_dspark_checkpoint
from specrt.exporter.loaders.mtp import random_mtp_checkpoint
from specrt.runtime.engine import Engine, Request
from specrt.runtime.profile import Profile, save_profile
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams
from conftest import CPP_BUILD

ROOT = Path(__file__).parents[1]
BUILD = CPP_BUILD  # tests/conftest.py builds it (SPECRT_CPP_SANITIZE=1: the ASan/UBSan build)


@pytest.fixture(scope="session")
def specrt_cpp(cpp_build) -> Path:
    return cpp_build / "specrt-cpp"


def _cpp(binary: Path, art: Path, ids: list[int] | list[list[int]], max_new: int, *extra: str
         ) -> subprocess.CompletedProcess:
    prompts = ids if ids and isinstance(ids[0], list) else [ids]
    args = [a for p in prompts for a in ("--input-ids", ",".join(map(str, p)))]
    return subprocess.run([str(binary), str(art), *args, "--max-new-tokens", str(max_new), "--threads", "1", "--json",
                           *extra], capture_output=True, text=True, timeout=600)


def _outputs(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _python_run(art: Path, prompts: list[list[int]], max_new: int, **config) -> tuple[list[list[int]], int, int]:
    """The Python engine's outputs for `prompts` added at once, its slot rounds and drafts accepted."""
    with Engine(art, threads=1, **config) as engine:
        outs, stats = engine.generate([Request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), id=i)
                                       for i, p in enumerate(prompts)])
    return [o.output_ids for o in outs], len(stats.rounds), sum(a for _, a, _ in stats.rounds)


@pytest.fixture(scope="module")
def tiny_arts(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpp")
    arts = {}
    for kind in ("llama", "qwen3"):
        for attention in ("standard", "cpu"):
            settings = ExportSettings(batch=2, max_seq=160, prefill_chunk=8, verify_len=4, attention=attention)
            arts[f"{kind}-{attention}"] = export_artifact(tiny_model_dir(kind), root / f"{kind}-{attention}", settings,
                                                          progress=False)
    return arts


@pytest.mark.parametrize("name", ["llama-standard", "llama-cpu", "qwen3-standard", "qwen3-cpu"])
def test_greedy_is_token_identical_to_python(specrt_cpp, tiny_arts, name):
    """Prompts shorter and longer than a prefill chunk (repeating pieces, so lookups hit), 90 new tokens: the cpu
    lowering's cache grows past 64 positions mid-generation. `ar` and `ngram` give AR's tokens; `ngram` also runs
    the Python engine's rounds: as many, with as many drafts accepted."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (1, 7)]
    prompts += [(rng.integers(3, 256, k).tolist() * 6)[:n] for k, n in ((3, 8), (5, 19), (4, 40))]
    want, _, _ = _python_run(tiny_arts[name], prompts, 90, method="ar")
    hits = 0
    for prompt, ids in zip(prompts, want):
        r = _cpp(specrt_cpp, tiny_arts[name], prompt, 90, "--ignore-eos")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["outputs"] == [ids]
        r = _cpp(specrt_cpp, tiny_arts[name], prompt, 90, "--ignore-eos", "--method", "ngram")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        (tokens,), rounds, accepted = _python_run(tiny_arts[name], [prompt], 90, method="ngram", scheduler="fixed")
        assert got["outputs"] == [ids] == [tokens]
        assert (got["rounds"], got["accepted"]) == (rounds, accepted)
        hits += accepted
    assert hits > 0  # the lookups found drafts the target accepted


@pytest.mark.slow
def test_default_model_greedy_is_token_identical(specrt_cpp, served_art):
    with Engine(served_art, method="ar", threads=1) as engine:
        prompts = [encode_prompt(engine.tokenizer, p) for p in
                   ("Why is the sky blue?", "Write a Python function that reverses a string.")]
    want, _, _ = _python_run(served_art, prompts, 48, method="ar")
    for prompt, ids in zip(prompts, want):
        for method in ("ar", "ngram"):
            r = _cpp(specrt_cpp, served_art, prompt, 48, "--ignore-eos", "--method", method)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["outputs"] == [ids], method
    # without --ignore-eos it stops at the artifact's end-of-sequence token, as the Python engine does
    r = _cpp(specrt_cpp, served_art, prompts[0], 400)
    with Engine(served_art, method="ar", threads=1) as engine:
        out = engine.generate([Request(prompts[0], SamplingParams(max_new_tokens=400))])[0][0].output_ids
    assert json.loads(r.stdout)["outputs"] == [out]


def test_bad_artifacts_and_requests_are_one_line_errors(specrt_cpp, tiny_arts, tmp_path):
    art = tiny_arts["llama-standard"]

    def broken(name: str, edit) -> Path:
        copy = Path(shutil.copytree(art, tmp_path / name))
        edit(copy)
        return copy

    def bump(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["format_version"] = 3
        (d / "manifest.json").write_text(json.dumps(m))

    def shape(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["graphs"]["target"]["inputs"][0]["shape"] = ["B", 7]
        (d / "manifest.json").write_text(json.dumps(m))

    cases = [(tmp_path / "nowhere", [5, 6], "not a specrt artifact"),
             (broken("old", bump), [5, 6], "format version 3"),
             (broken("nograph", lambda d: (d / "target.onnx").unlink()), [5, 6], "missing"),
             (broken("corrupt", lambda d: (d / "target.onnx").write_bytes(b"not onnx")), [5, 6], "cannot load"),
             (broken("badjson", lambda d: (d / "manifest.json").write_text("{")), [5, 6], "not valid JSON"),
             (broken("shape", shape), [5, 6], "input_ids is [B, T] in the graph, [B, 7] in the manifest"),
             (art, [5, 10 ** 6], "outside the vocabulary"),
             (art, [5] * 150, "exceeds the artifact's 159 cache positions")]
    for where, ids, message in cases:
        r = _cpp(specrt_cpp, where, ids, 20)
        assert r.returncode == 1, (where, r.returncode, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([str(specrt_cpp), str(art), "--input-ids", "5,x"], capture_output=True, text=True)
    assert r.returncode == 2 and "comma-separated" in r.stderr
    for extra, message in [(("--method", "dspark"), "needs an artifact exported with a dspark head"),
                           (("--method", "eagle"), "unknown method 'eagle'"),
                           (("--method", "ngram", "--scheduler", "sps"), "plan on a cost profile"),
                           (("--method", "ngram", "--scheduler", "best"), "unknown scheduler 'best'"),
                           (("--method", "ngram", "--gamma", "9"), "gamma must be between 1 and 3"),
                           (("--method", "ngram", "--tree", "9"), "tree must be between 1 and 8"),
                           (("--method", "ar", "--tree", "2"), "use it with ngram, dspark or dspark+ngram, not ar"),
                           (("--temperature", "-1"), "temperature must be a finite number >= 0"),
                           (("--top-p", "0"), "top_p must be in (0, 1]"),
                           (("--max-new-tokens", "0"), "max_new_tokens must be >= 1")]:
        r = _cpp(specrt_cpp, art, [5, 6], 4, *extra)
        assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
    r = _cpp(specrt_cpp, art, [], 4)
    assert r.returncode == 1 and "empty prompt" in r.stderr


# -- draft heads, schedulers, several requests in flight ---------------------------------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
HEAD_METHODS = ("ngram", "dspark", "mtp", "dspark+ngram", "mtp+ngram")
SCHEDULERS = ("fixed", "threshold", "sps", "sps-async")


def _store_profile(art: Path, heads: tuple[str, ...]) -> None:
    """A cost profile for one thread with a knee (each token past the anchors costs more), so Algorithm 1 admits
    confident drafts and refuses doubtful ones; both engines refine it online from their own timings."""
    verify = {b: {p: 10.0 + 1.0 * max(0, p - b) for p in range(b, 8 * b + 1)} for b in (1, 2, 4)}
    save_profile(art, Profile(backend="ort", threads=1, position=16, machine="test", created="", verify=verify,
                              draft={h: {1: 2.0, 2: 3.0, 4: 4.0} for h in heads}))


@pytest.fixture(scope="module")
def head_arts(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with a DSpark head (confidence head, Markov head) and an MTP head, 4 slots; DeepSpec's own tiny
    checkpoint (Qwen3 target, DSpark draft) at 2 slots. Both with a stored profile."""
    root = tmp_path_factory.mktemp("cpp_heads")
    target = tiny_model_dir("llama", num_layers=2)
    draft = random_dspark_checkpoint(root / "draft", target, layers=1, block_size=4, markov_rank=16, confidence=True)
    mtp = random_mtp_checkpoint(root / "mtp", target)
    tiny = export_artifact(target, root / "tiny", ExportSettings(batch=4, max_seq=128, prefill_chunk=8, verify_len=5),
                           draft=draft, mtp=mtp, progress=False)
    _store_profile(tiny, ("dspark", "mtp"))
    deepspec = export_artifact(FIXTURE / "target", root / "deepspec",
                               ExportSettings(batch=2, max_seq=96, prefill_chunk=8, verify_len=5),
                               draft=FIXTURE / "draft", progress=False)
    _store_profile(deepspec, ("dspark",))
    return {"tiny": tiny, "deepspec": deepspec}


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated pieces (so n-gram lookups find matches), some longer than a prefill chunk."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        piece = rng.integers(3, vocab, int(rng.integers(2, 6))).tolist()
        out.append((piece * 6 + rng.integers(3, vocab, int(rng.integers(1, 9))).tolist())[:int(rng.integers(5, 30))])
    return out


@pytest.mark.parametrize("case", ["tiny", "deepspec"])
def test_every_method_and_scheduler_is_token_identical_to_python(specrt_cpp, head_arts, case):
    """Three requests in flight at once (slots beyond the first two on the tiny target; one waits for a slot on
    DeepSpec's, which has two): every method under every scheduler gives plain decoding's tokens. Where the choices
    are deterministic (fixed and threshold lengths; not the cost-aware ones, which both engines refine from their own
    timings) the C++ rounds are the Python engine's: as many slot rounds, as many drafts accepted."""
    art = head_arts[case]
    vocab = json.loads((art / "manifest.json").read_text())["model"]["vocab_size"]
    prompts = _prompts(vocab, 3, seed=11)
    want, _, _ = _python_run(art, prompts, 40, method="ar")
    methods = HEAD_METHODS if case == "tiny" else ("ngram", "dspark", "dspark+ngram")
    accepted_somewhere = 0
    for method in methods:
        for scheduler in SCHEDULERS:
            got = _outputs(_cpp(specrt_cpp, art, prompts, 40, "--ignore-eos", "--method", method,
                                "--scheduler", scheduler))
            assert got["outputs"] == want, (method, scheduler)
            if scheduler in ("fixed", "threshold") and "+" not in method:
                _, rounds, accepted = _python_run(art, prompts, 40, method=method, scheduler=scheduler)
                assert (got["rounds"], got["accepted"]) == (rounds, accepted), (method, scheduler)
            accepted_somewhere += got["accepted"]
    assert accepted_somewhere > 0


@pytest.mark.parametrize("case", ["tiny", "deepspec"])
def test_draft_trees_are_token_identical_to_python(specrt_cpp, head_arts, case):
    """--tree 3 (n-gram continuations; a DSpark head's likeliest other first tokens grafted beside its first draft),
    three requests in flight: plain decoding's tokens under fixed and sps; under fixed the C++ rounds are the Python
    engine's tree rounds (as many slot rounds, as many drafts accepted), which on DeepSpec's checkpoint differ from its
    chains' (branches were taken; on the tiny random target no alternative is ever the target's choice)."""
    art = head_arts[case]
    vocab = json.loads((art / "manifest.json").read_text())["model"]["vocab_size"]
    prompts = _prompts(vocab, 3, seed=11)
    want, _, _ = _python_run(art, prompts, 40, method="ar")
    differs = _check_trees(specrt_cpp, art, prompts, 40, want)
    assert differs > 0 or case == "tiny"


def _check_trees(specrt_cpp, art: Path, prompts: list[list[int]], max_new: int, want: list[list[int]]) -> int:
    """--tree 3 for ngram, dspark and dspark+ngram under fixed and sps: plain decoding's tokens `want`; under fixed
    the Python engine's tree rounds. Returns for how many methods those differ from its chains'."""
    differs = 0
    for method in ("ngram", "dspark", "dspark+ngram"):
        for scheduler in ("fixed", "sps"):
            got = _outputs(_cpp(specrt_cpp, art, prompts, max_new, "--ignore-eos", "--method", method,
                                "--scheduler", scheduler, "--tree", "3"))
            assert got["outputs"] == want, (method, scheduler)
            if scheduler == "fixed" and "+" not in method:
                _, rounds, accepted = _python_run(art, prompts, max_new, method=method, scheduler=scheduler, tree=3)
                assert (got["rounds"], got["accepted"]) == (rounds, accepted), method
                chains = _python_run(art, prompts, max_new, method=method, scheduler=scheduler)[1:]
                differs += (rounds, accepted) != chains
    return differs


def test_a_head_alone_is_gated_under_sps(specrt_cpp, head_arts, tmp_path):
    """Under sps a head alone drafts only on rounds where it promises more than a plain decoding step, as in Python
    (runtime/hybrid.py without lookups): on a profile where its draft call costs 1e6 ms it is called only to explore
    (the 32nd round without it), under fixed on every round; both give plain decoding's tokens."""
    art = tmp_path / "art"
    shutil.copytree(head_arts["tiny"], art)
    verify = {b: {p: 10.0 + 1.0 * max(0, p - b) for p in range(b, 8 * b + 1)} for b in (1, 2, 4)}
    save_profile(art, Profile(backend="ort", threads=1, position=16, machine="test", created="", verify=verify,
                              draft={"dspark": {1: 1e6, 2: 1e6, 4: 1e6}, "mtp": {1: 1e6, 2: 1e6, 4: 1e6}}))
    vocab = json.loads((art / "manifest.json").read_text())["model"]["vocab_size"]
    prompt = _prompts(vocab, 1, seed=12)[0]
    want, _, _ = _python_run(art, [prompt], 80, method="ar")
    for method in ("dspark", "mtp"):
        fixed = _outputs(_cpp(specrt_cpp, art, prompt, 80, "--ignore-eos", "--method", method, "--scheduler", "fixed"))
        sps = _outputs(_cpp(specrt_cpp, art, prompt, 80, "--ignore-eos", "--method", method, "--scheduler", "sps"))
        assert fixed["outputs"] == sps["outputs"] == want, method
        assert fixed["head_calls"] == fixed["rounds"] > 0, method
        assert 1 <= sps["head_calls"] <= 2 < sps["rounds"], (method, sps["head_calls"], sps["rounds"])
    # three requests in flight: an exploration drafts for the slot with the fewest pending rows, the other two keep
    # their rows for the head's next call (runtime/hybrid.py `_held`); the tokens stay plain decoding's
    prompts = [prompt[:n] for n in (len(prompt), 5, len(prompt) // 2)]
    want, _, _ = _python_run(art, prompts, 80, method="ar")
    for method in ("dspark", "mtp"):
        sps = _outputs(_cpp(specrt_cpp, art, prompts, 80, "--ignore-eos", "--method", method, "--scheduler", "sps",
                            "--slots", "3"))
        assert sps["outputs"] == want and sps["head_calls"] >= 1, (method, sps["head_calls"])


def _exact_triples(model_dir: Path, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """The exact probability of every first three tokens under `params`, from transformers' model of the target."""
    import torch
    from transformers import AutoModelForCausalLM

    from specrt.runtime.sampling import distribution

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def dist(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        return distribution(logits, params)

    out = {}
    p1 = dist(prompt)
    for a in np.flatnonzero(p1):
        p2 = dist(prompt + [int(a)])
        for b in np.flatnonzero(p2):
            p3 = dist(prompt + [int(a), int(b)])
            for c in np.flatnonzero(p3):
                out[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    return out


@pytest.mark.parametrize("method", ["ar", "ngram", "dspark", "mtp", "dspark+ngram", "ngram:tree=3", "dspark:tree=3",
                                    "dspark+ngram:tree=3"])
def test_sampled_tokens_follow_the_target_distribution(specrt_cpp, head_arts, tiny_model_dir, method):
    """1600 seeded requests of three tokens at temperature 0.9, top-k 3 (27 possible sequences), several in flight:
    the first comes from prefill, the others from draft/verify rounds (drafts drawn by the head's graph, or one-hot
    lookups; trees: lookups' continuations, or the head's other first tokens beside its drawn first draft). Their
    frequencies match the target's exact distribution (chi-square, p > 1e-3), no sequence of probability 0 appears,
    and the rounds accepted drafts (the rejection-sampling path ran). The random head's drafts are rarely accepted
    (~1% of rounds), so for its trees this checks the engine's path end to end more than the rule's arithmetic, which
    test_cpp_tree_rejection_sampling_commits_tokens_from_the_target_distribution checks on its own."""
    from scipy.stats import chisquare

    art = head_arts["tiny"]
    name, _, tree = method.partition(":tree=")
    # a tree's prompt: 8 was followed by 9 and by 11, so lookups find two continuations
    prompt = [7, 8, 9, 10, 7, 8, 11, 7, 8] if tree else [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]
    params = SamplingParams(temperature=0.9, top_k=3)
    exact = _exact_triples(tiny_model_dir("llama", num_layers=2), prompt, params)
    got = _outputs(_cpp(specrt_cpp, art, prompt, 3, "--ignore-eos", "--method", name, "--scheduler", "fixed",
                        "--temperature", "0.9", "--top-k", "3", "--seed", "7", "--repeat", "1600",
                        *(("--tree", tree) if tree else ())))
    seen: dict[tuple, int] = {}
    for ids in got["outputs"]:
        seen[tuple(ids)] = seen.get(tuple(ids), 0) + 1
    assert sum(seen.values()) == 1600
    assert set(seen) <= set(exact), "a sequence of probability 0 was emitted"
    keys = sorted(exact)
    observed = np.array([seen.get(k, 0) for k in keys], float)
    expected = np.array([exact[k] for k in keys]) * 1600
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
    if method != "ar":
        assert got["accepted"] > 0


def test_c_api_from_c(specrt_cpp, tiny_arts):
    """ctest: its C program (runtime/cpp/tests/c_api_test.c, compiled as C99: add / step / abort, generate, errors
    for bad calls with the engine working after each, versioned structs, stop strings), the C++ API's, and the
    standalone programs through their differential checks; every test program is registered."""
    env = {**os.environ, "SPECRT_TEST_ARTIFACT": str(tiny_arts["llama-cpu"])}
    r = subprocess.run(["ctest", "--test-dir", str(BUILD), "--output-on-failure"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and "100% tests passed" in r.stdout, r.stdout + r.stderr
    assert "Skipped" not in r.stdout
    # every C++ test program is a ctest test (the standalone ones through their differential check here)
    listed = subprocess.run(["ctest", "--test-dir", str(BUILD), "-N"], capture_output=True, text=True).stdout
    names = {line.split(": ", 1)[1].strip() for line in listed.splitlines() if line.strip().startswith("Test #")}
    programs = sorted((ROOT / "runtime" / "cpp" / "tests").glob("*.c*"))
    assert programs and all({p.stem, p.stem.removesuffix("_test")} & names for p in programs), (names, programs)
    if shutil.which("nm"):  # the library exports its C API and none of its C++ classes (which a program's own
        # specrt:: classes, as in specrt.hpp, would otherwise interpose on)
        symbols = subprocess.run(["nm", "-DC", "--defined-only", str(BUILD / "libspecrt.so")], capture_output=True,
                                 text=True, check=True).stdout
        ours = {line.split()[-1] for line in symbols.splitlines() if "specrt" in line}
        assert ours and all(s.startswith("specrt_") for s in ours), sorted(ours)[:5]


@pytest.mark.slow
def test_default_model_every_method_is_token_identical(specrt_cpp, served_art):
    """The default model with its shipped DSpark and MTP heads and its stored profile: every method (sps, the
    default scheduler) gives plain decoding's tokens, two requests in flight; so do draft trees (--tree 3), and under
    fixed their rounds are the Python engine's."""
    with Engine(served_art, method="ar", threads=1) as engine:
        prompts = [encode_prompt(engine.tokenizer, p) for p in
                   ("Write a Python function that checks whether a number is prime.", "Why is the sky blue?")]
    want, _, _ = _python_run(served_art, prompts, 64, method="ar")
    for method in ("dspark", "mtp", "dspark+ngram", "mtp+ngram"):
        got = _outputs(_cpp(specrt_cpp, served_art, prompts, 64, "--ignore-eos", "--method", method,
                            "--scheduler", "sps"))
        assert got["outputs"] == want, method
    assert _check_trees(specrt_cpp, served_art, prompts, 64, want) > 0


def test_cpp_admission_is_the_pythons(cpp_build):
    """The C++ Algorithm 1 on its own (runtime/cpp/tests/admission_test.cpp) gives runtime/steps.py's lengths, rate
    and exploration on the random cases tests/test_schedulers.py checks the Python one on (survivals with ties and
    zeros, idle rows, convex curves, explorations above and below the stopping point)."""
    from specrt.runtime import steps
    from test_schedulers import admission_case

    cases, want = [], []
    for seed in range(200):
        a, active, fixed, curve, explore = admission_case(seed)
        n, g = a.shape
        lengths, rate, explored = steps.admission(a, active, fixed, curve, explore)
        want.append({"lengths": lengths.tolist(), "rate": float(rate), "explored": bool(explored)})
        cases.append(" ".join([f"{n} {g} {fixed!r} {len(curve) - 1}", *(repr(float(x)) for x in a.ravel()),
                               *(str(int(x)) for x in active), *(repr(float(x)) for x in curve),
                               "0" if explore is None else "1 " + " ".join(str(int(x)) for x in explore)]))
    assert sum(w["explored"] for w in want) > 20  # the cases explore, in both directions (test_schedulers.py)
    r = subprocess.run([str(cpp_build / "admission_test")], input="\n".join(cases) + "\n", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(got) == len(want)
    for i, (g_, w) in enumerate(zip(got, want)):
        assert g_ == w, (i, cases[i])


@pytest.mark.parametrize("draft", ["good", "bad", "disjoint", "onehot"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_cpp_rejection_sampling_commits_tokens_from_the_target_distribution(specrt_cpp, draft, params):
    """The C++ accept_sampled on its own (runtime/cpp/tests/acceptance_test.cpp), as tests/test_acceptance.py checks
    the Python one: whatever the draft distribution (close to the target, unrelated, disjoint from it, one-hot), the
    first and second committed tokens follow the target's distribution, computed here by runtime/sampling.py from the
    same logits; a draft close to the target is mostly accepted, a disjoint one never."""
    from specrt.runtime.sampling import distribution

    if draft == "disjoint" and params.top_k == 0 and params.top_p == 1.0:
        pytest.skip("a draft disjoint from the target needs tokens the target never emits (top-k/top-p)")
    got = _acceptance_test(draft, params)
    logits = np.array(got["logits"], np.float32).reshape(4, 12)
    for counts, row in ((got["first"], 0), (got["second"], 1)):
        if draft == "disjoint" and row == 1:
            assert sum(counts) == 0  # nothing accepted: no second token
            continue
        _assert_follows(counts, distribution(logits[row], params), (draft, row))
    if draft == "good":
        assert got["mean_accepted"] > 1.0
    if draft == "disjoint":
        assert got["mean_accepted"] == 0.0


def _acceptance_test(kind: str, params: SamplingParams) -> dict:
    r = subprocess.run([str(BUILD / "acceptance_test"), kind, str(params.temperature), str(params.top_k),
                        str(params.top_p), "20000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _assert_follows(counts: list[int], p: np.ndarray, what) -> None:
    """Committed-token counts follow the distribution p (chi-square, p > 1e-3; rare tokens pooled), and no token of
    probability 0 was committed."""
    from scipy.stats import chisquare

    counts = np.array(counts, float)
    assert counts[p == 0].sum() == 0, ("a token of probability 0 was committed", what)
    expected = p * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3, what


@pytest.mark.parametrize("kind", ["tree-onehot", "tree-sampled"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_cpp_tree_rejection_sampling_commits_tokens_from_the_target_distribution(specrt_cpp, kind, params):
    """The C++ accept_tree_sampled on its own (acceptance_test's tree kinds): two branches under the anchor (chosen
    outright, or the first drawn from q with its child), a node under each. The first committed token follows the
    target's distribution at the anchor; the second, after each branch, the distribution at that branch's cell; both
    branches are taken."""
    from specrt.runtime.sampling import distribution

    got = _acceptance_test(kind, params)
    logits = np.array(got["logits"], np.float32).reshape(4, 12)
    _assert_follows(got["first"], distribution(logits[0], params), (kind, "first"))
    for key, row in (("second", 1), ("second_b", 2)):
        assert sum(got[key]) > 100, (kind, key, "the branch was rarely taken")
        _assert_follows(got[key], distribution(logits[row], params), (kind, key))


# -- text in, text out -----------------------------------------------------------------------------------------------

DATASETS = ROOT / "datasets"  # copies of the shared prompt sets (datasets/README.md)
EDGE_TEXTS = ["héllo wörld 你好 🤖 <|im_start|>user\nhi<|im_end|>", "  leading  spaces\n\n\ttabs \r\n", "x" * 3000,
              "it's we're I'll DON'T", "١٢٣ 12345 ½ ⅔", "<|im_end|><|im_end|>a<|endoftext|>", " ", "\u00a0\u2003nbsp",
              "e\u0301 combining", "emoji 👩‍👩‍👧 flags 🇫🇷"]


def _dataset_texts() -> list[str]:
    texts = []
    for path in sorted(DATASETS.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.extend(t for t in json.loads(line)["turns"] if isinstance(t, str))
    return texts


def _tokenize(file: Path, texts: list[str] | list[dict], add_special: bool = False, art: Path | None = None
              ) -> list[dict]:
    """runtime/cpp/tests/tokenize.cpp on texts (or its other requests, as dicts), with `art`'s chat text."""
    requests = [t if isinstance(t, dict) else {"text": t, "add_special": add_special} for t in texts]
    lines = "".join(json.dumps(q) + "\n" for q in requests)
    r = subprocess.run([str(BUILD / "tokenize"), str(file), *([str(art)] if art else [])], input=lines,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def _check_tokenizer(file: Path, texts: list[str], add_special: bool) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    got = _tokenize(file, texts, add_special)
    assert len(got) == len(texts)
    for text, g in zip(texts, got):
        want = tok.encode(text, add_special_tokens=add_special).ids
        assert g["ids"] == want, text[:200]
        decoded = tok.decode(want, skip_special_tokens=False)
        assert g["decoded"] == decoded and g["streamed"] == decoded, text[:200]


def test_tokenizer_ids_equal_the_tokenizers_library_on_every_dataset_prompt(specrt_cpp, served_art):
    """The default model's tokenizer (SmolLM2: byte-level BPE with GPT-2's regex, special tokens): every turn of every
    prompt set in datasets/ (2,333 lines) and some edge cases (non-Latin scripts, emoji sequences, combining marks,
    special tokens inside text, runs of whitespace, a 3,000-character word) give the tokenizers library's ids; decoding
    them, whole or streamed a token at a time, gives its text."""
    texts = _dataset_texts() + EDGE_TEXTS
    assert len(texts) > 2300
    _check_tokenizer(served_art / "tokenizer" / "tokenizer.json", texts, add_special=False)


def test_tokenizer_llama3_style_split_regex_and_bos(specrt_cpp, tmp_path):
    """The other byte-level layout (Llama 3, Qwen): a Split pre-tokenizer with its own regex before ByteLevel, merges
    that a whole-word lookup may skip (ignore_merges), and a post-processor that adds a BOS; a vocabulary trained here
    on the prompt sets with the tokenizers library, then compared with it (with and without special tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = _dataset_texts()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=3000, special_tokens=["<|begin_of_text|>", "<|eot|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])])
    file = tmp_path / "tokenizer.json"
    tok.save(str(file))
    sample = texts[::7] + EDGE_TEXTS
    _check_tokenizer(file, sample, add_special=False)
    _check_tokenizer(file, sample, add_special=True)


def _sentencepiece_style(tmp_path: Path, legacy: bool) -> Path:
    """A SentencePiece-style BPE (Llama 2, Mistral, TinyLlama) trained here with the tokenizers library on the prompt
    sets: spaces as U+2581, an alphabet of 120 characters so that the rest (accents, CJK, emoji) take byte fallback's
    <0xXX> tokens, a BOS by the post-processor; `legacy`: Llama 2's normalizer form (Prepend + Replace, no
    pre-tokenizer), else the Metaspace form a GGUF's vocabulary becomes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(_dataset_texts(), trainers.BpeTrainer(vocab_size=2000, limit_alphabet=120,
                                                                  special_tokens=["<unk>", "<s>", "</s>"],
                                                                  show_progress=False))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte fallback's tokens, in the model's vocabulary as SentencePiece has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    bos = vocab["<s>"]
    data["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]).__getstate__())
    file = tmp_path / f"spm-{'legacy' if legacy else 'metaspace'}.tokenizer.json"
    file.write_text(json.dumps(data))
    ids = Tokenizer.from_file(str(file)).encode("日本", add_special_tokens=False)
    assert ids.tokens[:2] == ["\u2581", "<0xE6>"]  # byte fallback in use
    return file


@pytest.mark.parametrize("legacy", [False, True], ids=["metaspace", "legacy-normalizer"])
def test_tokenizer_sentencepiece_style_with_byte_fallback(specrt_cpp, tmp_path, legacy):
    """SentencePiece-style vocabularies (what a GGUF of Llama 2, Mistral or TinyLlama carries): every tenth prompt
    turn and the edge cases give the tokenizers library's ids with and without the BOS, and its text back, whole and
    streamed (the first space dropped once)."""
    file = _sentencepiece_style(tmp_path, legacy)
    sample = _dataset_texts()[::10] + EDGE_TEXTS + ["<s>hello</s> world", "  two leading spaces", "\u2581already"]
    _check_tokenizer(file, sample, add_special=False)
    _check_tokenizer(file, sample, add_special=True)


def test_tokenizer_of_a_gguf_llama_vocabulary(specrt_cpp, tmp_path):
    """A GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama": pieces with scores, <0xXX> byte tokens), made
    into tokenizer.json by `specrt export`'s loader, read by the C++ tokenizer as the tokenizers library reads it."""
    import gguf

    from specrt.exporter.loaders.tokenizer import TokenizerSource

    pieces = ["\u2581", "e", "t", "h", "l", "o", "\u2581t", "he", "\u2581the", "ll", "llo", "\u2581he", "\u2581hello",
              "w", "r", "d", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "a", "\u2581a", "!", "."]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    w = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    TokenizerSource.from_gguf(tmp_path / "spm.gguf", eos_token_ids=(2,)).save(tmp_path / "tok")
    texts = ["hello world", " the world!", "héllo wörld 你好 🤖", "a\nb  c", "", "the the hello", *EDGE_TEXTS]
    _check_tokenizer(tmp_path / "tok" / "tokenizer.json", texts, add_special=False)
    _check_tokenizer(tmp_path / "tok" / "tokenizer.json", texts, add_special=True)


@pytest.fixture(scope="module")
def chat_art(served_art) -> Path:
    """The served artifact's manifest with the chat template's text around a user message, as `specrt export` now
    writes it (the session's served artifact may have been exported before)."""
    from specrt.tokenizer_info import chat_affixes

    m = json.loads((served_art / "manifest.json").read_text())
    want = chat_affixes(m["tokenizer"]["chat_template"], m["tokenizer"]["special_tokens"])
    assert want and "prefix" in want
    if m["tokenizer"].get("chat") != want:
        m["tokenizer"]["chat"] = want
        (served_art / "manifest.json").write_text(json.dumps(m))
    return served_art


def test_text_prompts_through_the_chat_template_match_python(specrt_cpp, chat_art):
    """`specrt-cpp ART --prompt TEXT`: the chat template's stored text around the message gives the Python engine's
    prompt ids (its Jinja rendering); the generated text, streamed through the events, is the Python engine's text,
    for plain decoding and dspark+ngram; --raw skips the template."""
    prompts = ["Write a Python function that reverses a string.", "Explain ünïcode, 漢字 and emoji 🤖 briefly."]
    with Engine(chat_art, method="ar", threads=1) as engine:
        ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
        raw_ids = encode_prompt(engine.tokenizer, prompts[0], raw=True)
        outs, _ = engine.generate([Request(i, SamplingParams(max_new_tokens=40), id=k) for k, i in enumerate(ids)])
        texts = [o.text for o in outs]
    args = [a for p in prompts for a in ("--prompt", p)]
    for method in ("ar", "dspark+ngram"):
        r = subprocess.run([str(specrt_cpp), str(chat_art), *args, "--method", method, "--scheduler", "sps",
                            "--max-new-tokens", "40", "--threads", "1", "--json"], capture_output=True, text=True,
                           timeout=300)
        got = _outputs(r)
        assert got["outputs"] == [o.output_ids for o in outs], method
        assert got["texts"] == texts, method
    r = subprocess.run([str(specrt_cpp), str(chat_art), "--prompt", prompts[0], "--raw", "--max-new-tokens", "8",
                        "--threads", "1", "--json"], capture_output=True, text=True, timeout=300)
    with Engine(chat_art, method="ar", threads=1) as engine:
        want = engine.generate([Request(raw_ids, SamplingParams(max_new_tokens=8))])[0][0].output_ids
    assert _outputs(r)["outputs"] == [want]
    # streamed to the terminal when there is one request
    r = subprocess.run([str(specrt_cpp), str(chat_art), "--prompt", prompts[0], "--max-new-tokens", "40",
                        "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip("\n") == texts[0] and "tok/s" in r.stderr


def test_text_errors_name_the_problem(specrt_cpp, tiny_arts, served_art, tmp_path):
    """Text on an artifact without a tokenizer, and on one whose manifest predates the stored chat text: one line
    naming the fix; invalid UTF-8 is refused."""
    r = _cpp_text(specrt_cpp, tiny_arts["llama-standard"], "hello")
    assert r.returncode == 1 and "has no tokenizer" in r.stderr
    old = Path(shutil.copytree(served_art, tmp_path / "old", ignore=shutil.ignore_patterns("weights.bin")))
    os.link(served_art / "weights.bin", old / "weights.bin")  # ONNX Runtime refuses external data behind a symlink
    m = json.loads((old / "manifest.json").read_text())
    m["tokenizer"].pop("chat", None)
    (old / "manifest.json").write_text(json.dumps(m))
    r = _cpp_text(specrt_cpp, old, "hello")
    assert r.returncode == 1 and "re-export it" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cpp_text(specrt_cpp, old, "hello", "--raw")
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(specrt_cpp).encode(), str(old).encode(), b"--prompt", b"bad \xff utf8", b"--raw"],
                       capture_output=True, timeout=300)
    assert r.returncode == 1 and b"not valid UTF-8" in r.stderr


def _cpp_text(binary: Path, art: Path, text: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), str(art), "--prompt", text, "--max-new-tokens", "4", "--threads", "1", *extra],
                          capture_output=True, text=True, timeout=300)


def test_chat_conversations_match_the_python_template(specrt_cpp, chat_art, tmp_path):
    """Conversations (system, user and assistant turns, as the server's chat messages) through the chat text the
    exporter stores give the ids of the Python runtime's Jinja rendering, for SmolLM2's template (which adds a
    default system message when there is none) and for a Llama 3-style template that trims contents (whitespace
    around them, Unicode spaces included); a conversation the stored text cannot express is an error naming it."""
    from specrt.runtime.tokenizer import Tokenizer
    from specrt.tokenizer_info import chat_affixes

    texts = _dataset_texts()[:40]
    convs = []
    for i in range(0, 40, 4):
        a, b, c, d = texts[i:i + 4]
        convs += [[("user", a)], [("system", b), ("user", a)], [("user", a), ("assistant", b), ("user", c)],
                  [("system", d), ("user", a), ("assistant", EDGE_TEXTS[i // 4]), ("user", c)]]
    convs += [[("user", t)] for t in EDGE_TEXTS]
    manifest = json.loads((chat_art / "manifest.json").read_text())
    llama3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n\n' + "
              "message['content'] | trim + '<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}"
              "{{- '<|im_start|>assistant\n\n' }}{%- endif %}")
    trimmed = tmp_path / "trimmed"
    trimmed.mkdir()
    info = dict(manifest["tokenizer"], chat_template=llama3)
    info["chat"] = chat_affixes(llama3, info["special_tokens"])
    assert info["chat"]["trim"] and "start" in info["chat"]["roles"]
    (trimmed / "manifest.json").write_text(json.dumps(dict(manifest, tokenizer=info)))
    file = chat_art / "tokenizer" / "tokenizer.json"
    for art, tokenizer_info in ((chat_art, manifest["tokenizer"]), (trimmed, info)):
        tok = Tokenizer.from_dir(chat_art / "tokenizer", tokenizer_info)
        got = _tokenize(file, [{"messages": conv} for conv in convs], art=art)
        for conv, g in zip(convs, got):
            text = tok.apply_chat_template([{"role": r, "content": x} for r, x in conv], add_generation_prompt=True)
            assert g.get("ids") == tok.encode(text), (art.name, conv)
        got = _tokenize(file, [{"prompt": t} for t in texts[:10] + EDGE_TEXTS], art=art)
        assert [g["ids"] for g in got] == [encode_prompt(tok, t) for t in texts[:10] + EDGE_TEXTS]
    bad = _tokenize(file, [{"messages": [["assistant", "hi"]]}, {"messages": [["user", "a"], ["user", "b"]]},
                           {"messages": []}], art=chat_art)
    assert "starts with a assistant message is not known" in bad[0]["error"]
    assert "user message after a user message is not known" in bad[1]["error"]
    assert "at least one message" in bad[2]["error"]
    r = subprocess.run([str(specrt_cpp), str(chat_art), "--system", "Answer in French.", "--prompt", "Hello!",
                        "--max-new-tokens", "12", "--threads", "1", "--json"], capture_output=True, text=True,
                       timeout=300)
    tok = Tokenizer.from_dir(chat_art / "tokenizer", manifest["tokenizer"])
    ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Answer in French."},
                                              {"role": "user", "content": "Hello!"}]))
    with Engine(chat_art, method="ar", threads=1) as engine:
        want = engine.generate([Request(ids, SamplingParams(max_new_tokens=12))])[0][0].output_ids
    assert _outputs(r)["outputs"] == [want]


@pytest.mark.slow
def test_stop_strings_end_requests_as_the_python_engine_does(specrt_cpp, served_art):
    """Stop strings through the C API (specrt-cpp --stop): the same tokens, the same text cut before the first stop
    string, and finish reason "stop", as the Python engine's; a string the text never holds changes nothing."""
    from specrt.runtime.prompts import encode_prompt

    prompt = "Why is the sky blue?"
    with Engine(served_art, method="dspark+ngram", scheduler="sps", threads=1) as engine:
        ids = encode_prompt(engine.tokenizer, prompt)
        for stops in (("light",), ("sky", " the"), ("no such text zq",)):
            (want,), _ = engine.generate([Request(ids, SamplingParams(max_new_tokens=40, stop_strings=stops))])
            args = [a for s in stops for a in ("--stop", s)]
            got = _outputs(subprocess.run([str(specrt_cpp), str(served_art), "--prompt", prompt, "--max-new-tokens",
                                           "40", "--threads", "1", "--json", "--method", "dspark+ngram",
                                           "--scheduler", "sps", *args], capture_output=True, text=True, timeout=300))
            assert (got["outputs"][0], got["texts"][0], got["finish_reasons"][0]) == (
                want.output_ids, want.text, want.finish_reason), stops
            assert want.finish_reason == ("length" if stops == ("no such text zq",) else "stop")


def test_the_cpp_io_names_are_generated_from_the_artifact_contract(tmp_path, monkeypatch):
    """runtime/cpp/src/io_names.h is what scripts/gen_cpp_names.py makes of specrt/artifact.py's IO_NAMES (so the C++
    runtime cannot spell a graph's input differently), and the check fails on a header that drifted."""
    import importlib.util
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "gen_cpp_names.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    spec = importlib.util.spec_from_file_location("gen_cpp_names", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert 'kInputIds[] = "input_ids"' in gen.render()
    drifted = tmp_path / "runtime" / "cpp" / "src" / "io_names.h"
    drifted.parent.mkdir(parents=True)
    drifted.write_text(gen.render().replace('"input_ids"', '"input_id"'))
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "HEADER", drifted)
    monkeypatch.setattr(sys, "argv", ["gen_cpp_names.py", "--check"])
    assert gen.main() == 1
