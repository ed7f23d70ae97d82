#!/usr/bin/env python3
"""Fuzz the C++ runtime's C API (runtime/cpp/include/specrt.h) through ctypes, as Schemathesis fuzzes the HTTP API:
random manifests (a valid artifact's, with fields replaced by hostile values or removed), random options, and random
requests, texts, conversations, tokenize / detokenize / step / abort calls on engines that opened.

    python scripts/fuzz_c_api.py ART [--count 500] [--seed 0] [--lib build/cpp/libspecrt.so] [--json]

ART is a valid artifact (with a tokenizer, for the text calls). Every call must return one of specrt.h's statuses,
with a one-line message for an error, and the process must neither crash nor hang: each input runs under a watchdog
(`--timeout` seconds) that ends the process with the input named. Under the sanitizer build (SPECRT_CPP_SANITIZE=1,
docs/cpp.md) run it with ASan preloaded:

    LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" ASAN_OPTIONS=detect_leaks=0 \\
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 python scripts/fuzz_c_api.py ART \\
        --lib build/cpp-asan/libspecrt.so --count 2000

(halt_on_error: undefined behaviour ends the process, as a memory error does, rather than a line on stderr).

The last line on stdout (or the --json object) says how many inputs of each kind it tried and what they returned;
exit 1 when a call broke the contract (the input is printed), 0 otherwise."""
from __future__ import annotations

import argparse
import ctypes as C
import faulthandler
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATUSES = {0: "ok", 1: "artifact", 2: "request", 3: "runtime"}


class Options(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("threads", C.c_int), ("method", C.c_char_p), ("scheduler", C.c_char_p),
                ("gamma", C.c_int), ("slots", C.c_int), ("ngram", C.c_int), ("threshold", C.c_double),
                ("tree", C.c_int)]


class Params(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("temperature", C.c_double), ("top_k", C.c_int), ("top_p", C.c_double),
                ("seed", C.c_int64), ("max_new_tokens", C.c_size_t), ("stop_token_ids", C.POINTER(C.c_int64)),
                ("n_stop_token_ids", C.c_size_t), ("ignore_eos", C.c_int), ("stop_strings", C.POINTER(C.c_char_p)),
                ("n_stop_strings", C.c_size_t)]


class Event(C.Structure):
    _fields_ = [("request_id", C.c_int64), ("token_ids", C.POINTER(C.c_int64)), ("n_tokens", C.c_size_t),
                ("text", C.c_char_p), ("n_text", C.c_size_t), ("finish_reason", C.c_char_p)]


class Message(C.Structure):
    _fields_ = [("role", C.c_char_p), ("content", C.c_char_p)]


class Broken(Exception):
    """A call broke the C API's contract."""


def load(lib: Path) -> C.CDLL:
    api = C.CDLL(str(lib))
    api.specrt_options_init.argtypes = [C.POINTER(Options)]
    api.specrt_params_init.argtypes = [C.POINTER(Params)]
    api.specrt_engine_open.argtypes = [C.c_char_p, C.POINTER(Options), C.POINTER(C.c_void_p)]
    api.specrt_engine_close.argtypes = [C.c_void_p]
    api.specrt_add_request.argtypes = [C.c_void_p, C.POINTER(C.c_int64), C.c_size_t, C.POINTER(Params),
                                       C.POINTER(C.c_int64)]
    api.specrt_add_text.argtypes = [C.c_void_p, C.c_char_p, C.c_int, C.POINTER(Params), C.POINTER(C.c_int64)]
    api.specrt_add_chat.argtypes = [C.c_void_p, C.POINTER(Message), C.c_size_t, C.POINTER(Params),
                                    C.POINTER(C.c_int64)]
    api.specrt_tokenize.argtypes = [C.c_void_p, C.c_char_p, C.c_int, C.POINTER(C.c_int64), C.c_size_t,
                                    C.POINTER(C.c_size_t)]
    api.specrt_detokenize.argtypes = [C.c_void_p, C.POINTER(C.c_int64), C.c_size_t, C.c_int, C.c_char_p, C.c_size_t,
                                      C.POINTER(C.c_size_t)]
    api.specrt_step.argtypes = [C.c_void_p, C.POINTER(C.POINTER(Event)), C.POINTER(C.c_size_t)]
    api.specrt_abort.argtypes = [C.c_void_p, C.c_int64]
    api.specrt_has_unfinished.argtypes = [C.c_void_p]
    api.specrt_generate.argtypes = [C.c_void_p, C.POINTER(C.c_int64), C.c_size_t, C.POINTER(Params),
                                    C.POINTER(C.c_int64), C.POINTER(C.c_size_t)]
    api.specrt_last_error.restype = C.c_char_p
    return api


