"""`specrt compare`: every graph family of an artifact on several backends, fed the same inputs.

Polygraphy's `run --onnxrt --trt` for specrt artifacts: per family and bucket use, the largest bucket is
run twice on slots [0, B) with seeded random inputs that respect the graph contract (positions that
continue the cache, valid logit rows, padding context rows), so the second call reads the cache the first
one wrote. Every backend is compared against the first (the reference), output by output.

Draft tokens must match exactly, except where the reference itself is a near tie (the winning logits, or
the sampling threshold and the CDF, within atol): such a flip is legitimate, and positions after it in the
same block are conditioned on a different token, so they are left out of the comparison.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.runtime import calls
from specrt.runtime.backends import BACKENDS, infer, load_runner

CALLS = 2  # the second call of a use reads the cache the first one wrote
DEFAULT_ATOL = {"float32": 1e-3, "float16": 5e-2}


@dataclass(frozen=True, slots=True)
class OutputDiff:
    """One output of one call on one backend, against the reference backend."""

    family: str
    use: str
    call: int
    bucket: dict[str, int]
    backend: str
    output: str
    shape: tuple[int, ...]
    max_abs: float  # floats: max |a - b| over the compared positions; 0 for draft tokens
    mismatches: int  # integers: positions that differ; floats: 0
    unexplained: int  # integer mismatches that no near tie in the reference explains
    ok: bool


@dataclass(frozen=True, slots=True)
class Comparison:
    artifact: str
    backends: tuple[str, ...]  # the first is the reference
    seed: int
    atol: float
    diffs: tuple[OutputDiff, ...]

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs)

    def to_dict(self) -> dict:
        return {"artifact": self.artifact, "reference": self.backends[0], "backends": list(self.backends),
                "seed": self.seed, "atol": self.atol, "ok": self.ok, "results": [asdict(d) for d in self.diffs]}


def parse_backends(text: str) -> tuple[str, ...]:
    """`ort,torch` -> ("ort", "torch"); unknown names and fewer than two backends are user errors."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise SpecrtError(f"unknown backend {unknown[0]!r}; choose from {', '.join(BACKENDS)}")
    if len(set(names)) < 2 or len(set(names)) != len(names):
        raise SpecrtError(f"compare needs at least two different backends, got {text!r}")
    return names


