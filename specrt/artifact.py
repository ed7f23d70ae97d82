"""The artifact format and the graph I/O contract shared by the exporter and every runtime backend.

An artifact is a directory:

    manifest.json     format version, model config, export settings, graph I/O specs, checksums
    weights.bin       every initializer of every graph, stored once (ONNX external data)
    <family>.onnx     target.onnx, and dspark.onnx / mtp.onnx for draft heads
    tokenizer/        tokenizer.json (+ config), when the source model has one

Every graph family (the target; one per draft head) is one ONNX file over named axes (B slots, T tokens
per slot, R logit rows per slot, C context rows); the manifest lists the fixed shapes ("buckets") each
family is run at. Target graph contract (S = S_MAX cache positions):

    inputs   input_ids[B,T] i64, position_ids[B,T] i64 (a grid: T tokens per slot),
             write_index[B] i64 (cache length per slot),
             token_rows[P] i64 (the grid cells b*T+t the call computes, distinct: packed verification),
             logit_rows[R] i64 (which of the P computed tokens get logits),
             past.{i}.key / past.{i}.value [B,Hkv,S,D]
    outputs  logits[R,V], features[B,T,F] (only when a draft head needs them; zero at cells not computed),
             present.{i}.key / present.{i}.value with the same shape as past, so one buffer is bound as both

The attention mask is built inside the graph from write_index: query t of slot b sees cache position s
iff s <= write_index[b] + t. Rollback is only a smaller write_index on the next call.
Linear layers and the MLP run on the P packed tokens; only attention works on the grid, per slot against
that slot's cache. A grid cell not in token_rows writes zero K/V at its position, which no query of the call
sees (it lies past every computed token of its slot) and a later call overwrites. A dense call (prefill,
decode) lists every cell: token_rows = arange(B*T) (`dense_rows`).
"""
from __future__ import annotations

import json
import math
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from specrt.errors import SpecrtError, quoted
from specrt.model_config import ModelConfig

FORMAT_VERSION = 5
# the versions this specrt reads: 4 is 5 without the target's tree_mask input (such a target verifies chains only)
READS_VERSIONS = (4, 5)
# Fields added to the manifest within a format version (readers ignore what they do not know); a cached default
# artifact (tools/default_artifact.py) is re-exported when this moves. 2: tokenizer.chat (the chat template's text
# around one user message, for the C++ runtime).
MANIFEST_REVISION = 2
# The exporter's graphs changed within a format version (the same inputs and outputs, the same manifest): a cached
# default artifact is re-exported when this moves. 2: a target layer's attention as one specrt::PackedAttention.
# 3: with specrt's kernels, the draft heads' own matrices as Q4_1 blocks (specrt::MatMulGGUF, not MatMulNBits).
# 4: with specrt's kernels, norms as specrt::RMSNorm / SkipRMSNorm and an MLP's SiLU and product in its MatMulGGUF.
# 5: the target's tree_mask input (draft trees: runtime/tree.py). 6: DSpark's draft_first_top / draft_first_probs.
GRAPHS_REVISION = 6
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.bin"
TOKENIZER_DIR = "tokenizer"
PROFILE_FILE = "profile.json"  # measured call costs (runtime/profile.py reads it, runtime/measure.py measures)
ENGINE_DIR = "engines"  # `specrt build`'s TensorRT engines (exporter/tensorrt_build.py)

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
WRITE_INDEX = "write_index"
TOKEN_ROWS = "token_rows"
LOGIT_ROWS = "logit_rows"
# [B, T, T] int64: nonzero at [b, t, j] hides grid cell j from cell t (a draft tree's cells that are not t's
# ancestors); all zeros is a chain, each cell seeing every earlier one. Targets exported before trees lack it.
TREE_MASK = "tree_mask"
LOGITS = "logits"
FEATURES = "features"

DTYPES = ("float32", "float16")
KV_DTYPES = ("float32", "float16", "bfloat16")  # the target cache's storage (ExportSettings.kv_dtype)
TARGET = "target"  # the target's graph family; draft families are named after their head ("dspark", "mtp")

Dim = int | str  # a fixed size, or a named axis: B slots, T tokens per slot, P tokens computed (packed), R logit
#                  rows, C context rows,
#                  S cache positions (cpu lowering's target: the runtime sizes it, up to GraphSpec.max_seq)
CACHE_LEN = "S"
PAST_PREFIX, PRESENT_PREFIX = "past.", "present."  # each layer's cache: past.{i}.key / .value in, present.{i}.* out
Bucket = dict[str, int]  # sizes of a family's named axes for one fixed shape it is run at

