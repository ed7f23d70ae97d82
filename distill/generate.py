"""Stage a of distillation: the target's own responses to the training prompts, as resumable JSONL.

One line per finished prompt, appended and flushed as soon as that request finishes:
    {"index", "file", "row", "prompt_ids", "response_ids", "finish_reason"}
A sidecar `<out>.meta.json` records the generation settings; a restart with the same settings skips the
indices already written (a truncated last line from an interrupted run is cut off first).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.distill.prompts import Prompt
from specrt.runtime.config import EngineConfig
from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_conversation, encode_prompt
from specrt.runtime.sampling import SamplingParams

# DeepSpec regenerated its training responses with T=0.7, top-p 0.8, top-k 20 (non-thinking mode).
SAMPLING: dict[str, dict[str, float | int]] = {
    "greedy": dict(temperature=0.0),
    "deepspec": dict(temperature=0.7, top_p=0.8, top_k=20),
}
TOO_LONG = "prompt_too_long"  # finish_reason of a prompt that leaves no room in the artifact's cache

PromptLike = Prompt | str | Sequence[int]  # text is rendered with the chat template; ids are used as given


def sampling_params(sampling: str, *, max_new_tokens: int, seed: int) -> SamplingParams:
    """The SamplingParams of a named sampling mode ("greedy" or "deepspec")."""
    if sampling not in SAMPLING:
        raise SpecrtError(f"unknown sampling {sampling!r}; choose one of {', '.join(SAMPLING)}")
    return SamplingParams(**SAMPLING[sampling], max_new_tokens=max_new_tokens, seed=seed)


def meta_path(responses_jsonl: str | Path) -> Path:
    """The settings sidecar of a responses file."""
    p = Path(responses_jsonl)
    return p.with_name(p.name + ".meta.json")


def read_responses(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The complete lines of a responses file (`.gz`: gzip'd, as datasets/corpus/responses/ commits them); a
    truncated last line is ignored (cut off if `repair`)."""
    p = Path(path)
    if not p.is_file():
        return []
    data = p.read_bytes()
    if p.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise SpecrtError(f"cannot read {p}: {e}") from None
        repair = False
    end = data.rfind(b"\n") + 1  # bytes after the last newline belong to an interrupted write
    rows = []
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise SpecrtError(f"{p}:{lineno}: not a JSON line; delete the file to regenerate it") from None
    if repair and end < len(data):
        with open(p, "r+b") as f:
            f.truncate(end)
    return rows


def _prompt_ids(engine: Engine, prompt: PromptLike) -> tuple[list[int], str | None, int | None]:
    """(ids, file, row) of one prompt; text goes through the chat template."""
    return _ids(engine.tokenizer, prompt)


def _ids(tokenizer, prompt: PromptLike) -> tuple[list[int], str | None, int | None]:
    if isinstance(prompt, Prompt):
        ids = list(prompt.ids) if prompt.ids is not None else encode_conversation(tokenizer, prompt.turns)
        return ids, prompt.file, prompt.row
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt), None, None
    return [int(t) for t in prompt], None, None


def prompt_tokens(tokenizer, prompt: PromptLike) -> int:
    """The tokens generation prefills for one prompt (text through the chat template)."""
    return len(_ids(tokenizer, prompt)[0])


def _check_meta(out: Path, meta: dict[str, Any]) -> None:
    """Write the settings sidecar, or check that an existing one (from an earlier run) agrees."""
    side = meta_path(out)
    if side.is_file() and out.is_file():
        old = json.loads(side.read_text())
        diff = [k for k in meta if k not in ("artifact", "num_prompts") and old.get(k) != meta[k]]
        if diff:
            raise SpecrtError(f"{out} was generated with other settings ({', '.join(diff)} differ); "
                              "use another output file or delete it")
    side.write_text(json.dumps(meta, indent=1))


