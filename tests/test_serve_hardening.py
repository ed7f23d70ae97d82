"""`specrt serve` against hostile and careless clients: body and connection limits, slow clients, malformed
JSON, cross-site requests, DNS rebinding, the API key, a callback-free failure path, and a schema-driven fuzzer.

Each test here failed before the server had serve/guard.py (or the protocol checks it names); every server is a
real `specrt serve` process on loopback over a tiny random model with a word-level tokenizer and a chat template.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pytest

from serving import free_port, metrics, post, running_server
from test_cli import EXPORT_FLAGS, cli

WORDS = "the a cat dog sat ran on under mat log and then it was big small red blue".split()
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
LIMITS = ("--max-body-bytes", "262144", "--header-timeout", "1", "--body-timeout", "2", "--max-connections", "24",
          "--threads", "1")


@pytest.fixture(scope="module")
def chat_art(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama with a word-level tokenizer and a one-line chat template, exported."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("hardening")
    d = Path(shutil.copytree(tiny_model_dir("llama"), root / "model"))
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, ":": 4,
                                      **{w: 5 + i for i, w in enumerate([*WORDS, "user", "assistant", "system"])}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    result = cli("export", d, "--out", root / "art", *EXPORT_FLAGS)
    assert result.exit_code == 0, result.output
    return root / "art"


@pytest.fixture(scope="module")
def served(chat_art, tmp_path_factory):
    """(url, log file) of a server with small limits."""
    log = tmp_path_factory.mktemp("hardening_log") / "serve.log"
    with running_server(chat_art, *LIMITS, log=log) as url:
        yield url, log


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


def _model(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url + "/v1/models", headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def _raw(url: str, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        if data:
            s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _json_reply(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _assert_api_error(answer: dict, code: str | None = None) -> None:
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
    if code is not None:
        assert err["code"] == code, err


def _chat(model: str, content: str = "the cat", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


# -- 2. size: bodies and prompts ------------------------------------------------------------------------------


def test_bodies_over_the_limit_and_over_long_prompts_are_refused_cheaply(url):
    model = _model(url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    status, answer = _json_reply(_raw(url, head + b"Content-Length: 10485760\r\n\r\n"))  # refused unread
    assert status == 413
    _assert_api_error(answer, "request_too_large")
    before = metrics(url).get("specrt_http_requests_total{endpoint=/v1/completions,status=413}", 0)
    chunk = b"x" * 300_000  # no length declared: refused once the limit is passed, the rest never read
    try:  # (the unread rest makes the kernel reset the connection, which may drop the 413 before we read it)
        _raw(url, head + b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    except ConnectionResetError:
        pass
    assert metrics(url)["specrt_http_requests_total{endpoint=/v1/completions,status=413}"] == before + 1
    # within the body limit, but more characters than the cache could hold whatever they tokenize to
    for path, body, param in [("/v1/completions", {"model": model, "prompt": "the cat " * 20_000}, "prompt"),
                              ("/v1/chat/completions", _chat(model, "the cat " * 20_000), "messages")]:
        status, answer = post(url, path, body)
        assert status == 400 and answer["error"]["param"] == param, answer
        _assert_api_error(answer, "context_length_exceeded")
        assert "characters" in answer["error"]["message"]
    assert post(url, "/v1/chat/completions", _chat(model))[0] == 200


# -- 3. slow clients and the connection cap ---------------------------------------------------------------------


def test_slow_clients_are_cut_off_and_the_connection_cap_holds(url):
    """Slowloris: partial headers, a partial body, or nothing at all; each connection ends within the timeouts."""
    model = _model(url)
    u = urlparse(url)
    body = json.dumps(_chat(model)).encode()
    openers = {
        "partial headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl",
        "partial body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10]),
        "nothing": b""}
    socks = []
    for kind, data in openers.items():
        for _ in range(6):
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            if data:
                s.sendall(data)
            socks.append((kind, s))
    t0 = time.monotonic()
    closed = {}
    for kind, s in socks:
        answer = b""
        while chunk := s.recv(65536):  # the server closes: recv returns b"" (a timeout here fails the test)
            answer += chunk
        closed.setdefault(kind, []).append((time.monotonic() - t0, answer))
        s.close()
    for _, answer in closed["partial headers"] + closed["nothing"]:
        assert answer == b""  # the header timeout: closed without a word
    for _, answer in closed["partial body"]:
        status, reply = _json_reply(answer)
        assert status == 408
        _assert_api_error(reply)
    assert max(t for v in closed.values() for t, _ in v) < 8
    # the cap: 24 connections open at once, the next gets a JSON 503 and is closed
    held = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(24)]
    try:
        time.sleep(0.2)
        status, reply = _json_reply(_raw(url, b""))  # answered as it connects, before it sends anything
        assert status == 503 and reply["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    assert post(url, "/v1/chat/completions", _chat(model))[0] == 200


# -- 4, 5, 6. malformed JSON, every response JSON and counted, hang-ups mid-body ---------------------------------


def test_malformed_json_gets_a_4xx_and_no_traceback(served):
    url, log = served
    model = _model(url)
    digits = b'{"model": "' + model.encode() + b'", "prompt": "the cat", "seed": ' + b"9" * 5000 + b"}"
    deep = b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases = [(b"/v1/completions", digits, None), (b"/v1/completions", deep, None),
             (b"/v1/completions", b'{"model": "M", "prompt": "a\\ud800b"}', "prompt"),
             (b"/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
              "messages[0].content"),
             (b"/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], '
                                       b'"stop": ["\\udfff"]}', "stop")]
    before = metrics(url)
    for path, body, param in cases:
        status, answer = post(url, path.decode(), body.replace(b'"M"', json.dumps(model).encode()))
        assert status == 400, (body[:80], answer)
        _assert_api_error(answer)
        assert answer["error"]["param"] == param
    after = metrics(url)
    key = "specrt_http_requests_total{endpoint=/v1/completions,status=400}"
    assert after[key] - before.get(key, 0) == 3
    assert "Traceback" not in log.read_text()


def test_every_response_is_json_and_counted_even_an_unexpected_error(chat_art, monkeypatch):
    """A bug in a handler is a JSON 500 in the API's error shape, and counted (in-process app, real engine)."""
    from fastapi.testclient import TestClient

    from specrt.runtime.engine import Engine
    from specrt.serve import app as app_module
    from specrt.serve.app import create_app
    from specrt.serve.guard import Limits, allowed_hosts
    from specrt.serve.loop import EngineLoop

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    loop = EngineLoop(Engine(chat_art, threads=1))
    try:
        app = create_app(loop, "m", Limits(allowed_hosts=allowed_hosts("127.0.0.1", ("testserver",))))
        monkeypatch.setattr(app_module, "parse", broken)
        client = TestClient(app, raise_server_exceptions=False)
        r = client.post("/v1/completions", json={"model": "m", "prompt": "the cat"})
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"] == {"message": "internal server error (RuntimeError)", "type": "server_error",
                                     "param": None, "code": None}
        for path, status in [("/nowhere", 404), ("/v1/models", 200)]:
            assert client.get(path).status_code == status
        text = client.get("/metrics").text
        assert 'specrt_http_requests_total{endpoint="/v1/completions",status="500"} 1.0' in text
        assert 'specrt_http_requests_total{endpoint="other",status="404"} 1.0' in text
    finally:
        loop.close()


