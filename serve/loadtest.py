"""`specrt loadtest URL`: concurrent streaming chat clients against a running `specrt serve`, then checks.

    clients (threads) ── POST /v1/chat/completions (stream, greedy, token_marks) ──► server
        every --disconnect-every'th request hangs up after a few chunks
        one more client sends bad requests (malformed, unknown model, bad values) every 0.5 s: each must get a 4xx
    after --duration: wait for in-flight requests, then
        every completed request ended with a finish reason and [DONE]
        /metrics: active slots back to 0, an abort counted per hang-up
        --verify ART: each distinct request run directly on an Engine; streamed token ids must be identical

Greedy requests make the direct run comparable token for token (the draft/verify loop is lossless, and a
request's tokens must not depend on what else was in the batch).
"""
from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from specrt.errors import SpecrtError

HANG_UP_AFTER_CHUNKS = 3


@dataclass
class Result:
    prompt: str
    max_tokens: int
    hung_up: bool = False
    done: bool = False  # saw the finish reason and [DONE]
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    start: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    error: str | None = None


class _Client:
    def __init__(self, url: str, model: str) -> None:
        u = urlparse(url)
        if u.scheme != "http" or not u.hostname:
            raise SpecrtError(f"loadtest needs an http://HOST:PORT URL, got {url!r}")
        self.host, self.port, self.model = u.hostname, u.port or 80, model

    def chat(self, r: Result) -> Result:
        body = {"model": self.model, "messages": [{"role": "user", "content": r.prompt}], "max_tokens": r.max_tokens,
                "temperature": 0, "stream": True, "token_marks": True}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        r.start = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return r
            chunks = 0
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r.done = r.finish_reason is not None
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"]["message"]
                    break
                tokens = chunk.get("specrt", {}).get("tokens", [])
                if tokens and r.first_token_s is None:
                    r.first_token_s = time.perf_counter() - r.start
                r.token_ids += [t["id"] for t in tokens]
                for c in chunk["choices"]:
                    r.text += (c.get("delta") or {}).get("content") or ""
                    r.finish_reason = c.get("finish_reason") or r.finish_reason
                chunks += 1
                if r.hung_up and chunks >= HANG_UP_AFTER_CHUNKS:
                    conn.sock.shutdown(2)  # go away mid-stream
                    break
            r.end_s = time.perf_counter() - r.start
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            r.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return r


