"""ONNX Runtime backend: one session per graph family, IOBinding over buffers allocated once.

A family's graph declares its B/T/R/C axes symbolic, so one session serves every bucket of the family
(prefill chunk, decode, verify): one copy of the (prepacked) weights in memory. Each layer's KV cache
is one numpy array (all of them views of one mapping, `_cache_block`) bound as both `past.*` and `present.*`
(the graph scatters the new K/V into it in place); a call over slots [s, s+n) binds cache[s:s+n].
Per bucket, host input buffers, output buffers and the binding are created on first use and reused.

A cache of named length S (the cpu lowering's target, `GraphSpec.sized_cache`) starts at `GROWTH` positions
and grows (by whole `GROWTH`s, up to max_seq, contents copied, bindings re-pointed) before a call that writes
past it, so attention reads about what the sequences hold, not S_MAX.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import onnx

from specrt import artifact as io
from specrt.errors import SpecrtError
from specrt.native import ops_library, uses_kernels
from specrt.runtime.backends import SHARED_POOL_ENV

try:
    import onnxruntime as ort
except ImportError:  # pragma: no cover - depends on the installed extra
    ort = None


def _declared_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Each graph input/output's declared dims (ints, or axis names)."""
    return {vi.name: tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)
            for vi in (*model.graph.input, *model.graph.output)}


def _ortvalue(buf: np.ndarray, dtype: str) -> "ort.OrtValue":
    """An OrtValue over `buf` (no copy); a bfloat16 tensor is held as its uint16 bits (io.storage_dtype)."""
    if dtype == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(buf)


_shared_pool: int | None = None  # the process's shared intra-op pool's size, once created (SPECRT_ORT_SHARED_POOL=1)


def session_options(threads: int | None = None, *, spin: bool = True) -> "ort.SessionOptions":
    """Options for every specrt session: each its own intra-op pool, `spin=False` when another session runs in turn
    with this one (idle spinning threads would steal the cores the other session needs next); or, with
    $SPECRT_ORT_SHARED_POOL=1, every session of the process on one pool sized by the first (ONNX Runtime's global
    thread pool, as the C++ runtime always does).

    The shared pool is the default where specrt owns the process: the `specrt` command (every subcommand, `serve`
    and the engines `bench` starts included) and the Triton model set the variable to 1 unless it is set
    (`specrt.runtime.backends.own_process_defaults`). There a draft call runs on the threads the target's call just
    used, and the target's next call finds them awake: with a pool per session the same DSpark round (fixed, 2
    drafts, code prompts) spent 6.0 ms in its verify of 3 tokens and 1.4 ms in its draft call, against 4.6 and 0.9 ms
    on one pool (docs/benchmarks.md). A library caller opts in with the variable: once ONNX Runtime's Python
    environment has a global pool it refuses, process-wide, every session that asks for threads of its own, so a
    service that opens its own ONNX Runtime sessions beside specrt's would break; $SPECRT_ORT_SHARED_POOL=0 keeps a
    pool per session in specrt's own processes too."""
    global _shared_pool
    cores = max(1, len(os.sched_getaffinity(0)))
    threads = min(threads, cores) if threads else cores  # more threads than cores only contend (artifact rules)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if os.environ.get(SHARED_POOL_ENV) == "1" or _shared_pool is not None:
        if _shared_pool is None:
            ort.capi._pybind_state.set_global_thread_pool_sizes(threads, 1)
            _shared_pool = threads
        so.use_per_session_threads = False  # the pool's threads, whatever this session asked for
        return so
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


GROWTH = 64  # cache positions a sized cache grows by
HUGE_PAGE = 2 << 20


