"""The engines `specrt bench` compares, each in a process of its own.

An engine's threads must not slow another's: ONNX Runtime's and llama.cpp's thread pools spin after a call,
so two engines in one process (or two busy processes) measure each other. Every engine here (a specrt method,
or a baseline: transformers, llama.cpp, OpenVINO GenAI) is loaded in a worker process started with `spawn`;
the bench sends it one prompt at a time and waits, so exactly one engine runs at any moment, and it can
check (from the workers' CPU times) that the others stayed idle meanwhile.

Every engine gets the same work: the prompt's token ids (never re-templated text), the same stop tokens
and the same token budget, greedy. A worker returns the tokens with the time each became available
(seconds from the request's start), so engines can be compared over the same number of tokens.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.native import cpp_environ, cpp_library

# specrt's C++ runtime (runtime/cpp, through its C API) running each method on the artifact itself (a variant too:
# cpp-ngram:tree=3)
CPP_BASELINES = tuple(f"cpp-{m}" for m in ("ar", "ngram", "dspark", "mtp", "dspark+ngram", "mtp+ngram"))
BASELINES = ("hf", "llama.cpp", "openvino", "openvino-lookup", *CPP_BASELINES)


def is_cpp(name: str) -> bool:
    """Whether a baseline's name is a method of the C++ runtime (cpp-METHOD, or a variant cpp-METHOD:tree=W)."""
    return name.partition(":")[0] in CPP_BASELINES


def is_baseline(name: str) -> bool:
    return name in BASELINES or is_cpp(name)
# Baselines with their own arithmetic (quantized weights, their own kernels and caches): their tokens are reported
# (first difference), never required to equal specrt ar's. hf runs the same fp32 weights and must match.
REPORTED_ONLY = ("llama.cpp", "openvino", "openvino-lookup")  # (the cpp baselines must match ar's tokens exactly)
LLAMA_CPP_INSTALL = "pip install 'specrt[llama]' (builds llama.cpp from source, ~15 min on 2 cores)"
OPENVINO_INSTALL = "pip install 'specrt[openvino]'"
# llama.cpp built for a CPU with AMX runs its AMX kernels, which crash in ggml_backend_amx_mul_mat on some such
# machines (ggml-org/llama.cpp#20824; seen here with llama-cpp-python 0.3.36 on a 2-core Xeon); a build without them
# runs (docs/benchmarks.md says how)
LLAMA_CPP_AMX_CRASH = ("; on a CPU with AMX, llama.cpp's AMX kernels are known to crash (llama.cpp issue 20824): "
                       "rebuild llama-cpp-python without them, CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
                       "-DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF' (docs/benchmarks.md)")
# OpenVINO GenAI's prompt lookup: drafts per round and the longest n-gram looked up (specrt's ngram default: 3)
OPENVINO_LOOKUP = {"num_assistant_tokens": 5, "max_ngram_size": 3}


@dataclass
class Generation:
    """One prompt run by one engine."""

    tokens: list[int]
    times: list[float]  # seconds from the request's start until each token was available
    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # specrt rounds (verify_len, accepted, committed)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def decode_rate(self, k: int | None = None) -> float | None:
        """Tokens per second after the first, over the first `k` tokens (all by default); None below 2 tokens."""
        k = len(self.tokens) if k is None else min(k, len(self.tokens))
        if k < 2 or self.times[k - 1] <= self.times[0]:
            return None
        return (k - 1) / (self.times[k - 1] - self.times[0])


@dataclass(frozen=True)
class EngineSpec:
    """What a worker loads: a specrt method on an artifact, or a baseline on the artifact's source model."""

    name: str  # the method ("ar", "dspark+ngram", ...) or the baseline's name
    artifact: str
    source: str | None = None  # the source model (baselines)
    threads: int | None = None
    n_ctx: int = 2048
    options: tuple = ()  # specrt: Engine keyword arguments as (key, value) pairs; hf: device, dtype

    @property
    def baseline(self) -> bool:
        return is_baseline(self.name)


# -- in the worker ------------------------------------------------------------------------------------