def bad_requests(model: str) -> list[tuple[str, str, bytes]]:
    """(what, path, body) of requests the server must refuse with a 4xx and an OpenAI error body."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("malformed JSON", "/v1/chat/completions", b'{"model": '),
        ("unknown model", "/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("missing messages", "/v1/chat/completions", {"model": model}),
        ("negative max_tokens", "/v1/chat/completions", {**chat, "max_tokens": -1}),
        ("absurd max_tokens", "/v1/chat/completions", {**chat, "max_tokens": 10 ** 9}),
        ("prompt too long", "/v1/completions", {"model": model, "prompt": "word " * 5000}),
        ("temperature -1", "/v1/chat/completions", {**chat, "temperature": -1}),
        ("top_p 2", "/v1/chat/completions", {**chat, "top_p": 2}),
        ("n 2", "/v1/chat/completions", {**chat, "n": 2}),
        ("logprobs", "/v1/chat/completions", {**chat, "logprobs": True}),
    ]
    return [(what, path, body if isinstance(body, bytes) else json.dumps(body).encode())
            for what, path, body in cases]


def _get(url: str, path: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=30) as resp:
            return resp.read()
    except OSError as e:
        raise SpecrtError(f"cannot reach {url}{path}: {e}") from None


def _gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(_get(url, "/metrics").decode()):
        for s in fam.samples:
            if not s.labels.keys() - {"model"}:
                out[s.name] = s.value
    return out


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = np.asarray(values) * 1e3
    return {f"p{q}": round(float(np.percentile(v, q)), 1) for q in (50, 90, 99)}


def run_loadtest(url: str, prompts: list[str], *, clients: int = 32, duration_s: float = 60.0, max_tokens: int = 128,
                 disconnect_every: int = 8, bad: bool = True, verify: Path | None = None,
                 progress: bool = True) -> dict:
    """Run the load; returns the measurements and checks (see the module docstring)."""
    url = url.rstrip("/")
    info = json.loads(_get(url, "/v1/models"))["data"][0]
    client = _Client(url, info["id"])
    before = _gauges(url)
    results: list[Result] = []
    lock = threading.Lock()
    counter = itertools.count()
    stop_at = time.perf_counter() + duration_s

    refused: dict[str, list[int]] = {}  # what -> statuses of the bad requests sent alongside the load

    def bad_client() -> None:
        cases = bad_requests(info["id"])
        k = 0
        while time.perf_counter() < stop_at:
            what, path, body = cases[k % len(cases)]
            k += 1
            conn = http.client.HTTPConnection(client.host, client.port, timeout=60)
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                payload = json.loads(resp.read())
                ok = 400 <= resp.status < 500 and isinstance(payload.get("error", {}).get("message"), str)
                refused.setdefault(what, []).append(resp.status if ok else -resp.status)
            except (OSError, http.client.HTTPException, json.JSONDecodeError):
                refused.setdefault(what, []).append(0)
            finally:
                conn.close()
            time.sleep(0.5)

    def worker() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                i = next(counter)
            r = Result(prompts[i % len(prompts)], max_tokens,
                       hung_up=disconnect_every > 0 and i % disconnect_every == disconnect_every - 1)
            client.chat(r)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    if bad:
        threads.append(threading.Thread(target=bad_client, daemon=True))
    for t in threads:
        t.start()
    bar = _progress(duration_s, progress)
    loaded = None  # /metrics when the clients stop starting requests: the server's rate under full load
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if loaded is None and time.perf_counter() >= stop_at:
            loaded = _gauges(url), time.perf_counter() - t0
        if bar is not None:
            bar.n = min(round(time.perf_counter() - t0), int(duration_s))
            bar.set_postfix(requests=len(results), refresh=False)
            bar.refresh()
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    settled, after = _settle(url)
    completed = [r for r in results if not r.hung_up and r.error is None]
    hung = [r for r in results if r.hung_up]
    out_tokens = sum(len(r.token_ids) for r in completed)
    report = {
        "url": url, "model": info["id"], "server": info.get("specrt", {}), "clients": clients,
        "duration_s": duration_s, "wall_s": round(wall, 1), "max_tokens": max_tokens,
        "requests": len(results), "completed": len(completed), "hung_up": len(hung),
        "errors": [r.error for r in results if r.error and not r.hung_up][:10],
        "incomplete": sum(not r.done for r in completed),
        "output_tokens": out_tokens, "throughput_tok_s": round(out_tokens / wall, 1),
        "requests_per_s": round(len(completed) / wall, 2),
        "loaded_tok_s": round((loaded[0]["specrt_generation_tokens_total"] - before["specrt_generation_tokens_total"])
                              / loaded[1], 1) if loaded else None,
        "ttft_ms": _pct([r.first_token_s for r in completed if r.first_token_s is not None]),
        "latency_ms": _pct([r.end_s for r in completed if r.end_s is not None]),
        "per_request_tok_s": {k: round(v / 1e3, 1) for k, v in _pct(
            [len(r.token_ids) / (r.end_s - r.first_token_s) for r in completed
             if r.end_s and r.first_token_s is not None and r.end_s > r.first_token_s and len(r.token_ids) > 1]
        ).items()},
        "active_slots_after": after.get("specrt_active_slots"), "slots_settled": settled,
        "aborted": after.get("specrt_requests_aborted_total", 0) - before.get("specrt_requests_aborted_total", 0),
        "tau": after.get("specrt_tau"),
        "bad_requests": {"sent": sum(map(len, refused.values())),
                         "refused": sum(s > 0 for v in refused.values() for s in v),
                         "statuses": {what: sorted(set(v)) for what, v in refused.items()}},
    }
    if verify is not None:
        report["verify"] = _verify(verify, info.get("specrt", {}), completed, progress)
    report["ok"] = (not report["errors"] and report["incomplete"] == 0 and settled
                    and report["bad_requests"]["refused"] == report["bad_requests"]["sent"]
                    and report["aborted"] >= len(hung) and report.get("verify", {}).get("mismatches", 0) == 0)
    return report


def _settle(url: str, timeout_s: float = 30.0) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until no slot is active (hung-up requests are aborted at the engine's next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = _gauges(url)
        if g.get("specrt_active_slots") == 0 and g.get("specrt_queue_depth") == 0:
            return True, g
        if time.monotonic() > deadline:
            return False, g
        time.sleep(0.25)


def _verify(art: Path, server: dict, completed: list[Result], progress: bool) -> dict:
    """Each distinct (prompt, max_tokens) once on a direct Engine; every completed stream must equal it."""
    from specrt.runtime.config import EngineConfig
    from specrt.runtime.engine import Request
    from specrt.runtime.engine import Engine
    from specrt.runtime.sampling import SamplingParams

    distinct = sorted({(r.prompt, r.max_tokens) for r in completed})
    with Engine.open(art, EngineConfig(method=server.get("method", "ar"), gamma=server.get("gamma") or None,
                                       scheduler=server.get("scheduler", "fixed"), slots=server.get("slots"))) as engine:
        tok = engine.tokenizer
        requests = [Request(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                       add_special_tokens=False), SamplingParams(max_new_tokens=n), id=i)
                    for i, (p, n) in enumerate(distinct)]
        t0 = time.perf_counter()
        outputs, _ = engine.generate(requests)
        wall = time.perf_counter() - t0
    expected = {key: out for key, out in zip(distinct, outputs)}
    bad = [r for r in completed if r.token_ids != expected[(r.prompt, r.max_tokens)].output_ids
           or r.text != expected[(r.prompt, r.max_tokens)].text]
    return {"distinct_requests": len(distinct), "checked": len(completed), "mismatches": len(bad),
            # the same engine settings on the distinct requests, all queued at once: a throughput to set beside
            # the server's (same machine, same run; no HTTP, no client threads)
            "direct_tok_s": round(sum(len(o.output_ids) for o in outputs) / wall, 1),
            "first_mismatch": asdict(bad[0]) if bad else None}


def _progress(total: float, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=int(total), desc="loadtest", unit="s", leave=False)