def _cache_block(tensors: list[tuple[str, tuple, np.dtype]]) -> dict[str, np.ndarray]:
    """Zeroed arrays for (name, shape, dtype), views of one anonymous mapping of whole 2 MiB pages, written once.

    Every decoding call's attention reads each layer's cache. As one numpy array per layer (a few hundred KB each,
    4 KiB pages from wherever the allocator had room) the same decoding call cost 2-3% more in an engine made after
    another than in the first (`scripts/engine_pair.py`: `ar` against `ar`, and a `dspark` engine whose head is never
    called, against `ar`). One private anonymous mapping, on a 2 MiB boundary and marked for transparent huge pages
    where the kernel has them (madvise), is the same memory whatever was allocated before it, and attention walks
    2 MiB pages. It is written once here (zeros), so no call takes a page fault."""
    sizes = [int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in tensors]
    spans = [-(-n // 64) * 64 for n in sizes]  # each array on its own cache lines
    total = sum(spans)
    if total == 0:
        return {name: np.zeros(shape, dtype) for name, shape, dtype in tensors}
    length = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a 2 MiB boundary
    if hasattr(mmap, "MAP_PRIVATE"):  # a private mapping: a shared one is shmem, which madvise leaves on 4 KiB pages
        block = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        block = mmap.mmap(-1, length)
    whole = np.frombuffer(block, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE, start, length - HUGE_PAGE)
    raw = whole[start:start + total]
    raw[:] = 0  # pages taken now, as the C++ runner's zeroed vectors are, not by the first calls that write them
    out, at = {}, 0
    for (name, shape, dtype), n, span in zip(tensors, sizes, spans):
        out[name] = raw[at:at + n].view(dtype).reshape(shape)
        at += span
    return out


class OrtRunner:
    """Serves one graph family of an artifact from one ONNX Runtime session (the `Runner` verbs)."""

    def __init__(self, art_dir: Path, graph: io.GraphSpec, *, threads: int | None = None,
                 spin: bool = True) -> None:
        if ort is None:
            raise SpecrtError("onnxruntime is not installed; install specrt[cpu] (or specrt[gpu])")
        self.spec = graph
        self.session = self._session(art_dir, graph, threads, spin)
        variant = graph.greedy()  # a draft family's greedy variant: its own session over the same cache
        self._specs = {False: graph, True: variant or graph}
        self._sessions = {False: self.session,
                          True: self._session(art_dir, variant, threads, spin) if variant else self.session}
        self.slots = 0
        self._sized = graph.sized_cache  # read once: run() is on the decode path
        self.cache_length = graph.max_seq  # positions allocated per slot: max_seq, or what a sized cache holds
        self._cache: dict[str, np.ndarray] = {}
        self._bindings: dict[tuple, tuple] = {}
        self._primed: set[tuple] = set()  # decoding buckets run once on this session (`_prime`)

    @staticmethod
    def _session(art_dir: Path, graph: io.GraphSpec, threads: int | None, spin: bool) -> "ort.InferenceSession":
        try:
            model = onnx.load(str(art_dir / graph.file), load_external_data=False)
        except Exception as e:  # protobuf's DecodeError for a corrupt file, OSError, ...
            reason = (getattr(e, "strerror", None) or str(e)).splitlines()[0] if str(e) else type(e).__name__
            raise SpecrtError(f"cannot load {graph.file}: {reason} (corrupt artifact? re-export it)") from None
        io.check_graph_io(graph, _declared_shapes(model), graph.file)
        io.check_graph_meta(graph, {p.key: p.value for p in model.metadata_props}, graph.file)
        for location in io.external_locations(model):
            io.inside(art_dir, str(Path(graph.file).parent / location), f"{graph.file}'s external data")
        # Loaded from bytes, so tell ORT where the external weights live.
        so = session_options(threads, spin=spin)
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(art_dir))
        if uses_kernels(model.graph.node):
            so.register_custom_ops_library(str(ops_library(graph.file)))
        try:
            return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for broken files
            raise SpecrtError(f"cannot load {graph.file}: {str(e).splitlines()[0]}") from None

    def allocate(self, slots: int) -> None:
        """Allocate (zeroed) KV buffers for `slots` request slots; drops bindings of an older size."""
        if slots != self.slots or not self._cache:
            self.slots = slots
            self._cache = {}
            self._bindings.clear()
            self._resize(min(GROWTH, self.spec.max_seq) if self._sized else self.spec.max_seq)
            self._prime()

    def _prime(self) -> None:
        """Run each decoding bucket that fits the slots once, on the fresh cache, before any other call of its batch.

        ONNX Runtime keeps one memory plan (`enable_mem_pattern`: every intermediate tensor at a planned offset of
        one block) per key of a call's input shapes and lets the first call of a key set it; the key is the XOR of
        all input dimensions, which for a target graph is the batch B for a decoding call and for every verify of B
        slots alike (input_ids and position_ids both [B, T], token_rows [P] and logit_rows [R = P], the caches'
        dimensions in pairs). An engine whose first round verified drafts decoded on a verify's plan, every tensor
        of every decoding call then allocated apart (ONNX Runtime's verbose log: 17,284 fallbacks in 64 tokens
        against `ar`'s 108). Decoding calls are the ones every engine makes most, so they set the plan; what they write
        (position 0 of each slot) is zeroed again, so the cache is as `allocate` promises."""
        ran = False
        for bucket in self.spec.buckets.get("decode", ()):
            key = tuple(sorted(bucket.items()))
            if bucket["B"] > self.slots or key in self._primed:
                continue
            binding, feeds, _, _, _ = self._binding(0, bucket)
            for buf in feeds.values():
                buf[...] = 0
            if io.TOKEN_ROWS in feeds:
                feeds[io.TOKEN_ROWS][...] = io.dense_rows(bucket)
            if io.LOGIT_ROWS in feeds:
                feeds[io.LOGIT_ROWS][...] = np.arange(feeds[io.LOGIT_ROWS].shape[0])
            self._sessions[False].run_with_iobinding(binding)  # not `run`: no caller's call, nothing to count
            self._primed.add(key)
            ran = True
        if ran:
            for buf in self._cache.values():  # [slots, H, S, D]: what the calls wrote, at position 0, zeroed again
                buf[:, :, 0] = 0

    def _resize(self, length: int) -> None:
        """(Re)allocate the caches at `length` positions, keeping what they hold; bindings start over."""
        old = self._cache
        specs, sizes = self.spec.cache_inputs(), {"B": self.slots, io.CACHE_LEN: length}
        io.check_memory(io.tensor_bytes(specs, sizes),
                        f"the {self.spec.name} KV cache for {self.slots} slots x {length} positions")
        self.cache_length = length
        self._cache = _cache_block([(t.name, t.resolve(sizes), np.dtype(io.storage_dtype(t.dtype))) for t in specs])
        self._cache_types = {t.name: t.dtype for t in specs}
        for name, buf in old.items():
            n = min(buf.shape[2], length)
            self._cache[name][:, :, :n] = buf[:, :, :n]
        # host buffers the caller may have filled for the coming call live on: re-point the cache bindings only
        for key, (b, _, _, _, views) in self._bindings.items():
            self._bind_cache(b, key[1], dict(key[2:])["B"], views)

    def _bind_cache(self, b, slot: int, n: int, views: list) -> None:
        """Bind each layer's cache rows [slot, slot + n) as both past and present; `views` keeps the OrtValues."""
        views.clear()
        for name, buf in self._cache.items():
            views.append(_ortvalue(buf[slot:slot + n], self._cache_types[name]))
            b.bind_ortvalue_input(name, views[-1])
            b.bind_ortvalue_output(name.replace("past.", "present.", 1), views[-1])

    def move_rows(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Copy cache positions `src` to `dst` of slot `slot`, for each (slot, src, dst), in every layer (a draft
        tree's accepted path, to the positions after its anchor)."""
        for buf in self._cache.values():
            for slot, src, dst in moves:
                buf[slot, :, dst] = buf[slot, :, src]

    def _fit(self, host: dict[str, np.ndarray], bucket: io.Bucket) -> None:
        """Grow a sized cache so the call's writes (write_index + T) land inside it."""
        need = int(host[io.WRITE_INDEX].max()) + bucket["T"]
        if need > self.cache_length < self.spec.max_seq:
            self._resize(min(self.spec.max_seq, -(-need // GROWTH) * GROWTH))

    def _binding(self, slot: int, bucket: io.Bucket, greedy: bool = False) -> tuple:
        key = (greedy, slot, *sorted(bucket.items()))
        if key not in self._bindings:
            n = bucket["B"]
            if slot < 0 or slot + n > self.slots:
                raise ValueError(f"slots [{slot}, {slot + n}) outside the allocated {self.slots}")
            spec = self._specs[greedy]
            io.check_memory(io.tensor_bytes((*spec.host_inputs(), *spec.host_outputs()), bucket),
                            f"the {spec.name} call buffers for bucket {dict(bucket)}")
            b = self._sessions[greedy].io_binding()
            host = {t.name: np.zeros(t.resolve(bucket), dtype=t.dtype) for t in spec.host_inputs()}
            outs = {t.name: np.zeros(t.resolve(bucket), dtype=t.dtype) for t in spec.host_outputs()}
            keep = []  # OrtValues view numpy memory: keep them alive with the binding
            for name, arr in host.items():
                keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
                b.bind_ortvalue_input(name, keep[-1])
            for name, arr in outs.items():
                keep.append(ort.OrtValue.ortvalue_from_numpy(arr))
                b.bind_ortvalue_output(name, keep[-1])
            views: list = []
            self._bind_cache(b, slot, n, views)
            self._bindings[key] = (b, host, outs, keep, views)
        return self._bindings[key]

    def inputs(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """The bound host input buffers for slots [slot, slot + B): fill them in place, then `run`."""
        return self._binding(slot, bucket, greedy)[1]

    def run(self, slot: int, bucket: io.Bucket, *, greedy: bool = False) -> dict[str, np.ndarray]:
        """Run on the buffers `inputs(slot, bucket)` returned; outputs stay valid until the next call. `greedy`:
        the family's greedy variant where it has one (outputs without io.GREEDY_DROPS)."""
        binding, host, outs, _, _ = self._binding(slot, bucket, greedy)
        if self._sized:
            self._fit(host, bucket)
        self._sessions[greedy].run_with_iobinding(binding)
        return outs