def test_a_client_hanging_up_mid_body_is_one_log_line(served):
    url, log = served
    u = urlparse(url)
    for _ in range(20):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
            time.sleep(0.05)
    time.sleep(1)
    text = log.read_text()
    assert "Traceback" not in text and "ClientDisconnect" not in text
    assert text.count("hung up while sending its request body") >= 20


# -- 7. no NaN reaches sampling -----------------------------------------------------------------------------------


def test_a_vanishing_temperature_answers_like_greedy(url):
    model = _model(url)
    greedy = post(url, "/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 12,
                                           "temperature": 0, "ignore_eos": True})[1]
    tiny = post(url, "/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 12,
                                         "temperature": 1e-308, "ignore_eos": True})[1]
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"] and tiny["usage"]["completion_tokens"] == 12


# -- 8, 9. cross-site requests, DNS rebinding, the API key ------------------------------------------------------


def test_cross_site_posts_and_foreign_hosts_are_refused(url):
    model = _model(url)
    body = json.dumps(_chat(model)).encode()
    port = urlparse(url).port
    cases = [({"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403, "cross_origin"),
             ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
             ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
             ({"Host": "evil.example", "Content-Type": "application/json"}, 421, "invalid_host"),
             ({"Host": f"rebound.example:{port}", "Content-Type": "application/json"}, 421, "invalid_host")]
    for headers, status, code in cases:
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status, headers
        _assert_api_error(json.loads(e.value.read()), code)
    for headers in ({"Origin": url}, {"Host": f"localhost:{port}"}, {}):  # the playground's own page; loopback names
        status, _ = post(url, "/v1/chat/completions", body, headers=headers)
        assert status == 200, headers


def test_the_api_key_cors_origins_and_the_warning_beyond_loopback(chat_art, tmp_path):
    import openai

    env = {**os.environ, "SPECRT_API_KEY": "s3cret"}
    with running_server(chat_art, "--threads", "1", "--cors-origin", "https://app.example", env=env) as url:
        body = json.dumps(_chat("x")).encode()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, answer = post(url, "/v1/chat/completions", body, headers=headers)
            assert status == 401, headers
            _assert_api_error(answer, "invalid_api_key")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/v1/models", timeout=10)
        assert e.value.code == 401
        with urllib.request.urlopen(url + "/health", timeout=10) as r:  # open: for load balancers
            assert r.status == 200
        with urllib.request.urlopen(url + "/", timeout=10) as r:  # the playground asks for the key
            assert 'id="key"' in r.read().decode()
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "the cat"}],
                                               max_tokens=3)
        assert reply.usage.completion_tokens >= 1
        # an allowed origin: the preflight, then the request, both with CORS headers
        req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS",
                                     headers={"Origin": "https://app.example",
                                              "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204 and r.headers["access-control-allow-origin"] == "https://app.example"
            assert "authorization" in r.headers["access-control-allow-headers"]
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(_chat(model)).encode(),
                                     headers={"Origin": "https://app.example", "Content-Type": "application/json",
                                              "Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        status, _ = post(url, "/v1/chat/completions", json.dumps(_chat(model)).encode(),
                         headers={"Origin": "https://other.example", "Authorization": "Bearer s3cret"})
        assert status == 403
    # beyond loopback without a key: served, with a warning (read before the engine loads)
    proc = subprocess.Popen([sys.executable, "-c", "from specrt.cli import main; main()", "serve", str(chat_art),
                             "--host", "0.0.0.0", "--port", str(free_port()), "--threads", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(15)
    assert line.startswith("specrt: warning: serving on 0.0.0.0") and "no --api-key" in line


def test_bad_limit_flags(chat_art):
    from test_cli import assert_one_line_error

    for flags in (["--max-body-bytes", "0"], ["--header-timeout", "-1"], ["--max-connections", "0"],
                  ["--api-key", " "]):
        assert_one_line_error(cli("serve", chat_art, *flags), *flags[:1])


# -- 10. a schema-driven fuzzer -------------------------------------------------------------------------------


FUZZ_EXAMPLES = int(os.environ.get("SPECRT_FUZZ_EXAMPLES", "250"))


def test_fuzzing_the_api_finds_no_5xx_and_the_server_serves_on(chat_art, tmp_path):
    """Schemathesis reads the server's OpenAPI schema and sends FUZZ_EXAMPLES generated requests per endpoint
    (bodies valid by the schema and bodies that break it, odd values): never a 5xx, every error in the API's
    shape, and the server serves correctly afterwards."""
    schemathesis = pytest.importorskip("schemathesis", reason="the HTTP API is fuzzed with Schemathesis "
                                                              "(pip install 'specrt[test]')")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    log = tmp_path / "serve.log"
    statuses: Counter = Counter()
    with running_server(chat_art, "--threads", "1", "--max-body-bytes", "65536", log=log) as url:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        for operation in schema.get_all_operations():
            op = operation.ok()

            @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                response = case.call(base_url=url, timeout=60)
                statuses[(op.path, response.status_code)] += 1
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400:
                    _assert_api_error(response.json())

            fuzz()
        assert post(url, "/v1/chat/completions", _chat(_model(url)))[0] == 200
    report = {f"{path} {status}": n for (path, status), n in sorted(statuses.items())}
    print("fuzzing:", json.dumps(report))
    (Path(os.environ.get("SPECRT_FUZZ_REPORT", tmp_path / "fuzz.json"))).write_text(json.dumps(report, indent=1))
    assert sum(n for (path, _), n in statuses.items() if path.startswith("/v1/")) >= 2 * FUZZ_EXAMPLES
    assert "Traceback" not in log.read_text()


def test_the_host_names_a_bind_address_answers_to():
    from specrt.serve.guard import _host_name, allowed_hosts

    loopback = ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("127.0.0.1") == allowed_hosts("localhost") == allowed_hosts("::1") == loopback
    assert allowed_hosts("127.0.0.1", ("API.example",)) == (*loopback, "api.example")
    assert allowed_hosts("0.0.0.0") == ("*",) and allowed_hosts("::", ("a.example",)) == ("a.example",)
    assert allowed_hosts("10.1.2.3") == ("10.1.2.3",) and allowed_hosts("10.1.2.3", ("*",)) == ("*",)
    assert [_host_name(h) for h in ("[::1]:8000", "LocalHost:80", "127.0.0.1", "::1")] == [
        "::1", "localhost", "127.0.0.1", "::1"]


# -- second probe: what uvicorn refuses, non-ASCII keys, templates that never end ------------------------------------


def _exchange(url: str, request: bytes) -> tuple[bytes, bytes]:
    """(status line and headers, body) of one raw HTTP/1.1 exchange, the server closing the connection."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_requests_uvicorn_cannot_parse_get_the_json_error_and_are_counted(served):
    url, log = served
    before = metrics(url).get("specrt_http_requests_total{endpoint=other,status=400}", 0)
    for request in (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n{}",
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.2\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"):
        head, body = _exchange(url, request)
        assert head.startswith(b"HTTP/1.1 400"), head
        assert b"content-type: application/json" in head.lower(), head
        _assert_api_error(json.loads(body), "malformed_request")
    assert metrics(url)["specrt_http_requests_total{endpoint=other,status=400}"] - before == 3


def test_a_non_ascii_api_key_matches_as_clients_send_it(chat_art):
    key = "clé-秘密"
    with running_server(chat_art, "--threads", "1", env={**os.environ, "SPECRT_API_KEY": key}) as url:
        def models(token: bytes) -> bytes:
            return _exchange(url, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                             b"Authorization: Bearer " + token + b"\r\n\r\n")[0]

        assert models(key.encode("utf-8")).startswith(b"HTTP/1.1 200")  # what curl and the openai client send
        assert models(key.encode("utf-8")[:-1]).startswith(b"HTTP/1.1 401")
        assert models("clé".encode("latin-1") + "-秘密".encode("utf-8")).startswith(b"HTTP/1.1 401")


@pytest.fixture(scope="module")
def endless_art(chat_art, tmp_path_factory) -> Path:
    """The chat artifact with a template whose loops would run 10^10 times."""
    import shutil

    art = Path(shutil.copytree(chat_art, tmp_path_factory.mktemp("endless") / "art"))
    d = json.loads((art / "manifest.json").read_text())
    d["tokenizer"]["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                       "{% endfor %}{{ messages[0]['content'] }}")
    d["tokenizer"].pop("chat", None)
    (art / "manifest.json").write_text(json.dumps(d))
    return art


def test_a_template_that_never_ends_is_stopped_and_the_server_serves_on(endless_art, tmp_path):
    """Seven chat requests whose template never ends, their clients leaving: generation goes on for others, a
    client that waits gets a 400 naming the budget, and SIGTERM stops the server within seconds."""
    log, processes = tmp_path / "serve.log", []
    with running_server(endless_art, "--threads", "1", log=log, processes=processes) as url:
        model = _model(url)
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "the cat"}],
                           "max_tokens": 2}).encode()
        for _ in range(7):  # clients that give up after half a second
            with pytest.raises(OSError):  # socket.timeout / URLError
                urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
                    "Content-Type": "application/json"}), timeout=0.5)
        start = time.monotonic()
        status, answer = post(url, "/v1/completions", {"model": model, "prompt": "the cat", "max_tokens": 2},
                              timeout=30)
        assert status == 200 and time.monotonic() - start < 15
        start = time.monotonic()
        status, answer = post(url, "/v1/chat/completions", body, timeout=60)
        assert status == 400 and "ran more than" in answer["error"]["message"], answer
        assert time.monotonic() - start < 30
        # SIGTERM while three such renders run
        waiting = [threading.Thread(target=post, args=(url, "/v1/chat/completions", body), kwargs={"timeout": 30},
                                    daemon=True) for _ in range(3)]
        for t in waiting:
            t.start()
        time.sleep(0.3)
        started = time.monotonic()
        processes[0].send_signal(signal.SIGTERM)
        processes[0].wait(timeout=20)
        assert time.monotonic() - started < 20
    assert "Traceback" not in log.read_text()