# ---- the rules an artifact is held to ------------------------------------------------------------------------------
# An artifact may come from someone else. Both loaders hold it to these rules (Python: load_manifest and the backends;
# C++: runtime/cpp/src/artifact.cpp, through runtime/cpp/src/rules.h, which scripts/gen_cpp_names.py writes from
# here), and one table of hostile artifacts (tests/hostile_artifacts.py) runs through both:
# - every integer below is an integer within its bounds ("*": every key of that object);
# - the buckets and max_seq of each graph family are those the export settings give (target_buckets, head_buckets),
#   and those its graph file records (GRAPH_META); its declared inputs and outputs are the manifest's;
# - model.vocab_size is the width of the target's logits, and a head's vocab_ids lie inside the vocabulary;
# - every path the manifest names, and every file of ARTIFACT_FILES present, resolves (links followed) inside the
#   artifact, and is a regular file (a FIFO would block a reader forever) of at most MAX_JSON_BYTES when it is JSON;
# - threads are capped at the cores the process may run on.
INT_LIMITS: dict[str, tuple[int, int]] = {
    "export.batch": (1, 4096),
    "export.max_seq": (2, 1 << 22),
    "export.prefill_chunk": (1, 1 << 16),
    "export.verify_len": (1, 256),
    "model.vocab_size": (1, 1 << 24),
    "graphs.*.max_seq": (2, 1 << 22),
    "heads.*.steps": (1, 256),
    "heads.*.feature_offset": (0, 1 << 24),
    "heads.*.feature_dim": (1, 1 << 24),
}
MAX_JSON_BYTES = 256 << 20  # manifest.json, profile.json, tokenizer.json
ARTIFACT_FILES = (MANIFEST, PROFILE_FILE, f"{TOKENIZER_DIR}/tokenizer.json")  # the JSON files the runtimes read
ARTIFACT_DIRS = (TOKENIZER_DIR, ENGINE_DIR)


def check_limits(d: dict[str, Any]) -> None:
    """Each integer of INT_LIMITS present in the manifest `d` is an integer within its bounds (one-line error)."""
    for path, (lo, hi) in INT_LIMITS.items():
        found: list[tuple[str, Any]] = [("", d)]
        for key in path.split("."):
            step = []
            for where, obj in found:
                if not isinstance(obj, dict):
                    continue
                items = obj.items() if key == "*" else ((key, obj[key]),) if key in obj else ()
                step += [(f"{where}.{k}" if where else str(k), v) for k, v in items]
            found = step
        for where, value in found:
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise SpecrtError(f"{where} must be an integer in {lo}..{hi}, got {quoted(value, 40)}")


def regular_file(path: Path, what: str) -> Path:
    """`path`, refused unless it is a regular file (a FIFO or device would block or flood a reader) and, for the
    JSON files the runtimes read, no larger than MAX_JSON_BYTES."""
    if not path.is_file():
        raise SpecrtError(f"{path}: the {what} is not a regular file; refusing it")
    if path.suffix == ".json" and path.stat().st_size > MAX_JSON_BYTES:
        raise SpecrtError(f"{path}: the {what} is {_size(path.stat().st_size)}, more than the "
                          f"{_size(MAX_JSON_BYTES)} a specrt artifact's JSON files may be; refusing it")
    return path


def past_names(layer: int) -> tuple[str, str]:
    return f"{PAST_PREFIX}{layer}.key", f"{PAST_PREFIX}{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"{PRESENT_PREFIX}{layer}.key", f"{PRESENT_PREFIX}{layer}.value"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A graph input or output; string dims are named axes whose size a bucket fixes."""

    name: str
    dtype: str  # numpy dtype name
    shape: tuple[Dim, ...]

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))

    def resolve(self, sizes: Bucket) -> tuple[int, ...]:
        """The shape with the named axes replaced by `sizes`."""
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)