def _specrt(spec: EngineSpec):
    from specrt.runtime.config import EngineConfig, method_variant
    from specrt.runtime.engine import Request
    from specrt.runtime.engine import Engine
    from specrt.runtime.sampling import SamplingParams

    method, variant = method_variant(spec.name)
    engine = Engine.open(spec.artifact, EngineConfig(method=method, threads=spec.threads,
                                                     **dict(spec.options), **variant))

    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        times: list[float] = []
        t0 = time.perf_counter()

        def on_token(_, n: int) -> None:
            now = time.perf_counter() - t0
            if not times:  # the first step also ran the prefill: its first token came when the prefill ended
                times.append(engine.stats.prefill_s)
                n -= 1
            times.extend([now] * n)

        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(eos))
        outputs, stats = engine.generate([Request(prompt_ids=ids, params=params)], on_token=on_token)
        return Generation(outputs[0].output_ids, times, rounds=list(stats.rounds), draft_s=stats.draft_s,
                          verify_s=stats.verify_s)

    def describe() -> dict:
        info = {"engine": "specrt", "pid": os.getpid(), "method": spec.name, "gamma": engine.gamma,
                "scheduler": engine.scheduler_name, "backend": engine.backend}
        if engine.costs is not None:
            info["cost_table"] = engine.costs.describe()
        return info

    return generate, describe


def _hf(spec: EngineSpec):
    import torch

    from specrt.tools.bench import load_hf_model

    opts = dict(spec.options)
    model = load_hf_model(Path(spec.source), spec.threads).to(opts.get("device", "cpu"),
                                                               getattr(torch, opts.get("dtype") or "float32"))
    done = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        # transformers' own loop; a streamer timestamps each token as generate() hands it over
        times: list[float] = []

        class Clock:
            prompt = True  # the first put() is the prompt itself

            def put(self, value):
                if self.prompt:
                    self.prompt = False
                    return
                done()
                times.extend([time.perf_counter() - t0] * value.numel())

            def end(self):
                pass

        x = torch.tensor([ids], device=model.device)
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0, attention_mask=torch.ones_like(x), streamer=Clock())
        tokens = out[0, len(ids):].tolist()
        return Generation(tokens, times[:len(tokens)])

    return generate, lambda: {"engine": "transformers", "pid": os.getpid(), "device": str(model.device),
                              "dtype": str(model.dtype)}


def _llama_cpp(spec: EngineSpec):
    llama_cpp = require("llama.cpp")
    n = spec.threads or max(1, len(os.sched_getaffinity(0)))
    try:
        llm = llama_cpp.Llama(model_path=spec.source, n_threads=n, n_threads_batch=n, n_ctx=spec.n_ctx,
                              n_batch=min(spec.n_ctx, 512), logits_all=False, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise SpecrtError(f"llama.cpp cannot load {spec.source}: {e}") from None

    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        stop, out, times = set(eos), [], []
        llm.reset()  # a fresh context per prompt: no KV prefix reuse from the previous prompt
        t0 = time.perf_counter()
        # temp 0: llama.cpp's greedy sampler (argmax); neutral penalties make its penalties sampler a no-op
        tokens = llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, frequency_penalty=0.0,
                              presence_penalty=0.0, reset=False)
        for token in tokens:
            times.append(time.perf_counter() - t0)
            out.append(int(token))
            if token in stop or len(out) >= max_new_tokens:  # like specrt: the EOS that ends a request is kept
                break
        tokens.close()
        return Generation(out, times)

    return generate, lambda: {"engine": "llama.cpp", "pid": os.getpid(),
                              "version": getattr(llama_cpp, "__version__", "?"), "threads": n, "n_ctx": spec.n_ctx}


