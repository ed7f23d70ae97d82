"""Whether one engine's decoding calls are slower than another's in the same process, prompt by prompt.

    python scripts/engine_pair.py ART [--method dspark] [--scheduler sps] [--target own|session]
                                  [--no-head] [--prompts FILE.jsonl] [--limit 8] [--max-new-tokens 128] [--passes 4]

Opens an `ar` engine and a METHOD/SCHEDULER engine on the artifact in this process (as `specrt bench --concurrency`
does), then serves every prompt through both, one prompt at a time and in alternating order, --passes times. Per
prompt it takes the median of each engine's decoding calls (one token per slot) and their tokens/s, and prints the
medians over all prompts of the paired ratios (METHOD / ar): pairs a few seconds apart, so a drift of the machine's
speed cancels, where whole passes minutes apart cannot resolve a few percent.

    --target session   the METHOD engine's target runner runs on the ar engine's ONNX Runtime session (its own
                       caches and bindings): whether what differs is that session or what the engine does with it
    --target own       each engine its own session, as always
    --no-head          the METHOD engine's gated head is never called (a hybrid drafter's choice forced off)
    --method ar        the control: two ar engines
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from specrt import artifact as io
from specrt.runtime.backends import own_process_defaults
from specrt.runtime.config import EngineConfig
from specrt.runtime.prompts import encode_prompt, read_prompts_file
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer
from specrt.tools.concurrency import serve
from specrt.runtime.engine import Engine

ROOT = Path(__file__).resolve().parent.parent


def _record(runner, calls: dict, current: list) -> None:
    """Append each decoding call's seconds of `runner` to calls[current[0]]."""
    run = runner.run

    def timed(index, bucket, *args, **kw):
        t0 = time.perf_counter()
        out = run(index, bucket, *args, **kw)
        if bucket.get("T") == 1 and bucket.get("P", bucket["B"]) == bucket["B"]:
            calls[current[0]].append(time.perf_counter() - t0)
        return out

    runner.run = timed


def _never_call_head(drafter) -> None:
    choose = drafter.choose

    def forced(slots):
        found, survivals, _ = choose(slots)
        drafter.since_head, drafter._last_head = 0, False
        return found, survivals, False

    drafter.choose = forced


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art", type=Path)
    ap.add_argument("--method", default="dspark")
    ap.add_argument("--scheduler", default="sps")
    ap.add_argument("--target", choices=("own", "session"), default="own")
    ap.add_argument("--no-head", action="store_true")
    ap.add_argument("--prompts", type=Path, default=ROOT / "datasets" / "mt-bench.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    own_process_defaults()  # one ONNX Runtime pool, as in `specrt bench`
    manifest = io.load_manifest(args.art)
    tokenizer = Tokenizer.from_dir(args.art / io.TOKENIZER_DIR, manifest.tokenizer)
    prompts = [encode_prompt(tokenizer, t) for t in read_prompts_file(args.prompts, args.limit)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ar = Engine.open(args.art, EngineConfig(method="ar", threads=args.threads, slots=1))
    other = Engine.open(args.art, EngineConfig(method=args.method, scheduler=args.scheduler if args.method != "ar"
                                               else "fixed", threads=args.threads, slots=1))
    if args.target == "session":
        other.target.session = ar.target.session
        other.target._sessions = ar.target._sessions
        other.target._bindings.clear()
    if args.no_head:
        if not hasattr(other.drafter, "choose"):
            print(f"--no-head: {args.method}/{args.scheduler} has no gated head", file=sys.stderr)
            return 2
        _never_call_head(other.drafter)
    calls: dict[str, list[float]] = {"ar": [], "other": []}
    current = ["ar"]
    _record(ar.target, calls, current)
    _record(other.target, calls, current)
    engines = {"ar": ar, "other": other}
    for name, engine in engines.items():  # warm-up
        current[0] = name
        serve(engine, prompts[:2], params, 1)
    call_ratios, speed_ratios = [], []
    for k in range(args.passes):
        for j, prompt in enumerate(prompts):
            medians, speeds = {}, {}
            for name in (("ar", "other") if (k + j) % 2 == 0 else ("other", "ar")):
                current[0] = name
                calls[name] = []
                row, _ = serve(engines[name], [prompt], params, 1)
                medians[name], speeds[name] = statistics.median(calls[name]), row["tokens_per_s"]
            call_ratios.append(medians["other"] / medians["ar"])
            speed_ratios.append(speeds["other"] / speeds["ar"])
    label = f"{args.method}/{args.scheduler} target={args.target}" + (" no-head" if args.no_head else "")
    print(f"{label}: decoding call / ar's, median of {len(call_ratios)} prompt pairs {statistics.median(call_ratios):.3f}"
          f" ({sum(r > 1 for r in call_ratios)} above 1); tokens/s / ar's {statistics.median(speed_ratios):.3f}")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
