"""A real Triton Inference Server: `specrt triton ART --out REPO --serve` runs the tritonserver that the nvidia-pytriton
wheel bundles, on the CPU, from an environment of its own (specrt's wheel installed as a user installs it, `pip install
-c requirements/triton-server.lock 'specrt[cpu,triton-server]'`: numpy 1.26, which the bundled Python backend stub
needs; the wheel's own kernels), on loopback ports, with the
default model (DSpark, fixed lengths, two instances of one thread each). Checked against a direct engine
run in this process (the default model exported at batch 4, conftest's `served_art`): HTTP generate and generate_stream, the README's gRPC streaming client, the vLLM request schema,
input_ids / token_ids / drafted, a seeded sampled request, bad requests, cancellation, 16 streaming clients for 30 s,
both instances serving, and Triton's /metrics with specrt's own counters.
"""
from __future__ import annotations

import json
import platform
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams

from venvs import ROOT, make_venv, site_packages_mb

grpcclient = pytest.importorskip("tritonclient.grpc")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                                 reason="nvidia-pytriton's server is built for x86-64 Linux only")]
LOCK = ROOT / "requirements" / "triton-server.lock"
PROMPTS = ["Why is the sky blue?", "Write a Python function that reverses a string.", "Name three prime numbers.",
           "What is the capital of France?"]
NEW = 24  # tokens per request
LOAD_S, CLIENTS = 30.0, 16


@dataclass
class Server:
    proc: subprocess.Popen
    http: str
    grpc: str
    metrics: str
    art: Path
    env_mb: float


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def server(served_art, tmp_path_factory, wheel):
    work = tmp_path_factory.mktemp("triton_server")
    bin_dir = make_venv(work / "venv", "cpu,triton-server", LOCK, wheel=wheel)
    art = served_art
    http, grpc, metrics = _free_ports(3)
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen([str(bin_dir / "specrt"), "triton", str(art), "--out", str(work / "repo"), "--method",
                             "dspark", "--scheduler", "fixed", "--instances", "2", "--threads", "1", "--serve",
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                             "--json"], stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        info = json.loads(lines.get(timeout=600))["serving"]
    except queue.Empty:
        proc.kill()
        pytest.fail(f"specrt triton --serve did not report a ready server: {(work / 'serve.log').read_text()[-2000:]}")
    assert info["http"] == f"127.0.0.1:{http}" and info["grpc"] == f"127.0.0.1:{grpc}"
    yield Server(proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}", art,
                 site_packages_mb(work / "venv"))
    proc.send_signal(signal.SIGTERM)  # the CLI stops tritonserver and its stubs
    assert proc.wait(120) == 0, (work / "serve.log").read_text()[-2000:]
    log.close()


@pytest.fixture(scope="module")
def reference(server) -> dict[str, dict]:
    """Each prompt's greedy tokens and text from a direct engine run (AR: speculation keeps greedy output)."""
    with Engine(server.art, method="ar", threads=1) as engine:
        ids = {p: encode_prompt(engine.tokenizer, p) for p in PROMPTS}
        outs, _ = engine.generate([Request(ids[p], SamplingParams(max_new_tokens=NEW), id=i)
                                   for i, p in enumerate(PROMPTS)])
    return {p: {"prompt_ids": ids[p], "ids": o.output_ids, "text": o.text} for p, o in zip(PROMPTS, outs)}