# GraphSpec.bucket's answers: the loop asks the same few questions every round, and a spec (frozen, slotted) holds no
# cache of its own
_CHOSEN: dict[tuple, tuple[dict, "Bucket"]] = {}


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """One exported graph family: its file, its I/O signature over named axes, and the buckets it serves.

    `buckets` maps a use ("prefill", "decode", "verify" for the target; "prefill", "propose" for a draft
    head) to the fixed shapes the runtime runs it at. A backend that needs shapes ahead of time (TensorRT
    profiles, CUDA graphs) prepares exactly these; the loop rounds each call up to the nearest one.
    """

    name: str
    file: str
    max_seq: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    buckets: dict[str, tuple[Bucket, ...]]
    greedy_file: str = ""  # a draft family's greedy variant (same inputs and cache, no GREEDY_DROPS outputs)

    def greedy(self) -> "GraphSpec | None":
        """The greedy variant as a spec of its own (its file and outputs), if exported."""
        if not self.greedy_file:
            return None
        return dataclasses.replace(self, file=self.greedy_file, greedy_file="",
                                   outputs=tuple(t for t in self.outputs if t.name not in GREEDY_DROPS))

    def bucket(self, use: str, **need: int) -> Bucket:
        """The smallest bucket of `use` whose named sizes are all >= `need`: fewest slots, then fewest tokens
        per slot, then the smallest token budget (axes `need` leaves out take their smallest size)."""
        key = (id(self.buckets), use, *need.items())
        held = _CHOSEN.get(key)
        if held is not None and held[0] is self.buckets:
            return held[1]
        fits = [b for b in self.buckets.get(use, ()) if all(b[k] >= v for k, v in need.items())]
        if not fits:
            raise SpecrtError(f"graph {self.name}: no {use} bucket holds {need} "
                              f"(exported: {list(self.buckets.get(use, ()))})")
        chosen = min(fits, key=lambda b: tuple(b.values()))
        _CHOSEN[key] = (self.buckets, chosen)  # holding the dict keeps its id from being reused
        return chosen

    def cache_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if t.name.startswith("past."))

    @property
    def sized_cache(self) -> bool:
        """Whether the cache length is the named axis S: the runtime allocates only what the sequences hold
        (growing toward max_seq) and attention reads what it allocated."""
        return any(CACHE_LEN in t.axes for t in self.cache_inputs())

    def host_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if not t.name.startswith("past."))

    def host_outputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.outputs if not t.name.startswith("present."))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphSpec":
        return cls(name=d["name"], file=d["file"], max_seq=int(d["max_seq"]),
                   inputs=tuple(_tensor(t) for t in d["inputs"]), outputs=tuple(_tensor(t) for t in d["outputs"]),
                   buckets={use: tuple(dict(b) for b in bs) for use, bs in d["buckets"].items()},
                   greedy_file=d.get("greedy_file", ""))


def _tensor(t: dict[str, Any]) -> TensorSpec:
    return TensorSpec(t["name"], t["dtype"], tuple(t["shape"]))


def batch_sizes(batch: int) -> list[int]:
    """Slot-count buckets: powers of two below `batch`, and `batch`."""
    sizes = [1 << i for i in range(batch.bit_length()) if 1 << i < batch]
    return [*sizes, batch]


def token_budgets(slots: int, tokens: int) -> list[int]:
    """Packed verify budgets P for a B x T grid: the powers of two from B up to B*T, and B*T itself (one slot:
    just T, the grid is the packing)."""
    grid = slots * tokens
    if slots == 1:
        return [grid]
    return sorted({*(1 << i for i in range(grid.bit_length()) if slots <= 1 << i < grid), grid})


def target_buckets(s: "ExportSettings") -> dict[str, tuple[Bucket, ...]]:
    """Prefill one slot a chunk at a time (logits of its last token); decode 1 token for 1..B slots; verify
    2..verify_len tokens per slot, packed into a token budget P (`token_budgets`), logits of every one."""
    bs = batch_sizes(s.batch)
    return {"prefill": ({"B": 1, "T": s.prefill_chunk, "P": s.prefill_chunk, "R": 1},),
            "decode": tuple({"B": b, "T": 1, "P": b, "R": b} for b in bs),
            "verify": tuple({"B": b, "T": t, "P": p, "R": p} for b in bs for t in range(2, s.verify_len + 1)
                            for p in token_budgets(b, t))}


def dense_rows(bucket: Bucket) -> np.ndarray:
    """token_rows of a call that computes every cell of its B x T grid."""
    return np.arange(bucket["B"] * bucket["T"], dtype=np.int64)


def head_buckets(s: "ExportSettings") -> dict[str, tuple[Bucket, ...]]:
    """Prefill one slot's prompt context a chunk at a time; propose with 1..verify_len new context rows."""
    return {"prefill": ({"B": 1, "C": s.prefill_chunk},),
            "propose": tuple({"B": b, "C": c} for b in batch_sizes(s.batch) for c in range(1, s.verify_len + 1))}


