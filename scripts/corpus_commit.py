"""Commit a finished corpus part: its responses compressed into datasets/corpus/responses/, with their settings.

    python scripts/corpus_commit.py --part base|chat|followups --sampling greedy|deepspec [--work ~/.cache/specrt/corpus]
                                    [--max-new-tokens 256] [--generated "2026-12-07, 55 min on ..."]

Reads WORK/<part>-<sampling>-<n>.jsonl (scripts/corpus_generate.py), checks it answers every prompt of the part, and
writes <part>-<sampling>-<n>.jsonl.gz (rows in index order, compact JSON, a corpus file's path as corpus/<name>, the
same bytes for the same rows) and <part>-<sampling>-<n>.meta.json (the generation settings, token counts, finish
reasons); prints the counts for datasets/corpus/README.md.
"""
import argparse
import collections
import gzip
import io
import json
from pathlib import Path

from specrt.configs.fetch import cache_dir
from specrt.datasets import DATASETS_DIR
from specrt.distill.generate import SAMPLING, read_responses
from specrt.distill.sources import PARTS, part_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--part", choices=sorted(PARTS), required=True)
parser.add_argument("--sampling", choices=sorted(SAMPLING), required=True)
parser.add_argument("--work", type=Path, default=cache_dir() / "corpus")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--generated", default="", help="when and how fast it was generated (for the meta file)")
args = parser.parse_args()

name = f"{args.part}-{args.sampling}-{args.max_new_tokens}"
src = args.work / f"{name}.jsonl"
meta = json.loads((src.with_name(src.name + ".meta.json")).read_text())
rows = sorted(read_responses(src), key=lambda r: int(r["index"]))
split = part_prompts(args.part)
if [int(r["index"]) for r in rows] != list(range(len(split.prompts))):
    raise SystemExit(f"{src} holds {len(rows)} of the part's {len(split.prompts)} prompts: finish generating it")
out_dir = DATASETS_DIR / "corpus" / "responses"
buf = io.BytesIO()
with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as z:
    for r in rows:
        file = r["file"]
        if file is not None and "/" in file:
            r = {**r, "file": f"corpus/{Path(file).name}"}
        z.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
(out_dir / f"{name}.jsonl.gz").write_bytes(buf.getvalue())
files = ", ".join(dict.fromkeys(r["file"] if "/" not in (r["file"] or "") else f"corpus/{Path(r['file']).name}"
                                for r in rows))
meta.update({
    "artifact": "the default model (smollm2 preset: SmolLM2-135M-Instruct Q4_1 GGUF, specrt's kernels), 16 slots, "
                "max_seq 768, no heads (scripts/corpus_generate.py)",
    "prompts": f"corpus part {args.part!r} (specrt.distill.sources.part_prompts): {files}",
    "response_tokens": sum(len(r["response_ids"]) for r in rows),
    "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
    "finish_reasons": dict(collections.Counter(r["finish_reason"] for r in rows)),
    "generated": args.generated,
})
(out_dir / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
print(json.dumps({"file": f"responses/{name}.jsonl.gz", "bytes": len(buf.getvalue()), "prompts": len(rows),
                  **{k: meta[k] for k in ("response_tokens", "prompt_tokens", "finish_reasons")}}))