def _cpp(spec: EngineSpec):
    """A method of specrt's C++ runtime, through its C API (ctypes): one request at a time, stepped."""
    import ctypes as C

    os.environ.update(cpp_environ())  # where libspecrt finds this environment's ONNX Runtime
    lib = C.CDLL(str(cpp_library()))

    class Options(C.Structure):  # include/specrt.h's, field for field
        _fields_ = [("struct_size", C.c_size_t), ("threads", C.c_int), ("method", C.c_char_p), ("scheduler", C.c_char_p), ("gamma", C.c_int),
                    ("slots", C.c_int), ("ngram", C.c_int), ("threshold", C.c_double), ("tree", C.c_int)]

    class Params(C.Structure):
        _fields_ = [("struct_size", C.c_size_t), ("temperature", C.c_double), ("top_k", C.c_int), ("top_p", C.c_double), ("seed", C.c_int64),
                    ("max_new_tokens", C.c_size_t), ("stop_token_ids", C.POINTER(C.c_int64)),
                    ("n_stop_token_ids", C.c_size_t), ("ignore_eos", C.c_int),
                    ("stop_strings", C.POINTER(C.c_char_p)), ("n_stop_strings", C.c_size_t)]

    class Event(C.Structure):
        _fields_ = [("request_id", C.c_int64), ("token_ids", C.POINTER(C.c_int64)), ("n_tokens", C.c_size_t),
                    ("text", C.c_char_p), ("n_text", C.c_size_t), ("finish_reason", C.c_char_p)]

    class Stats(C.Structure):
        _fields_ = [("rounds", C.c_size_t), ("accepted", C.c_size_t), ("generated", C.c_size_t),
                    ("decode_seconds", C.c_double), ("prefill_seconds", C.c_double),
                    ("head_calls", C.c_size_t)]

    lib.specrt_last_error.restype = C.c_char_p
    lib.specrt_get_stats.restype = Stats
    lib.specrt_gamma.restype = C.c_int
    lib.specrt_has_unfinished.restype = C.c_int
    opts = dict(spec.options)
    from specrt.runtime.config import method_variant

    method, variant = method_variant(spec.name.removeprefix("cpp-"))
    options = Options(C.sizeof(Options), spec.threads or 0, method.encode(), (opts.get("scheduler") or "fixed").encode(),
                      opts.get("gamma") or 0, 0, opts.get("ngram") or 3, opts.get("threshold") or 0.3,
                      variant.get("tree", 1))
    engine = C.c_void_p()

    def check(status: int) -> None:
        if status:
            raise SpecrtError(f"specrt C++ runtime: {lib.specrt_last_error().decode()}")

    check(lib.specrt_engine_open(spec.artifact.encode(), C.byref(options), C.byref(engine)))

    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        prompt = (C.c_int64 * len(ids))(*ids)
        stop = (C.c_int64 * max(1, len(eos)))(*eos)
        params = Params(C.sizeof(Params), 0.0, 0, 1.0, -1, max_new_tokens, stop, len(eos), 0, None, 0)
        before = lib.specrt_get_stats(engine)
        events, count = C.POINTER(Event)(), C.c_size_t()
        tokens: list[int] = []
        times: list[float] = []
        t0 = time.perf_counter()
        check(lib.specrt_add_request(engine, prompt, len(ids), C.byref(params), None))
        while lib.specrt_has_unfinished(engine):
            check(lib.specrt_step(engine, C.byref(events), C.byref(count)))
            now = time.perf_counter() - t0
            for i in range(count.value):
                n = events[i].n_tokens
                new = events[i].token_ids[:n]
                if not times and n:  # the first step also ran the prefill: its first token came when that ended
                    times.append(lib.specrt_get_stats(engine).prefill_seconds - before.prefill_seconds)
                    n -= 1
                times.extend([now] * n)
                tokens.extend(int(t) for t in new)
        return Generation(tokens, times)

    def describe() -> dict:
        return {"engine": "specrt C++ runtime", "pid": os.getpid(), "method": method, **variant,
                "library": str(cpp_library()),
                "gamma": lib.specrt_gamma(engine), "scheduler": options.scheduler.decode(), "threads": spec.threads}

    return generate, describe


