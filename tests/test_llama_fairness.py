"""The bench's llama.cpp figure is llama.cpp at its best: within 5% of llama-cpp-python's own generate loop run
alone, in a process of its own, on the same prompt ids (the default model's GGUF, 2 threads, greedy).

A timed comparison, so it runs only where asked (SPECRT_TIMED=1) on a quiet machine: the suite's machines are
shared, and speed is otherwise checked by benchmark commands, never by the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("SPECRT_TIMED") != "1",
                                 reason="timed comparison: run on a quiet machine with SPECRT_TIMED=1 (the suite's "
                                        "machines are shared; speed is checked by benchmark commands)")]

PROMPTS = 12
NEW_TOKENS = 128
THREADS = 2

# llama-cpp-python's plain loop, written here without any specrt code, run in a fresh interpreter
ALONE = """
import json, sys, time
import llama_cpp
path, prompts, new, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
eos = set(json.loads(sys.argv[5]))
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
rates = []
for i, ids in enumerate([prompts[0]] + prompts):  # the first run warms up
    llm.reset()
    times, out = [], []
    t0 = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=False):
        times.append(time.perf_counter() - t0)
        out.append(token)
        if token in eos or len(out) >= new:
            break
    if i:
        rates.append((len(out) - 1, times[-1] - times[0]))
print(json.dumps(rates))
"""


def test_bench_llama_cpp_matches_its_own_loop_run_alone(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional extra specrt[llama]")
    from click.testing import CliRunner

    from specrt import artifact as io
    from specrt.cli import main
    from specrt.tools.default_artifact import default_artifact
    from specrt.tools.bench import artifact_source
    from specrt.runtime.prompts import encode_prompt, read_prompts_file
    from specrt.runtime.tokenizer import Tokenizer

    art = default_artifact(progress=False)
    manifest = io.load_manifest(art)
    tok = Tokenizer.from_dir(art / io.TOKENIZER_DIR, manifest.tokenizer)
    humaneval = Path(__file__).parents[1] / "datasets" / "humaneval.jsonl"
    ids = [encode_prompt(tok, t) for t in read_prompts_file(humaneval, PROMPTS)]
    gguf, eos = str(artifact_source(manifest)), json.dumps(sorted(manifest.eos_ids))

    def alone() -> float:
        out = subprocess.run([sys.executable, "-c", ALONE, gguf, json.dumps(ids), str(NEW_TOKENS), str(THREADS), eos],
                             capture_output=True, text=True, timeout=600, check=True)
        runs = json.loads(out.stdout)  # pooled as the bench pools: decode tokens over decode seconds
        return sum(n for n, _ in runs) / sum(s for _, s in runs)

    def bench() -> float:
        r = CliRunner().invoke(main, ["bench", str(art), "--prompts", str(humaneval), "--limit", str(PROMPTS),
                                      "--max-new-tokens", str(NEW_TOKENS), "--baseline", "llama.cpp",
                                      "--threads", str(THREADS), "--json"])
        assert r.exit_code == 0, (r.output, r.stderr)
        return next(row["tokens_per_s"] for row in json.loads(r.stdout)["pooled"] if row["method"] == "llama.cpp")

    # alternated, so a drift of the machine's speed falls on both
    a1, b1, a2, b2 = alone(), bench(), alone(), bench()
    ratio = (b1 + b2) / (a1 + a2)
    print(f"bench llama.cpp {b1:.1f} / {b2:.1f} tok/s, alone {a1:.1f} / {a2:.1f} tok/s: {ratio:.3f}")
    assert 0.95 <= ratio <= 1.05, (a1, b1, a2, b2)