def generate_responses(art_dir: str | Path, prompts: Sequence[PromptLike], out_jsonl: str | Path, *,
                       max_new_tokens: int = 256, sampling: str = "greedy", seed: int = 0,
                       threads: int | None = None, progress: bool = True, backend: str = "ort",
                       device: str = "cpu") -> Path:
    """Generate the target's response to every prompt (method "ar", B slots, continuous batching) into
    `out_jsonl`, one flushed line per finished prompt; rerunning resumes where an earlier run stopped.
    `backend`, `device`: where the engine runs (the torch backend on a GPU: "torch", "cuda")."""
    out = Path(out_jsonl)
    params = sampling_params(sampling, max_new_tokens=max_new_tokens, seed=seed)
    engine = Engine(art_dir, EngineConfig(threads=threads, backend=backend, device=device))
    encoded = [_prompt_ids(engine, p) for p in prompts]
    _check_meta(out, {"artifact": str(Path(art_dir).resolve()), "target": engine.manifest.name,
                      "target_sources": [s.sha256 for s in engine.manifest.sources],
                      "sampling": sampling, "sampling_params": {k: v for k, v in dataclasses.asdict(params).items()
                                                                if k not in ("stop_strings", "stop_token_ids")},
                      "num_prompts": len(prompts)})
    done = {int(r["index"]): r for r in read_responses(out, repair=True)}
    for i, r in done.items():
        if i >= len(encoded) or r["prompt_ids"] != encoded[i][0]:
            raise SpecrtError(f"{out} line for index {i} was generated for another prompt list; "
                              "use another output file or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f, \
            tqdm(total=len(encoded), initial=len(done), desc="generate", unit="prompt", disable=not progress) as bar:
        tokens, t0, shown = 0, time.perf_counter(), 0.0

        def write(index: int, response: list[int], reason: str) -> None:
            ids, file, row = encoded[index]
            f.write(json.dumps({"index": index, "file": file, "row": row, "prompt_ids": ids,
                                "response_ids": response, "finish_reason": reason}) + "\n")
            f.flush()
            bar.update(1)

        def on_token(_: int, n: int) -> None:
            nonlocal tokens, shown
            tokens += n
            now = time.perf_counter()
            if now - shown > 1.0:  # the postfix is refreshed at most once a second
                shown = now
                bar.set_postfix(tok_s=f"{tokens / (now - t0):.1f}", refresh=False)

        requests = []
        for i, (ids, _, _) in enumerate(encoded):
            room = engine.capacity - len(ids)  # cut max_new_tokens to what the cache can hold
            if i in done:
                continue
            if room < 1:
                write(i, [], TOO_LONG)
                continue
            requests.append(Request(prompt_ids=ids, id=i,
                                    params=dataclasses.replace(params, max_new_tokens=min(max_new_tokens, room))))
        if requests:
            engine.generate(requests, on_token=on_token,
                            on_finish=lambda o: write(o.id, o.output_ids, o.finish_reason))
        elapsed = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{tokens / elapsed:.1f}" if elapsed else "-")
    return out


def extra_sampling(k: int, sampling: str) -> str:
    """Sampling mode of a prompt's k-th response: the first uses `sampling`, the others DeepSpec's (a second
    greedy response would repeat the first)."""
    return sampling if k == 0 else "deepspec"


def responses_file(work: str | Path, k: int) -> Path:
    """Where the k-th response to every prompt goes (k = 0 keeps the single-response name)."""
    return Path(work) / ("responses.jsonl" if k == 0 else f"responses.{k}.jsonl")


def merge_responses(files: Sequence[str | Path], out_jsonl: str | Path, num_prompts: int) -> Path:
    """One responses file of K per-sample files: row `index` becomes k * num_prompts + index, and `sample` k
    is added. Written atomically; the same inputs always give the same bytes (so the feature cache is reused)."""
    out = Path(out_jsonl)
    per_file = [sorted(read_responses(path), key=lambda r: int(r["index"])) for path in files]
    for path, rows in zip(files, per_file):
        if len(rows) != num_prompts:
            raise SpecrtError(f"{path} has {len(rows)} responses, expected {num_prompts}; rerun to finish it")
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for k, rows in enumerate(per_file):
            for r in rows:
                f.write(json.dumps(dict(r, index=k * num_prompts + int(r["index"]), sample=k)) + "\n")
    os.replace(tmp, out)
    meta = [json.loads(meta_path(p).read_text()) for p in files if meta_path(p).is_file()]
    meta_path(out).write_text(json.dumps({"merged": [str(p) for p in files], "samples": meta}, indent=1))
    return out


def responses_meta(path: str | Path) -> dict[str, Any]:
    """The generation settings of a responses file: its sidecar (`<file>.meta.json`, or for a committed
    `<name>.jsonl.gz`, `<name>.meta.json`); {} where it has none."""
    p = Path(path)
    for side in (meta_path(p), p.with_name(p.name.removesuffix(".gz").removesuffix(".jsonl") + ".meta.json")):
        if side.is_file():
            try:
                return json.loads(side.read_text())
            except ValueError:
                raise SpecrtError(f"{side} is not valid JSON") from None
    return {}


def check_responses(files: Sequence[str | Path], target_sources: Sequence[str]) -> None:
    """Raise unless every responses file exists and its sidecar says this target (`target_sources`: the sha256 of
    its source files, as a manifest records them) generated it."""
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise SpecrtError(f"responses file not found: {p}")
        meta = responses_meta(p)
        if not meta:
            raise SpecrtError(f"{p} has no generation settings beside it ({meta_path(p).name}): it cannot be checked "
                              "against the target")
        if list(meta.get("target_sources", [])) != list(target_sources):
            raise SpecrtError(f"{p} was generated by another model ({meta.get('target') or 'unknown'}); train on "
                              "this target's own responses (--prompts generates them)")


VAL_FRACTION = 0.02  # of given responses' prompts, held out for training's evaluations


def given_responses(files: Sequence[str | Path], out_jsonl: str | Path, *, target_sources: Sequence[str],
                    calib_fraction: float, seed: int, val_fraction: float = VAL_FRACTION
                    ) -> tuple[Path, dict[str, list[int]]]:
    """Responses generated before (`scripts/corpus_generate.py`, an earlier `specrt distill`) as one responses file
    for the features stage, and its split: rows renumbered in file order, written atomically (the same files give
    the same bytes, so the feature cache is reused); a prompt's responses (its greedy and sampled ones, in any file)
    are all in "train" or all in "calib", a seeded draw of `calib_fraction` of the prompts, or in "val", a draw of
    `val_fraction` of the others (the held-out responses training evaluates on: prompts of every file, where the
    tail of the train split would hold the last file's only). Every file must have been generated by this target
    (its sidecar's `target_sources`)."""
    out = Path(out_jsonl)
    check_responses(files, target_sources)
    rows: list[dict[str, Any]] = []
    for f in files:
        p = Path(f)
        got = read_responses(p)
        if not got:
            raise SpecrtError(f"{p} has no responses")
        for r in sorted(got, key=lambda r: int(r["index"])):
            if not isinstance(r.get("prompt_ids"), list) or not isinstance(r.get("response_ids"), list):
                raise SpecrtError(f"{p}: row {r.get('index')} has no prompt_ids / response_ids lists")
            key = f"{r['file']}:{r['row']}" if r.get("file") is not None else f"{p.name}:{r['index']}"
            rows.append({**r, "index": len(rows), "prompt": key})
    prompts = sorted({r["prompt"] for r in rows})
    rng = np.random.default_rng(seed)
    calib = {prompts[i] for i in rng.choice(len(prompts), round(calib_fraction * len(prompts)), replace=False)}
    rest = [q for q in prompts if q not in calib]
    val = {rest[i] for i in rng.choice(len(rest), round(val_fraction * len(prompts)), replace=False)}
    splits = {"train": [r["index"] for r in rows if r["prompt"] not in calib | val],
              "calib": [r["index"] for r in rows if r["prompt"] in calib]}
    if val:
        splits["val"] = [r["index"] for r in rows if r["prompt"] in val]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if not (out.is_file() and out.read_bytes() == body):
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, out)
    return out, splits
