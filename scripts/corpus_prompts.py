"""Build the packaged-material prompt sets of the training corpus (specrt/distill/sources.py) into datasets/corpus/.

    python scripts/corpus_prompts.py [--out datasets/corpus]   ->  stdlib.jsonl.gz, numpy.jsonl.gz; prints counts

Each file is written whole (same rows, same bytes); the versions that built it go into datasets/corpus/README.md by
hand (the docstrings are those versions').
"""
import argparse
import json

from specrt.distill import sources

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="datasets/corpus")
args = parser.parse_args()
counts = {}
for name in sources.SOURCES:
    rows = sources.prompts(name)
    sources.write(rows, f"{args.out}/{name}.jsonl.gz")
    counts[name] = len(rows)
print(json.dumps({"prompts": counts, "built_with": sources.built_with()}))