def target_signature(*, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int, max_seq: int,
                     dtype: str, feature_dim: int = 0, cache_len: Dim | None = None, cache_dtype: str | None = None
                     ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The target graph's inputs and outputs over named axes B/T/P/R (see the module docstring); the cache
    length is `max_seq`, or the axis S (`CACHE_LEN`) when the runtime sizes it; its elements are `cache_dtype`
    (default: `dtype`)."""
    inputs = [TensorSpec(INPUT_IDS, "int64", ("B", "T")),
              TensorSpec(POSITION_IDS, "int64", ("B", "T")),
              TensorSpec(WRITE_INDEX, "int64", ("B",)),
              TensorSpec(TOKEN_ROWS, "int64", ("P",)),
              TensorSpec(LOGIT_ROWS, "int64", ("R",)),
              TensorSpec(TREE_MASK, "int64", ("B", "T", "T"))]
    outputs = [TensorSpec(LOGITS, dtype, ("R", vocab_size))]
    if feature_dim:
        outputs.append(TensorSpec(FEATURES, dtype, ("B", "T", feature_dim)))
    return cache_signature(inputs, outputs, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, max_seq=cache_len or max_seq, dtype=cache_dtype or dtype)


def cache_signature(inputs: list[TensorSpec], outputs: list[TensorSpec], *, num_layers: int, num_kv_heads: int,
                    head_dim: int, max_seq: Dim, dtype: str
                    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Append the per-layer past (inputs) and present (outputs) KV tensors, [B,Hkv,S,D] each."""
    cache = ("B", num_kv_heads, max_seq, head_dim)
    for i in range(num_layers):
        inputs += [TensorSpec(n, dtype, cache) for n in past_names(i)]
        outputs += [TensorSpec(n, dtype, cache) for n in present_names(i)]
    return tuple(inputs), tuple(outputs)


KERNELS = ("stock", "specrt")  # ExportSettings.kernels
# `specrt export`'s draft vocabulary for heads exported with their token counts (the shipped heads; every head
# `specrt distill` writes) unless --draft-vocab says otherwise: SmolLM2's DSpark draft call 0.22 decoding steps
# instead of 1.09, same τ (docs/speculation.md, "A smaller draft vocabulary")
DEFAULT_DRAFT_VOCAB = 2048


@dataclass(frozen=True, slots=True)
class ExportSettings:
    batch: int
    max_seq: int
    prefill_chunk: int
    verify_len: int
    dtype: str = "float32"
    attention: str = "standard"
    # float: weights in `dtype`; int8 / int4: ONNX Runtime's block quantizer; gguf: the GGUF file's own Q4_0 /
    # Q4_1 / Q8_0 blocks. Quantized graphs use com.microsoft ops (MatMulNBits, GatherBlockQuantized): ORT only.
    weights: str = "float"
    accuracy_level: int = 4  # quantized weights: MatMulNBits activations, 0 = fp32 (exact numerics), 4 = int8
    draft_vocab: int = 0  # draft heads (DSpark LM / Markov heads, MTP head) score only this many tokens (0: all)
    # stock: ONNX Runtime's own ops; specrt: the GGUF blocks (as the file's bytes) and attention through specrt's
    # kernels (libspecrt_ops, specrt.native), each output row computed the same whatever the call's rows
    kernels: str = "stock"
    # the target's KV cache: "" (the graph's dtype), or float16 / bfloat16 under a float32 graph (half the memory;
    # each element widened exactly when specrt::CacheAttention reads it, so only with kernels "specrt")
    kv_dtype: str = ""

    @property
    def cache_dtype(self) -> str:
        """The element type of the target's KV cache."""
        return self.kv_dtype or self.dtype

    def __post_init__(self) -> None:
        for name in ("batch", "max_seq", "prefill_chunk", "verify_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecrtError(f"--{name.replace('_', '-')} must be >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise SpecrtError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in ("float", "int8", "int4", "gguf"):
            raise SpecrtError(f"--weights must be one of float, int8, int4, gguf, got {self.weights!r}")
        if self.accuracy_level not in (0, 4):
            raise SpecrtError(f"--accuracy-level must be 0 (fp32 activations) or 4 (int8 activations), "
                              f"got {self.accuracy_level!r}")
        if not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool) or self.draft_vocab < 0:
            raise SpecrtError(f"--draft-vocab must be a token count >= 1 (0: the whole vocabulary), "
                              f"got {self.draft_vocab!r}")
        if self.weights != "float" and self.dtype != "float32":
            raise SpecrtError(f"--weights {self.weights} needs --dtype float32 (ONNX Runtime's quantized CPU ops)")
        if self.kernels not in KERNELS:
            raise SpecrtError(f"--kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.kernels == "specrt" and (self.weights != "gguf" or self.attention != "cpu"):
            raise SpecrtError("--kernels specrt runs a GGUF's own blocks on the CPU: it needs --weights gguf and "
                              f"--attention cpu (got --weights {self.weights} --attention {self.attention})")
        if self.kv_dtype and self.kv_dtype not in KV_DTYPES:
            raise SpecrtError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.cache_dtype != self.dtype and self.kernels != "specrt":
            raise SpecrtError(f"--kv-dtype {self.kv_dtype} is a cache that specrt's CacheAttention reads: it needs "
                              f"--kernels specrt (got --kernels {self.kernels})")
        if self.attention not in ("standard", "cpu"):
            raise SpecrtError(f"attention lowering must be 'standard' or 'cpu', got {self.attention!r}")
        if max(self.prefill_chunk, self.verify_len) >= self.max_seq:
            raise SpecrtError(f"max sequence length {self.max_seq} must exceed the prefill chunk "
                              f"({self.prefill_chunk}) and verify length ({self.verify_len})")


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """A draft head in the artifact: how the runtime drives its graph family (named like the head)."""

    name: str  # "dspark" | "mtp": the graph family
    kind: str  # "dspark" | "dflash" | "mtp"
    steps: int  # tokens drafted per call: the DSpark block size, or MTP's chained steps
    feature_offset: int  # this head's slice of the target's features[B,T,F]
    feature_dim: int
    confidence: bool = False  # DSpark: a confidence head outputs confidence_logits[B,K]
    temperatures: tuple[float, ...] = ()  # DSpark: STS calibration temperature per draft position
    feedback: str = ""  # MTP: hidden fed back to chained steps, "post" or "pre" the head norm
    # DSpark with a reduced draft vocabulary (`--draft-vocab`): the target token id of each column of its
    # draft_logits / draft_probs (sorted); empty: the columns are the whole vocabulary
    vocab_ids: tuple[int, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)  # the head checkpoint's own config, as exported

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadSpec":
        return cls(**{**d, "temperatures": tuple(d.get("temperatures") or ()),
                      "vocab_ids": tuple(d.get("vocab_ids") or ())})


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class WeightsInfo:
    file: str
    bytes: int
    created: str
    bytes_per_token: int = 0  # weight bytes a decoded token reads: target matmuls + LM head + one embedding row


@dataclass
class Manifest:
    model: ModelConfig
    export: ExportSettings
    graphs: dict[str, GraphSpec]  # by family: "target", and one per draft head
    tokenizer: dict[str, Any] | None  # tokenizer/ files, chat template, special tokens (runtime/tokenizer.py)
    sources: tuple[SourceFile, ...]
    weights: WeightsInfo
    name: str = ""
    format_version: int = FORMAT_VERSION
    specrt_version: str = ""
    features: tuple[int | str, ...] = ()  # target feature sources: layer ids, "final"
    heads: dict[str, HeadSpec] = field(default_factory=dict)
    runtime_shapes: str = "symbolic"  # each family is one graph over named axes, run at its buckets
    engines: dict[str, Any] = field(default_factory=dict)  # `specrt build`: TensorRT engines (exporter/tensorrt_build.py)

    @property
    def gamma(self) -> int:
        """Draft tokens verified per round at most (verify graphs take gamma + 1 tokens)."""
        return self.export.verify_len - 1

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.model.eos_token_ids)
        if self.tokenizer:
            ids |= set(self.tokenizer.get("eos_token_ids") or ())
        return ids

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, art_dir: Path) -> None:
        (art_dir / MANIFEST).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        return cls(model=ModelConfig.from_dict(d["model"]), export=ExportSettings(**d["export"]),
                   graphs={k: GraphSpec.from_dict(g) for k, g in d["graphs"].items()},
                   tokenizer=d.get("tokenizer"), sources=tuple(SourceFile(**f) for f in d.get("sources", ())),
                   weights=WeightsInfo(**d["weights"]), name=d.get("name", ""), format_version=d["format_version"],
                   specrt_version=d.get("specrt_version", ""), features=tuple(d.get("features", ())),
                   heads={k: HeadSpec.from_dict(h) for k, h in d.get("heads", {}).items()},
                   runtime_shapes=d.get("runtime_shapes", "symbolic"), engines=dict(d.get("engines") or {}))