def _openvino(spec: EngineSpec):
    genai = require(spec.name)
    import numpy as np
    import openvino as ov

    lookup = spec.name == "openvino-lookup"
    props = {"INFERENCE_NUM_THREADS": spec.threads} if spec.threads else {}
    try:
        pipe = genai.LLMPipeline(spec.source, "CPU", **props, **({"prompt_lookup": True} if lookup else {}))
    except Exception as e:  # noqa: BLE001 - its C++ errors surface as RuntimeError, IndexError, ...
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecrtError(f"OpenVINO GenAI cannot load {spec.source}: {line}") from None

    class Clock(genai.StreamerBase):
        def __init__(self, t0: float) -> None:
            super().__init__()
            self.t0, self.tokens, self.times = t0, [], []

        def write(self, token):
            now = time.perf_counter() - self.t0
            new = token if isinstance(token, list) else [token]
            self.tokens += new
            self.times += [now] * len(new)
            return genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def generate(ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        cfg = pipe.get_generation_config()
        cfg.max_new_tokens, cfg.do_sample, cfg.apply_chat_template = max_new_tokens, False, False
        cfg.stop_token_ids, cfg.ignore_eos = set(eos), False
        cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty = 1.0, 0.0, 0.0
        if lookup:
            cfg.num_assistant_tokens = OPENVINO_LOOKUP["num_assistant_tokens"]
            cfg.max_ngram_size = OPENVINO_LOOKUP["max_ngram_size"]
        clock = Clock(time.perf_counter())
        result = pipe.generate(ov.Tensor(np.asarray([ids], np.int64)), cfg, clock)
        tokens = [int(t) for t in result.tokens[0]]
        if clock.tokens != tokens:
            raise SpecrtError("OpenVINO GenAI streamed other tokens than it returned")
        return Generation(tokens, clock.times)

    info = {"engine": "openvino-genai", "pid": os.getpid(), "version": getattr(genai, "__version__", "?"),
            "threads": spec.threads}
    if lookup:
        info["prompt_lookup"] = dict(OPENVINO_LOOKUP)
    return generate, lambda: info


LOADERS = {"hf": _hf, "llama.cpp": _llama_cpp, "openvino": _openvino, "openvino-lookup": _openvino,
           **{name: _cpp for name in CPP_BASELINES}}


def loader(name: str):
    """The function that loads a baseline's engine in its worker."""
    return _cpp if is_cpp(name) else LOADERS[name]


def require(baseline: str):
    """The module an optional baseline needs, or a one-line SpecrtError saying how to install it."""
    if is_cpp(baseline):
        return cpp_library()
    module, install = (("llama_cpp", LLAMA_CPP_INSTALL) if baseline == "llama.cpp"
                       else ("openvino_genai", OPENVINO_INSTALL))
    try:
        return __import__(module)
    except ModuleNotFoundError as e:
        if e.name not in (module, None):
            raise SpecrtError(f"--baseline {baseline}: {module} cannot be imported: {e}") from None
        raise SpecrtError(f"--baseline {baseline} needs {module}: {install}") from None
    except (ImportError, OSError) as e:  # e.g. a compiled library missing or built for another CPU
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecrtError(f"--baseline {baseline}: {module} cannot be loaded: {line}") from None


def worker_loop(conn, load) -> None:
    """A worker process's loop: `load()` gives ({message: handler}, a close function or None); say ready (or the
    error), then answer each message with its handler's result, until one it has no handler for (close) or the
    pipe's end."""
    try:
        handlers, close = load()
    except SpecrtError as e:
        conn.send(("error", str(e)))
        return
    except Exception as e:  # noqa: BLE001 - reported to the bench, which fails with it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            handler = handlers.get(msg[0])
            if handler is None:
                return
            try:
                conn.send(("ok", handler(*msg[1:])))
            except SpecrtError as e:
                conn.send(("error", str(e)))
            except Exception as e:  # noqa: BLE001
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if close is not None:
            close()


def _serve(conn, spec: EngineSpec) -> None:
    """The worker's loop: load, say ready, then run each request sent until told to close."""
    def load():
        generate, describe = (loader(spec.name) if spec.baseline else _specrt)(spec)
        return {"run": generate, "describe": describe}, None

    worker_loop(conn, load)


# -- in the bench ---------------------------------------------------------------------------------------

class Worker:
    """One engine in its own process."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._start(_serve, (spec,))

    def _start(self, target, args: tuple) -> None:
        """Run target(conn, *args) in a spawned process: a fresh interpreter, nothing (threads, sessions,
        allocations) inherited from the bench; it says ready (or its error) first, then answers each message."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True, name=f"bench {self.spec.name}")
        self.process.start()
        child.close()

    def _answer(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            hint = LLAMA_CPP_AMX_CRASH if self.spec.name == "llama.cpp" and code == -signal.SIGSEGV else ""
            raise SpecrtError(f"{self.spec.name}: its worker process died (exit code {code}){hint}") from None
        if status == "error":
            raise SpecrtError(f"{self.spec.name}: {value}")
        return value

    def ready(self) -> None:
        self._answer()

    def run(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        self.conn.send(("run", ids, max_new_tokens, eos))
        return self._answer()

    def describe(self) -> dict:
        self.conn.send(("describe",))
        return self._answer()

    def cpu_seconds(self) -> float:
        """CPU time the worker process (all its threads) has used."""
        import psutil

        try:
            t = psutil.Process(self.process.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return t.user + t.system

    def close(self) -> None:
        try:
            self.conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