def _post(server: Server, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{server.http}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _grpc(server: Server, inputs: dict[str, np.ndarray], *, stream_ids: int = 1, cancel_after: int | None = None
          ) -> list[list]:
    """One gRPC stream (the README's client), `stream_ids` requests on it; each request's responses as
    (token_ids, text, drafted) tuples, or the error string as its last element."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, value in inputs.items():
        kind = {np.object_: "BYTES", np.bool_: "BOOL", np.int32: "INT32"}[value.dtype.type]
        t = grpcclient.InferInput(name, list(value.shape), kind)
        t.set_data_from_numpy(value)
        tensors.append(t)
    for i in range(stream_ids):
        client.async_stream_infer("specrt", tensors, request_id=str(i), enable_empty_final_response=True)
    out: dict[str, list] = {str(i): [] for i in range(stream_ids)}
    open_ids = set(out)
    try:
        while open_ids:
            result, error = results.get(timeout=120)
            if error is not None:
                rid = next(iter(sorted(open_ids)))  # errors carry no id here; one request per stream when they matter
                out[rid].append(str(error))
                open_ids.discard(rid)
                continue
            response = result.get_response()
            rid = response.id
            if response.parameters["triton_final_response"].bool_param:
                open_ids.discard(rid)
                if not response.outputs:
                    continue
            out[rid].append((result.as_numpy("token_ids").tolist(), result.as_numpy("text_output")[0].decode(),
                             result.as_numpy("drafted").tolist()))
            if cancel_after is not None and sum(len(v) for v in out.values()) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return list(out.values())
    finally:
        client.stop_stream()
        client.close()
    return list(out.values())


def _text_inputs(prompt: str, stream: bool, sampling: dict) -> dict[str, np.ndarray]:
    return {"text_input": np.array([prompt.encode()], dtype=np.object_), "stream": np.array([stream]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}


def _joined(responses: list) -> tuple[list[int], str, list[bool]]:
    assert responses and not isinstance(responses[-1], str), responses[-1:]
    return ([t for r in responses for t in r[0]], "".join(r[1] for r in responses), [d for r in responses for d in r[2]])


def _metrics(server: Server) -> str:
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=30) as r:
        return r.read().decode()


def _sum(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))


# -- identity ------------------------------------------------------------------------------------------------

def test_http_generate_and_generate_stream_equal_the_engine(server, reference):
    for prompt in PROMPTS[:2]:
        want = reference[prompt]
        body = {"text_input": prompt, "exclude_input_in_output": True, "parameters": {"max_tokens": NEW, "temperature": 0}}
        status, raw = _post(server, "/v2/models/specrt/generate", body)
        assert status == 200, raw
        out = json.loads(raw)
        assert out["token_ids"] == want["ids"] and out["text_output"] == want["text"]
        status, raw = _post(server, "/v2/models/specrt/generate_stream", {**body, "stream": True})
        assert status == 200, raw
        events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
        # (the generate extension sends a one-element output as a scalar)
        assert [t for e in events for t in np.atleast_1d(e.get("token_ids", [])).tolist()] == want["ids"]
        assert "".join(e.get("text_output", "") for e in events) == want["text"]
    # without exclude_input_in_output, a non-streamed response starts with the prompt (as vLLM's does)
    status, raw = _post(server, "/v2/models/specrt/generate",
                        {"text_input": PROMPTS[0], "parameters": {"max_tokens": NEW, "temperature": 0}})
    assert json.loads(raw)["text_output"] == PROMPTS[0] + reference[PROMPTS[0]]["text"]


def test_grpc_stream_the_readme_client_equals_the_engine(server, reference):
    prompt = PROMPTS[1]
    for stream in (True, False):
        [responses] = _grpc(server, _text_inputs(prompt, stream, {"max_tokens": NEW, "temperature": 0}))
        ids, text, drafted = _joined(responses)
        assert ids == reference[prompt]["ids"]
        assert text == (reference[prompt]["text"] if stream else prompt + reference[prompt]["text"])
        assert len(responses) > 1 if stream else len(responses) == 1
    # token ids in, token ids and drafted out: DSpark's trained head gets drafts accepted
    [responses] = _grpc(server, {"input_ids": np.array(reference[prompt]["prompt_ids"], np.int32),
                                 "stream": np.array([True])})
    ids, _, drafted = _joined(responses)
    assert ids[:NEW] == reference[prompt]["ids"] and any(drafted) and len(drafted) == len(ids)


def test_a_seeded_sampled_request_equals_the_python_api(server, reference):
    sampling = {"max_tokens": "20", "temperature": "0.8", "top_p": 0.95, "seed": 7}  # numbers may be strings
    [responses] = _grpc(server, _text_inputs(PROMPTS[2], False, sampling))
    ids, _, _ = _joined(responses)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=7)
    with Engine(server.art, method="dspark", scheduler="fixed", threads=1) as engine:
        outs, _ = engine.generate([Request(reference[PROMPTS[2]]["prompt_ids"], params, seed_offset=0)])
    assert ids == outs[0].output_ids


# -- errors, cancellation, load ------------------------------------------------------------------------------

def test_bad_requests_get_errors_and_the_server_keeps_serving(server, reference):
    bad = [_text_inputs(PROMPTS[0], True, {"max_tokens": 4, "bogus": 1}),
           {**_text_inputs(PROMPTS[0], True, {"max_tokens": 4}), "input_ids": np.array([1, 2], np.int32)},
           _text_inputs(PROMPTS[0], True, {"max_tokens": 10 ** 9}),
           {"input_ids": np.array([10 ** 8], np.int32), "stream": np.array([True])}]
    for inputs in bad:
        [responses] = _grpc(server, inputs)
        assert len(responses) == 1 and isinstance(responses[0], str), responses
    status, raw = _post(server, "/v2/models/specrt/generate", {"text_input": PROMPTS[0], "parameters": {"top_k": "x"}})
    assert status >= 400 and b"top_k" in raw
    [responses] = _grpc(server, _text_inputs(PROMPTS[0], True, {"max_tokens": NEW, "temperature": 0}))
    assert _joined(responses)[0] == reference[PROMPTS[0]]["ids"]


def test_a_cancelled_stream_stops_generating(server):
    before = _sum(_metrics(server), "specrt_generated_tokens_total")
    got = _grpc(server, _text_inputs(PROMPTS[3], True, {"max_tokens": 400, "temperature": 0, "ignore_eos": True}),
                stream_ids=2, cancel_after=4)
    assert 0 < sum(len(r) for r in got) < 400
    time.sleep(3.0)  # the engine aborts each request at its next event
    settled = _sum(_metrics(server), "specrt_generated_tokens_total")
    time.sleep(2.0)
    assert _sum(_metrics(server), "specrt_generated_tokens_total") == settled  # nothing is generating any more
    assert settled - before < 2 * 400  # the cancelled requests did not run to their max_tokens


def test_sixteen_streaming_clients_for_thirty_seconds(server, reference):
    """Every stream's tokens equal its prompt's reference: nothing lost, duplicated or mixed up between requests;
    both instances serve; Triton's counters and specrt's own metrics moved."""
    deadline = time.monotonic() + LOAD_S
    done, failures = [0] * CLIENTS, []

    def client(k: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            prompt = PROMPTS[(k + n) % len(PROMPTS)]
            try:
                [responses] = _grpc(server, _text_inputs(prompt, True, {"max_tokens": NEW, "temperature": 0}))
                ids, text, _ = _joined(responses)
                if ids != reference[prompt]["ids"] or text != reference[prompt]["text"]:
                    failures.append(f"client {k}: {prompt!r}: {ids} != {reference[prompt]['ids']}")
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                failures.append(f"client {k}: {type(e).__name__}: {e}")
            n += 1
            done[k] = n

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOAD_S + 300)
    assert not failures, failures[:5]
    assert all(n >= 1 for n in done) and sum(done) >= CLIENTS
    m = _metrics(server)
    assert _sum(m, "nv_inference_request_success") >= sum(done)
    per_instance = dict(re.findall(r'^specrt_generated_tokens_total{instance="([^"]+)",model="specrt"} (\S+)$', m, re.M))
    assert set(per_instance) == {"specrt_0_0", "specrt_0_1"} and all(float(v) > 0 for v in per_instance.values())
    assert _sum(m, "specrt_tau") > 0 and _sum(m, "specrt_accepted_drafts_total") > 0
    print(f"\n{sum(done)} streamed requests by {CLIENTS} clients in {LOAD_S:.0f} s; per instance tokens "
          f"{per_instance}; the server's environment: {server.env_mb:.0f} MB of packages")
