"""Build the packaged-material prompt sets of the training corpus (specrt/distill/sources.py) into datasets/corpus/.

    python scripts/corpus_prompts.py [--out datasets/corpus] [--only NAME ...]
        ->  stdlib, numpy (code), careers, world (chat; need `pip install faker pycountry`), followups (multi-turn,
            from the committed greedy responses and the default model's tokenizer); prints counts

Each file is written whole (same rows, same bytes); the versions that built it go into datasets/corpus/README.md by
hand (the docstrings and lists are those versions').
"""
import argparse
import gzip
import json
from pathlib import Path

from specrt.configs.fetch import cache_dir
from specrt.datasets import DATASETS_DIR
from specrt.distill import sources
from specrt.distill.prompts import dataset_files
from specrt.artifact import load_manifest
from specrt.runtime.tokenizer import Tokenizer

RESPONSES = DATASETS_DIR / "corpus" / "responses" / "base-greedy-256.jsonl.gz"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", type=Path, default=DATASETS_DIR / "corpus")
parser.add_argument("--only", nargs="+", choices=[*sources.SOURCES, *sources.CHAT_SOURCES, "followups"])
parser.add_argument("--target", type=Path, default=cache_dir() / "corpus" / "target-b16",
                    help="an artifact of the model that wrote RESPONSES (its tokenizer decodes the answers)")
parser.add_argument("--max-tokens", type=int, default=512,
                    help="followups: skip conversations whose first prompt and answer pass this many tokens")
args = parser.parse_args()


def followups() -> list[dict]:
    """Each base training prompt the default model answered before its length limit, with that answer."""
    manifest = load_manifest(args.target)
    tokenizer = Tokenizer.from_dir(args.target / "tokenizer", manifest.tokenizer)
    split = sources.part_prompts("base")
    all_turns = {p.stem: [json.loads(line)["turns"] for line in p.read_text().splitlines() if line.strip()]
                 for p in dataset_files()}
    conversations = []
    for line in gzip.decompress(RESPONSES.read_bytes()).decode().splitlines():
        r = json.loads(line)
        if r["finish_reason"] != "eos" or len(r["prompt_ids"]) + len(r["response_ids"]) > args.max_tokens:
            continue
        prompt = split.prompts[r["index"]]
        turns = tuple(all_turns[r["file"]][r["row"]]) if r["file"] in all_turns else (prompt.text,)
        assert turns[0] == prompt.text, r["index"]
        answer = tokenizer.decode(r["response_ids"], skip_special_tokens=True).strip()
        conversations.append((f"{r['file']}:{r['row']}", turns, answer))
    return sources.followup_prompts(conversations)


counts = {}
for name in args.only or [*sources.SOURCES, *sources.CHAT_SOURCES, "followups"]:
    if name in sources.SOURCES:
        rows = sources.prompts(name)
    elif name in sources.CHAT_SOURCES:
        rows = sources.chat_prompts(name)
    else:
        rows = followups()
    sources.write(rows, args.out / f"{name}.jsonl.gz")
    counts[name] = len(rows)
print(json.dumps({"prompts": counts, "built_with": sources.built_with()}))