GRAPH_META = "specrt.graph"  # ONNX metadata_props key: the cache length and buckets the graph was exported for


def graph_meta(spec: GraphSpec) -> str:
    """What a graph file records about itself (metadata_props[GRAPH_META]), for `check_graph_meta` on load."""
    return json.dumps({"max_seq": spec.max_seq, "buckets": spec.buckets}, sort_keys=True)


def check_graph_meta(graph: GraphSpec, meta: dict[str, str], file: str) -> None:
    """The manifest's max_seq and buckets for `graph` must be what its file was exported with (files exported
    before graphs carried GRAPH_META are checked by their declared shapes only)."""
    if GRAPH_META not in meta:
        return
    try:
        recorded = json.loads(meta[GRAPH_META])
        max_seq = recorded["max_seq"]
        buckets = {use: tuple(dict(b) for b in bs) for use, bs in recorded["buckets"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise SpecrtError(f"{file}: its {GRAPH_META} metadata is malformed (corrupt artifact? re-export it)") from None
    if max_seq != graph.max_seq:
        raise SpecrtError(f"{file} was exported for {max_seq} cache positions but the manifest says max_seq "
                          f"{graph.max_seq} (manifest and graphs disagree; re-export the artifact)")
    if buckets != graph.buckets:
        raise SpecrtError(f"{file} was exported for other shapes than the manifest's {graph.name} buckets "
                          f"(manifest and graphs disagree; re-export the artifact)")


def external_locations(model: Any) -> list[str]:
    """The external data files an ONNX ModelProto's tensors name (relative to its file), weights not read."""
    from onnx import TensorProto

    found: set[str] = set()

    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                yield from ([a.t] if a.HasField("t") else []) + list(a.tensors)
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from tensors(g)

    for t in tensors(model.graph):
        if t.data_location == TensorProto.EXTERNAL:
            found.update(e.value for e in t.external_data if e.key == "location")
    return sorted(found)


def inside(art: Path, name: Any, what: str) -> Path:
    """`art / name` for a path the artifact names, refused unless it is relative and resolves (symlinks
    followed) inside the artifact folder: an artifact may come from someone else."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise SpecrtError(f"{art}: the {what} {name!r} is not a path inside the artifact; refusing it")
    root, full = art.resolve(), (art / name).resolve()
    if full != root and root not in full.parents:
        raise SpecrtError(f"{art}: the {what} {name!r} leads outside the artifact (to {full}); refusing it")
    return art / name


def _check_paths(art: Path, m: "Manifest") -> None:
    """Every file the manifest names, and the fixed ones the runtime reads, stay inside the artifact."""
    for g in m.graphs.values():
        for file in (g.file, *filter(None, (g.greedy_file,))):
            inside(art, file, f"{g.name} graph file")
    inside(art, m.weights.file, "weights file")
    for name in (*ARTIFACT_DIRS, *ARTIFACT_FILES):
        if (art / name).exists() or (art / name).is_symlink():
            inside(art, name, "file")
            if name in ARTIFACT_FILES:
                regular_file(art / name, "file")
    for family, spec in ((m.engines or {}).get("families") or {}).items():
        if isinstance(spec, dict) and spec.get("engine"):
            inside(art, spec["engine"], f"{family} TensorRT engine")


def _check_sizes(m: "Manifest") -> None:
    """Numbers the runtime sizes buffers and checks ids by must agree with each other and with what the
    exporter derives from the export settings (absurd ones would be trusted otherwise)."""
    want = {TARGET: target_buckets(m.export)}
    for name in m.graphs:
        if name != TARGET:
            want[name] = head_buckets(m.export)
    for name, g in m.graphs.items():
        if g.max_seq != m.export.max_seq:
            raise SpecrtError(f"graph {name}: max_seq {g.max_seq} differs from export.max_seq {m.export.max_seq}")
        if g.buckets != want[name]:
            raise SpecrtError(f"graph {name}: its buckets are not those of the export settings (batch "
                              f"{m.export.batch}, prefill chunk {m.export.prefill_chunk}, verify length "
                              f"{m.export.verify_len})")
    logits = next((t for t in m.graphs[TARGET].outputs if t.name == LOGITS), None)
    if logits is None or logits.shape[-1] != m.model.vocab_size:
        got = logits.shape[-1] if logits is not None else "no logits"
        raise SpecrtError(f"model.vocab_size {m.model.vocab_size} differs from the target graph's logits ({got})")
    for h in m.heads.values():
        if h.name not in m.graphs:
            raise SpecrtError(f"head {h.name!r} has no graph family")
        if any(not isinstance(t, int) or not 0 <= t < m.model.vocab_size for t in h.vocab_ids):
            raise SpecrtError(f"head {h.name}: its vocab_ids leave the vocabulary (0..{m.model.vocab_size - 1})")


def available_memory() -> int | None:
    """Bytes of memory the system could give a new allocation (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds a tensor of `dtype`: itself, or for bfloat16 (which numpy lacks) its bits as
    uint16."""
    return np.dtype(np.uint16 if dtype == "bfloat16" else dtype)


def tensor_bytes(specs: "Iterable[TensorSpec]", sizes: Bucket, itemsize: int | None = None) -> int:
    """Bytes of the tensors `specs` at `sizes` (their own dtypes, or `itemsize` each), counted without overflow."""
    return sum(int(np.prod(t.resolve(sizes), dtype=np.float64)) * (itemsize or storage_dtype(t.dtype).itemsize)
               for t in specs)


def check_memory(nbytes: int, what: str) -> None:
    """Refuse (one line naming `what`, the size and the memory available) an allocation that cannot fit, before
    making it: sizes come from the manifest, which may come from someone else."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise SpecrtError(f"{what} needs {_size(nbytes)}, more than the {_size(avail)} of memory available")


def load_manifest(art_dir: str | Path) -> Manifest:
    """Read and validate an artifact's manifest; any problem is a one-line SpecrtError."""
    art = Path(art_dir)
    if not art.exists():
        raise SpecrtError(f"artifact not found: {art}")
    path = art / MANIFEST
    if not path.exists():
        raise SpecrtError(f"{art} is not a specrt artifact (no {MANIFEST}); create one with `specrt export`")
    inside(art, MANIFEST, "manifest")
    regular_file(path, "manifest")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecrtError(f"{path} is malformed: not valid JSON ({e})") from None
    except RecursionError:
        raise SpecrtError(f"{path} is malformed: nested too deeply") from None
    except ValueError as e:  # an integer past Python's digit limit (sys.set_int_max_str_digits)
        raise SpecrtError(f"{path} is malformed: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise SpecrtError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(d, dict):
        raise SpecrtError(f"{path} is malformed: expected a JSON object, got a {type(d).__name__}")
    version = d.get("format_version")
    if version not in READS_VERSIONS or isinstance(version, bool):
        raise SpecrtError(f"{art} has artifact format version {version}, this specrt reads versions "
                          f"{', '.join(map(str, READS_VERSIONS))}; re-export it with this specrt")
    try:
        check_limits(d)
        m = Manifest.from_dict(d)
    except SpecrtError as e:
        raise SpecrtError(f"{path} is malformed: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SpecrtError(f"{path} is malformed: {type(e).__name__} {e}") from None
    if TARGET not in m.graphs:
        raise SpecrtError(f"{path} is malformed: no {TARGET!r} graph")
    try:
        _check_sizes(m)
    except SpecrtError as e:
        raise SpecrtError(f"{path} is inconsistent: {e}") from None
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise SpecrtError(f"{path} is malformed: {type(e).__name__} {e}") from None
    _check_paths(art, m)
    for g in m.graphs.values():
        for file in filter(None, (g.file, g.greedy_file)):
            if not (art / file).is_file():
                raise SpecrtError(f"artifact {art} is incomplete: graph file {file} is missing")
    return m


def check_graph_io(graph: GraphSpec, declared: dict[str, tuple[Dim, ...]], file: str) -> None:
    """Compare a graph file's declared I/O shapes with its spec in the manifest (one-line error on mismatch)."""
    for t in (*graph.inputs, *graph.outputs):
        if t.name not in declared:
            raise SpecrtError(f"{file} has no tensor {t.name!r} that the manifest lists; re-export the artifact")
        got = declared[t.name]
        if len(got) != len(t.shape) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                           for a, b in zip(t.shape, got)):
            raise SpecrtError(f"{file}: {t.name} has shape {list(got)} but the manifest says {list(t.shape)} "
                              f"(manifest and graphs disagree; re-export the artifact)")


# ---- draft graphs --------------------------------------------------------------------------------
#
# DSpark (family "dspark"): one call writes C new context rows into the draft's own KV cache and
# drafts a block of K tokens for the anchor at position ctx_len (context = positions 0..ctx_len-1).
#   inputs   ctx_features[B,C,F] (raw target-layer outputs, concatenated), ctx_positions[B,C] i64,
#            ctx_write_index[B] i64 (draft cache length before this write), ctx_len[B] i64 (valid
#            context after it; rows at or past ctx_len are padding), anchor_ids[B] i64,
#            temperature[B] f32 (0 = greedy argmax), noise[B,K] f32 (uniform [0,1), one per draft slot),
#            past.{i}.key/value[B,Hkv,S,D]
#   outputs  draft_tokens[B,K] i64, draft_logits[B,K,V] (Markov-corrected), draft_probs[B,K,V] f32
#            (the distribution each token was drawn from: softmax(draft_logits / T), T=1 where T=0),
#            confidence_logits[B,K] (only with a confidence head), present.{i}.*
#   with a confidence head, also specrt::ConfidenceTruncate (plugins/confidence_truncate.py) on it:
#   inputs   truncate_threshold[] f32, truncate_budget[] i64 (-1: threshold mode)
#   outputs  survival[B,K] f32 (calibrated prefix survival), verify_lengths[B] i64
#
# MTP (family "mtp"): one call writes C rows (token x_{t+1}, target hidden h_t at position t) through
# the MTP block into its cache, then chains G draft steps from row last_row.
#   inputs   tokens[B,C] i64, hidden[B,C,d] (final-normed target hidden), positions[B,C] i64 (t;
#            cache slot = position), last_row[B] i64, temperature[B] f32, noise[B,G] f32, past.0.*
#   outputs  draft_tokens[B,G] i64, draft_logits[B,G,V], draft_probs[B,G,V] f32, present.0.*
#
# Greedy variants (GraphSpec.greedy_file, "{family}.greedy.onnx"): the same family for rounds where every slot
# decodes greedily. Same inputs (temperature and noise unread) and cache; draft tokens are the argmax; the
# outputs leave out GREEDY_DROPS, so nothing vocabulary-wide is computed past the heads' logits.

CTX_FEATURES = "ctx_features"
CTX_POSITIONS = "ctx_positions"
CTX_WRITE_INDEX = "ctx_write_index"
CTX_LEN = "ctx_len"
ANCHOR_IDS = "anchor_ids"
TEMPERATURE = "temperature"
NOISE = "noise"
DRAFT_TOKENS = "draft_tokens"
DRAFT_LOGITS = "draft_logits"
DRAFT_PROBS = "draft_probs"
GREEDY_DROPS = (DRAFT_LOGITS, DRAFT_PROBS)  # outputs a greedy variant does not have
CONFIDENCE_LOGITS = "confidence_logits"
# DSpark: the first position's FIRST_TOP likeliest tokens [B, A] (ids, best first) and their probabilities under the
# head's distribution at temperature 1 [B, A]: a draft tree's alternatives to the first draft (runtime/tree.py)
DRAFT_FIRST_TOP = "draft_first_top"
DRAFT_FIRST_PROBS = "draft_first_probs"
FIRST_TOP = 4
TRUNCATE_THRESHOLD = "truncate_threshold"
TRUNCATE_BUDGET = "truncate_budget"
SURVIVAL = "survival"
VERIFY_LENGTHS = "verify_lengths"
MTP_TOKENS = "tokens"
MTP_HIDDEN = "hidden"
MTP_POSITIONS = "positions"
MTP_LAST_ROW = "last_row"
# The graph input/output names above, and the cache's prefixes: what scripts/gen_cpp_names.py writes into the C++
# runtime's runtime/cpp/src/io_names.h (a test checks that header is current)
IO_NAMES = ("INPUT_IDS", "POSITION_IDS", "WRITE_INDEX", "TOKEN_ROWS", "LOGIT_ROWS", "TREE_MASK", "LOGITS",
            "FEATURES", "CTX_FEATURES", "CTX_POSITIONS", "CTX_WRITE_INDEX", "CTX_LEN", "ANCHOR_IDS", "TEMPERATURE",
            "NOISE", "DRAFT_TOKENS", "DRAFT_LOGITS", "DRAFT_PROBS", "DRAFT_FIRST_TOP", "DRAFT_FIRST_PROBS",
            "CONFIDENCE_LOGITS", "TRUNCATE_THRESHOLD", "TRUNCATE_BUDGET", "SURVIVAL", "VERIFY_LENGTHS", "MTP_TOKENS",
            "MTP_HIDDEN", "MTP_POSITIONS", "MTP_LAST_ROW", "PAST_PREFIX", "PRESENT_PREFIX", "CACHE_LEN")


def dspark_signature(*, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int, vocab_size: int,
                     num_features: int, block: int, max_seq: int, dtype: str, confidence: bool,
                     draft_vocab: int = 0) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The DSpark draft graph's inputs and outputs over named axes B/C (see the comment above); with a
    reduced draft vocabulary its logits and probs have `draft_vocab` columns (HeadSpec.vocab_ids)."""
    vocab_size = draft_vocab or vocab_size
    inputs = [TensorSpec(CTX_FEATURES, dtype, ("B", "C", num_features * hidden_size)),
              TensorSpec(CTX_POSITIONS, "int64", ("B", "C")),
              TensorSpec(CTX_WRITE_INDEX, "int64", ("B",)),
              TensorSpec(CTX_LEN, "int64", ("B",)),
              TensorSpec(ANCHOR_IDS, "int64", ("B",)),
              TensorSpec(TEMPERATURE, "float32", ("B",)),
              TensorSpec(NOISE, "float32", ("B", block))]
    outputs = [TensorSpec(DRAFT_TOKENS, "int64", ("B", block)),
               TensorSpec(DRAFT_LOGITS, dtype, ("B", block, vocab_size)),
               TensorSpec(DRAFT_PROBS, "float32", ("B", block, vocab_size)),
               TensorSpec(DRAFT_FIRST_TOP, "int64", ("B", min(FIRST_TOP, vocab_size))),
               TensorSpec(DRAFT_FIRST_PROBS, "float32", ("B", min(FIRST_TOP, vocab_size)))]
    if confidence:
        inputs += [TensorSpec(TRUNCATE_THRESHOLD, "float32", ()), TensorSpec(TRUNCATE_BUDGET, "int64", ())]
        outputs += [TensorSpec(CONFIDENCE_LOGITS, dtype, ("B", block)), TensorSpec(SURVIVAL, "float32", ("B", block)),
                    TensorSpec(VERIFY_LENGTHS, "int64", ("B",))]
    return cache_signature(inputs, outputs, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           max_seq=max_seq, dtype=dtype)


def mtp_signature(*, num_kv_heads: int, head_dim: int, hidden_size: int, vocab_size: int, steps: int,
                  max_seq: int, dtype: str, draft_vocab: int = 0) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The MTP draft graph's inputs and outputs over named axes B/C (see the comment above); with a reduced
    draft vocabulary its logits and probs have `draft_vocab` columns (HeadSpec.vocab_ids)."""
    vocab_size = draft_vocab or vocab_size
    inputs = [TensorSpec(MTP_TOKENS, "int64", ("B", "C")),
              TensorSpec(MTP_HIDDEN, dtype, ("B", "C", hidden_size)),
              TensorSpec(MTP_POSITIONS, "int64", ("B", "C")),
              TensorSpec(MTP_LAST_ROW, "int64", ("B",)),
              TensorSpec(TEMPERATURE, "float32", ("B",)),
              TensorSpec(NOISE, "float32", ("B", steps))]
    outputs = [TensorSpec(DRAFT_TOKENS, "int64", ("B", steps)),
               TensorSpec(DRAFT_LOGITS, dtype, ("B", steps, vocab_size)),
               TensorSpec(DRAFT_PROBS, "float32", ("B", steps, vocab_size))]
    return cache_signature(inputs, outputs, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           max_seq=max_seq, dtype=dtype)