class Fuzzer:
    def __init__(self, api: C.CDLL, art: Path, rng: random.Random, work: Path) -> None:
        self.api, self.art, self.rng, self.work = api, art, rng, work
        self.manifest = json.loads((art / "manifest.json").read_text())
        self.vocab = int(self.manifest["model"]["vocab_size"])
        self.statuses: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.messages: dict[str, Counter[str]] = {}  # the errors each call returned, by message

    # -- checks ---------------------------------------------------------------------------------------------------
    def check(self, status: int, call: str) -> int:
        if status not in STATUSES:
            raise Broken(f"{call} returned {status}, not a specrt_status")
        self.statuses[f"{call}:{STATUSES[status]}"] += 1
        if status:
            message = (self.api.specrt_last_error() or b"").decode("utf-8", "replace")
            if not message or "\n" in message.strip():
                raise Broken(f"{call}: status {status} with the message {message!r} (not one line)")
            self.messages.setdefault(f"{call}:{STATUSES[status]}", Counter())[message[:90]] += 1
        return status

    # -- values ---------------------------------------------------------------------------------------------------
    def integer(self) -> int:
        return self.rng.choice([0, 1, -1, 2, 3, 7, 64, 255, 256, self.vocab - 1, self.vocab, self.vocab + 1,
                                2 ** 31 - 1, 2 ** 31, -2 ** 31, 2 ** 63 - 1, -2 ** 63, self.rng.randrange(-10 ** 6, 10 ** 6)])

    def json_value(self, depth: int = 0):
        r = self.rng.random()
        if r < 0.45:
            return self.rng.choice([self.integer(), 2 ** 63, 2 ** 64 + 4, 10 ** 30, 1e300, -0.0, 0.5])
        if r < 0.6:
            return self.rng.choice(["", "x", "../x", "/etc/passwd", "target.onnx", "a" * 5000, "B", "\u2581\x00"])
        if r < 0.7:
            return self.rng.choice([None, True, False])
        if r < 0.85 or depth > 3:
            return [self.json_value(depth + 1) for _ in range(self.rng.randrange(4))]
        return {self.rng.choice(["B", "T", "P", "R", "C", "x"]): self.json_value(depth + 1)
                for _ in range(self.rng.randrange(4))}

    def text(self) -> bytes:
        r = self.rng.random()
        if r < 0.05:
            return b"a" * self.rng.choice([200_000, 2_000_000])  # no spaces: one long word
        if r < 0.15:
            return bytes(self.rng.randrange(1, 256) for _ in range(self.rng.randrange(64)))  # not UTF-8, mostly
        alphabet = "ab cd\n\t.,!?\u00e9\u6f22\u5b57\U0001f916\u2581<|im_start|>user\u0301\ufeff\u200b"
        n = self.rng.randrange(200 if r < 0.3 else 24)
        return "".join(self.rng.choice(alphabet) for _ in range(n)).encode("utf-8")

    def pick(self, good: list, bad: list):
        """Mostly a good value (so that requests get through to the engine), sometimes a hostile one."""
        return self.rng.choice(bad if self.rng.random() < 0.15 else good)

    def params(self) -> tuple[Params | None, list]:
        if self.rng.random() < 0.1:
            return None, []
        p = Params()
        self.api.specrt_params_init(C.byref(p))
        keep: list = []
        p.temperature = self.pick([0.0, 0.0, 0.7, 1.0, 1.5], [-1.0, float("nan"), float("inf"), 1e308])
        p.top_k = self.pick([0, 1, 5, 50], [-3, 2 ** 31 - 1])
        p.top_p = self.pick([1.0, 0.9, 0.5], [0.0, 2.0, float("nan")])
        p.seed = self.pick([-1, 0, 7], [2 ** 63 - 1, -2 ** 63])
        p.max_new_tokens = self.pick([1, 2, 5, 16], [0, 2 ** 64 - 1, 10 ** 6])
        p.ignore_eos = self.rng.choice([0, 1])
        if self.rng.random() < 0.3:
            stops = (C.c_int64 * 3)(*[self.integer() for _ in range(3)])
            keep.append(stops)
            p.stop_token_ids, p.n_stop_token_ids = stops, self.rng.randrange(4)
        if self.rng.random() < 0.3:
            strings = (C.c_char_p * 2)(self.text()[:8] or b"", self.rng.choice([b"", b"\n", b"\xff", b"the"]))
            keep.append(strings)
            p.stop_strings, p.n_stop_strings = strings, self.rng.randrange(3)
        if self.rng.random() < 0.05:
            p.struct_size = self.rng.choice([0, 8, 1 << 20])
        return p, keep

    # -- inputs ---------------------------------------------------------------------------------------------------
    def open(self, art: Path, options: Options | None) -> C.c_void_p | None:
        handle = C.c_void_p()
        status = self.check(self.api.specrt_engine_open(str(art).encode(), C.byref(options) if options else None,
                                                        C.byref(handle)), "open")
        if status == 0 and not handle:
            raise Broken("specrt_engine_open returned OK without an engine")
        return handle if status == 0 else None

    def random_options(self) -> Options:
        o = Options()
        self.api.specrt_options_init(C.byref(o))
        o.threads = self.pick([0, 1, 1, 2], [-1, 100_000])
        o.method = self.pick([b"ar", b"ngram", b"ngram", None], [b"dspark", b"mtp", b"dspark+ngram", b"", b"eagle"])
        o.scheduler = self.pick([b"fixed", b"threshold", None], [b"sps", b"sps-async", b"best"])
        o.gamma = self.pick([0, 1, 2, 3], [9, -1])
        o.slots = self.pick([0, 1, 2, 3, 100], [-1])
        o.ngram = self.pick([1, 3, 50], [0, -2])
        o.threshold = self.pick([0.3, 0.0, 1.0], [-1.0, float("nan")])
        o.tree = self.pick([1, 1, 2, 3], [0, 9])
        if self.rng.random() < 0.05:
            o.struct_size = self.rng.choice([0, 4, 1 << 20])
        return o

    def mutated_artifact(self, i: int) -> Path:
        """A copy of the artifact (files hard-linked) whose manifest has 1-3 fields replaced or removed."""
        copy = self.work / f"art-{i}"
        shutil.copytree(self.art, copy, copy_function=os.link)
        (copy / "manifest.json").unlink()
        d = json.loads(json.dumps(self.manifest))
        for _ in range(self.rng.randrange(1, 4)):
            path, node = [], d
            while isinstance(node, (dict, list)) and node and (not path or self.rng.random() < 0.75):
                key = self.rng.choice(list(node)) if isinstance(node, dict) else self.rng.randrange(len(node))
                path.append(key)
                parent, node = node, node[key]
            if not path:
                continue
            if self.rng.random() < 0.2 and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = self.json_value()
        (copy / "manifest.json").write_text(json.dumps(d))
        return copy

    def requests(self, engine: C.c_void_p) -> None:
        """A random sequence of the calls an engine takes, then steps until it is idle (or 64 steps)."""
        api = self.api
        rid = C.c_int64()
        ids: list[int] = []
        for _ in range(self.rng.randrange(1, 5)):
            params, keep = self.params()
            pp = C.byref(params) if params else None
            what = self.rng.choice(["ids", "ids", "text", "chat", "tokenize", "detokenize", "abort", "generate"])
            if what == "ids":
                hostile = self.rng.random() < 0.2
                prompt = [self.integer() if hostile and self.rng.random() < 0.3 else self.rng.randrange(self.vocab)
                          for _ in range(self.pick([1, 3, 20], [0, 200]))]
                arr = (C.c_int64 * max(1, len(prompt)))(*prompt)
                if self.check(api.specrt_add_request(engine, arr, len(prompt), pp, C.byref(rid)), "add_request") == 0:
                    ids.append(rid.value)
            elif what == "text":
                if self.check(api.specrt_add_text(engine, self.text(), self.rng.choice([0, 1]), pp, C.byref(rid)),
                              "add_text") == 0:
                    ids.append(rid.value)
            elif what == "chat":
                roles = [b"system", b"user", b"assistant", b"user"]  # a conversation, or hostile roles
                if self.rng.random() < 0.2:
                    roles = [self.rng.choice([b"user", b"system", b"assistant", b"tool", b"", b"User"]) for _ in roles]
                first = self.rng.choice([0, 1])
                msgs = (Message * 4)(*[Message(r, self.text()) for r in roles[first:] + roles[:first]])
                if self.check(api.specrt_add_chat(engine, msgs, self.pick([1, 2, 3], [0, 4]), pp, C.byref(rid)),
                              "add_chat") == 0:
                    ids.append(rid.value)
            elif what == "tokenize":
                cap = self.rng.choice([0, 1, 16, 4096])
                out, n = (C.c_int64 * max(cap, 1))(), C.c_size_t()
                status = self.check(api.specrt_tokenize(engine, self.text(), self.rng.choice([0, 1]), out, cap,
                                                        C.byref(n)), "tokenize")
                if status == 0 and n.value > cap:
                    raise Broken(f"specrt_tokenize wrote {n.value} ids into room for {cap}")
            elif what == "detokenize":
                toks = [self.rng.choice([self.rng.randrange(self.vocab), self.integer()]) for _ in range(8)]
                arr, cap = (C.c_int64 * 8)(*toks), self.rng.choice([0, 1, 8, 4096])
                buf, n = C.create_string_buffer(max(cap, 1)), C.c_size_t()
                status = self.check(api.specrt_detokenize(engine, arr, self.rng.randrange(9), self.rng.choice([0, 1]),
                                                          buf, cap, C.byref(n)), "detokenize")
                if status == 0 and n.value + 1 > cap:
                    raise Broken(f"specrt_detokenize wrote {n.value + 1} bytes into room for {cap}")
            elif what == "abort":
                self.check(api.specrt_abort(engine, self.rng.choice([*ids, -1, 10 ** 9, 0])), "abort")
            else:
                prompt = [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(1, 9))]
                arr, cap = (C.c_int64 * len(prompt))(*prompt), 4096
                out, n = (C.c_int64 * cap)(), C.c_size_t()
                small = Params()
                api.specrt_params_init(C.byref(small))
                small.max_new_tokens = self.rng.randrange(1, 9)
                small.temperature = self.rng.choice([0.0, 1.0])
                self.check(api.specrt_generate(engine, arr, len(prompt), C.byref(small), out, C.byref(n)), "generate")
            del keep
        events, n = C.POINTER(Event)(), C.c_size_t()
        for _ in range(64):
            if not api.specrt_has_unfinished(engine):
                break
            if self.check(api.specrt_step(engine, C.byref(events), C.byref(n)), "step"):
                break
            for k in range(n.value):
                e = events[k]
                if e.n_tokens and not e.token_ids:
                    raise Broken("an event with tokens and no token_ids")
            if self.rng.random() < 0.1 and ids:
                self.check(api.specrt_abort(engine, self.rng.choice(ids)), "abort")

    def one(self, i: int) -> str:
        kind = self.rng.choices(["manifest", "options", "requests"], weights=[4, 2, 4])[0]
        self.kinds[kind] += 1
        if kind == "manifest":
            art = self.mutated_artifact(i)
            engine = self.open(art, None)
            if engine:
                self.requests(engine)
                self.api.specrt_engine_close(engine)
            shutil.rmtree(art)
        elif kind == "options":
            engine = self.open(self.art, self.random_options())
            if engine:
                self.requests(engine)
                self.api.specrt_engine_close(engine)
        else:
            o = Options()
            self.api.specrt_options_init(C.byref(o))
            o.threads, o.method = 1, self.rng.choice([b"ar", b"ngram"])
            engine = self.open(self.art, o)
            if engine is None:
                raise Broken(f"the valid artifact did not open: {self.api.specrt_last_error()!r}")
            self.requests(engine)
            self.api.specrt_engine_close(engine)
        return kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lib", type=Path, default=ROOT / "build" / "cpp" / "libspecrt.so")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one input may take before it counts as a hang")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        sys.exit(f"fuzz_c_api: {args.artifact} is not a specrt artifact")
    if not args.lib.is_file():
        sys.exit(f"fuzz_c_api: {args.lib} is not built (cmake --build build/cpp)")
    api = load(args.lib)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specrt-fuzz-") as work:
        fuzz = Fuzzer(api, args.artifact, random.Random(args.seed), Path(work))
        for i in range(args.count):
            # a hang ends the process with this input named (faulthandler prints where Python was)
            faulthandler.dump_traceback_later(args.timeout, exit=True)
            state = fuzz.rng.getstate()
            try:
                fuzz.one(i)
            except Broken as e:
                fuzz.rng.setstate(state)
                print(f"fuzz_c_api: input {i} (seed {args.seed}) broke the C API: {e}", file=sys.stderr)
                return 1
            finally:
                faulthandler.cancel_dump_traceback_later()
            if sys.stderr.isatty():
                print(f"\r{i + 1}/{args.count} inputs", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary = {"inputs": args.count, "seed": args.seed, "seconds": round(time.monotonic() - start, 1),
               "kinds": dict(fuzz.kinds), "returns": dict(sorted(fuzz.statuses.items())),
               "errors": {k: dict(v.most_common(5)) for k, v in sorted(fuzz.messages.items())}}
    print(json.dumps(summary) if args.json else
          f"fuzz_c_api: {args.count} inputs ({', '.join(f'{v} {k}' for k, v in fuzz.kinds.items())}) in "
          f"{summary['seconds']} s, none broke the C API; returns: {summary['returns']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