def random_feeds(manifest: io.Manifest, family: str, bucket: io.Bucket, call: int, rng: np.random.Generator,
                 start: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Valid inputs of one call whose new rows begin at cache position start[b]; also the next call's start."""
    spec, vocab, b = manifest.graphs[family], manifest.model.vocab_size, bucket["B"]
    feeds = {t.name: (rng.integers(0, vocab, t.resolve(bucket)) if t.dtype == "int64"
                      else rng.standard_normal(t.resolve(bucket)).astype(t.dtype)) for t in spec.host_inputs()}
    if io.TRUNCATE_BUDGET in feeds:  # ConfidenceTruncate: threshold mode and budget mode in turn
        k = feeds[io.NOISE].shape[1]
        feeds[io.TRUNCATE_THRESHOLD] = np.array(rng.uniform(0.2, 0.8), np.float32)
        feeds[io.TRUNCATE_BUDGET] = np.array(-1 if call % 2 else rng.integers(0, b * k + 1), np.int64)
    if io.TEMPERATURE in feeds:  # greedy and sampled slots alternate, and swap on the next call
        feeds[io.TEMPERATURE] = (((np.arange(b) + call) % 2) * 0.8).astype(np.float32)
        feeds[io.NOISE] = rng.random(feeds[io.NOISE].shape, dtype=np.float32)
    if io.INPUT_IDS in feeds:  # target: T tokens at start..start+T-1; P of the cells computed, R of them logits
        t, p, r = bucket["T"], bucket["P"], bucket["R"]
        computed = np.full(b, t)  # packed: each slot computes a prefix of its row, as a verify round does
        while computed.sum() > p:
            computed[rng.choice(np.flatnonzero(computed))] -= 1
        cells = np.concatenate([i * t + np.arange(c) for i, c in enumerate(computed)]).astype(np.int64)
        ids = feeds[io.INPUT_IDS]
        calls.target.grid(feeds, ids[:, 0], start, ids[:, 1:], cells)
        if io.TREE_MASK in feeds:  # chains: the torch backend's modules verify no trees
            feeds[io.TREE_MASK][...] = 0
        if r != p:
            feeds[io.LOGIT_ROWS][:] = rng.integers(0, p, r)
        return feeds, start + computed  # the next call overwrites the cells not computed
    c = bucket["C"]
    contract = calls.for_head(manifest.heads[family].kind)
    rows = rng.integers(1, c + 1, b)  # real context rows; the rest is padding the next call overwrites
    if io.MTP_TOKENS in feeds:  # MTP: rows up to last_row are real; the next call continues after them
        ctx = calls.ContextRows(feeds[io.MTP_HIDDEN], feeds[io.MTP_TOKENS], start, rows)
    else:  # DSpark: context rows at or past ctx_len are padding
        ctx = calls.ContextRows(feeds[io.CTX_FEATURES], np.zeros((b, c), np.int64), start, rows)
    contract.propose(feeds, ctx, feeds.get(io.ANCHOR_IDS, np.zeros(b, np.int64)))
    return feeds, start + rows


def _near_ties(ref: dict[str, np.ndarray], tokens: np.ndarray, feeds: dict[str, np.ndarray], atol: float
               ) -> np.ndarray:
    """[B,K] bool: where the reference's own draw could flip to `tokens` within atol."""
    ref_tok, near = ref[io.DRAFT_TOKENS], np.zeros(tokens.shape, bool)
    logits, probs = ref[io.DRAFT_LOGITS].astype(np.float64), ref[io.DRAFT_PROBS].astype(np.float64)
    for b, k in np.argwhere(ref_tok != tokens):
        a, o = int(ref_tok[b, k]), int(tokens[b, k])
        if feeds[io.TEMPERATURE][b] > 0:  # token = #(cdf <= noise * total): every CDF value between at the threshold
            cdf = np.cumsum(probs[b, k])
            near[b, k] = np.abs(cdf[min(a, o):max(a, o)] - feeds[io.NOISE][b, k] * cdf[-1]).max() <= atol
        else:  # greedy: the two winners tie within atol
            near[b, k] = abs(logits[b, k, a] - logits[b, k, o]) <= atol
    return near


def compare_outputs(ref: dict[str, np.ndarray], out: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
                    atol: float) -> dict[str, tuple[float, int, int, bool]]:
    """Per output of `out` against `ref`: (max abs diff, token mismatches, unexplained mismatches, ok)."""
    skip = None  # [B,K]: positions after a (near-tie) token flip in their block
    result = {}
    if io.DRAFT_TOKENS in ref:
        neq = ref[io.DRAFT_TOKENS] != out[io.DRAFT_TOKENS]
        skip = np.cumsum(neq, axis=1) - neq > 0
        unexplained = neq & ~skip & ~_near_ties(ref, out[io.DRAFT_TOKENS], feeds, atol)
        result[io.DRAFT_TOKENS] = (0.0, int(neq.sum()), int(unexplained.sum()), not unexplained.any())
    for name, a in ref.items():
        if name == io.DRAFT_TOKENS:
            continue
        diff = np.abs(a.astype(np.float64) - out[name].astype(np.float64))
        if skip is not None and diff.ndim >= 2:  # [B,K,...] outputs: the positions up to each block's first flip
            diff = diff[~skip]
        elif skip is not None:  # [B] (verify lengths): the blocks without a flip
            diff = diff[~skip.any(axis=1)]
        worst = float(diff.max(initial=0.0))
        result[name] = (worst, 0, 0, worst <= atol)  # NaN fails
    return result


def _compared_buckets(spec: io.GraphSpec) -> list[tuple[str, io.Bucket]]:
    """Each use's largest bucket, and for packed uses also the largest grid at its smallest token budget."""
    out = []
    for use, buckets in spec.buckets.items():
        big = max(buckets, key=lambda b: (math.prod(b.values()), tuple(b.values())))
        out.append((use, big))
        if "P" in big:
            out.append((use, min((b for b in buckets if (b["B"], b["T"]) == (big["B"], big["T"])),
                                 key=lambda b: b["P"])))
    return [(u, b) for i, (u, b) in enumerate(out) if (u, b) not in out[:i]]


def compare_artifact(art_dir: str | Path, backends: tuple[str, ...], *, seed: int = 0, atol: float | None = None,
                     threads: int | None = None) -> Comparison:
    """Run each family's largest bucket of every use twice on every backend; diff against the first backend."""
    manifest = io.load_manifest(art_dir)
    atol = DEFAULT_ATOL[manifest.export.dtype] if atol is None else atol
    slots = manifest.export.batch
    diffs = []
    for fi, (family, spec) in enumerate(manifest.graphs.items()):
        runners = {name: load_runner(name, art_dir, manifest, family, threads=threads) for name in backends}
        for runner in runners.values():
            runner.allocate(slots)
        for ui, (use, bucket) in enumerate(_compared_buckets(spec)):
            n = max(bucket.get("T", 0), bucket.get("C", 0))
            steps = manifest.heads[family].steps if family in manifest.heads else 0
            rng = np.random.default_rng([seed, fi, ui])
            start = rng.integers(0, max(1, spec.max_seq - 1 - 2 * n - steps), bucket["B"])
            for call in range(1, CALLS + 1):
                feeds, start = random_feeds(manifest, family, bucket, call, rng, start)
                ref, *others = [dict(infer(runners[name], 0, feeds)) for name in backends]
                for name, out in zip(backends[1:], others):
                    for output, (max_abs, mism, bad, ok) in compare_outputs(ref, out, feeds, atol).items():
                        diffs.append(OutputDiff(family, use, call, dict(bucket), name, output, ref[output].shape,
                                                max_abs, mism, bad, ok))
    return Comparison(str(art_dir), backends, seed, atol, tuple(diffs))


def format_table(c: Comparison) -> str:
    """A fixed-width table, one line per output and call, and a verdict line."""
    head = ("family", "use", "call", "bucket", "backend", "output", "shape", "max_abs", "mismatch", "status")
    rows = [head]
    for d in c.diffs:
        is_int = d.output == io.DRAFT_TOKENS
        rows.append((d.family, d.use, str(d.call), " ".join(f"{k}={v}" for k, v in d.bucket.items()), d.backend,
                     d.output, "x".join(map(str, d.shape)), "" if is_int else f"{d.max_abs:.2e}",
                     f"{d.mismatches} ({d.unexplained} unexplained)" if is_int and d.mismatches else
                     ("0" if is_int else ""), "PASSED" if d.ok else "FAILED"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"specrt compare {c.artifact}: {c.backends[0]} (reference) vs {', '.join(c.backends[1:])}, "
             f"seed {c.seed}, atol {c.atol:g}"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    failed = [d for d in c.diffs if not d.ok]
    lines.append(f"PASSED: {len(c.diffs)} outputs agree" if not failed else f"FAILED: {len(failed)} of {len(c.diffs)}")
    return "\n".join(lines)


def failure_message(c: Comparison) -> str:
    """The one-line error for a failed comparison: the worst offender."""
    bad = [d for d in c.diffs if not d.ok]
    d = max(bad, key=lambda d: (d.unexplained, d.max_abs))
    what = f"{d.unexplained} unexplained token mismatches" if d.unexplained else f"max abs diff {d.max_abs:.3g}"
    return (f"backends disagree: {d.family} {d.use} call {d.call} {d.output} on {d.backend}: {what} "
            f"(atol {c.atol:g}; {len(bad)} of {len(c.diffs)} outputs differ)")
