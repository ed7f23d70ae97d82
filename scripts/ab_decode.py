"""One sample of an A/B between two specrt checkouts: run it with each checkout's own Python, alternating.

    python scripts/ab_decode.py ARTIFACT METHOD   ->  {"tps": [decode tok/s per prompt], "ids": [output ids]}

Greedy decoding of the first 8 humaneval prompts (chat template applied), 128 new tokens each, 2 threads, after
one warm-up request; METHOD "ar", or a speculative method under the sps scheduler. Each call is a fresh process,
so alternate the two checkouts over several calls and compare per-pair medians (the spread between processes
is about +-10% on a 2-core machine); the ids tell whether the two checkouts generate the same tokens.
"""
import json
import sys

from specrt.datasets import DATASETS_DIR
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

art, method = sys.argv[1], sys.argv[2]
settings = dict(method=method, threads=2) if method == "ar" else dict(method=method, scheduler="sps", threads=2)
with Engine(art, **settings) as engine:
    tok = engine.tokenizer
    rows = (DATASETS_DIR / "humaneval.jsonl").read_text().splitlines()[:8]
    requests = [Request(tok.encode(tok.apply_chat_template([{"role": "user", "content": json.loads(r)["turns"][0]}]),
                                   add_special_tokens=False), SamplingParams(max_new_tokens=128), id=i)
                for i, r in enumerate(rows)]
    engine.generate(requests[:1])  # warm-up
    tps, ids = [], []
    for r in requests:
        out, stats = engine.generate([r])
        tps.append(stats.to_dict()["decode_tokens_per_s"])
        ids.append(out[0].output_ids)
print(json.dumps({"tps": tps, "ids": ids}))
