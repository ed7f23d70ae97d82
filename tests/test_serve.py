"""`specrt serve`: a real server process on loopback, spoken to with the official `openai` client.

Greedy answers equal a direct engine run (autoregressive: the loop is lossless), streamed and whole
answers agree, bad requests get OpenAI-style 4xx errors and the server keeps serving, a client that
goes away frees its slot, and /metrics parses with Prometheus' own parser.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams
from serving import metrics, post, running_server

openai = pytest.importorskip("openai", reason="the server is tested with the official openai client (pip install "
                                                "'specrt[test]')")

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+3?", "Name three primary colors.", "Write a Python function that reverses a string.",
             "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server(served_art):
    with running_server(served_art, "--method", "dspark", "--scheduler", "fixed", "--threads", "1") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(served_art):
    """Greedy answers of a direct autoregressive engine run on the same prompts (chat template applied)."""
    with Engine(served_art, method="ar") as engine:
        tok = engine.tokenizer
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
        outs, _ = engine.generate([Request(p, SamplingParams(max_new_tokens=48), id=i) for i, p in enumerate(ids)])
    return {q: (p, o) for q, p, o in zip(QUESTIONS, ids, outs)}


def test_models(client, served_art):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_greedy_equals_direct_engine(client, model, reference):
    for q in QUESTIONS:
        prompt, out = reference[q]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                           max_tokens=48, temperature=0)
        assert r.choices[0].message.content == out.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[out.finish_reason]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(out.output_ids))
        assert r.usage.total_tokens == len(prompt) + len(out.output_ids)


def test_chat_streaming_equals_whole(client, model, reference):
    q = QUESTIONS[2]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=48,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3  # streamed, not one piece
    assert text == reference[q][1].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if reference[q][1].finish_reason == "length" else "stop"]
    assert chunks[-1].usage.completion_tokens == len(reference[q][1].output_ids)


def test_completions_streaming_and_whole(client, model, served_art):
    with Engine(served_art) as engine:
        ids = engine.tokenizer.encode("The capital of France is", add_special_tokens=True)
        (out,), _ = engine.generate([Request(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))])
    whole = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == out.text and whole.usage.completion_tokens == 16
    streamed = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_generate_detokenizes_once_what_it_would_stream(served_art):
    """generate() without on_text detokenizes each request once, when it finishes: the same text as the deltas
    streamed with on_text (multi-byte characters included), and with stop strings it still streams (they are
    found as the text grows)."""
    prompts = ["Write the word café and three emoji.", "Say hello in Japanese and in Greek.", "List 3 colors."]
    with Engine(served_art, method="dspark+ngram") as engine:
        reqs = [Request(encode_prompt(engine.tokenizer, p), SamplingParams(max_new_tokens=40), id=i)
                for i, p in enumerate(prompts)]
        deferred: list[bool] = []  # per step of each generate(): whether its slots detokenize token by token
        once, _ = engine.generate(reqs, on_token=lambda *_: deferred.extend(not s.streaming for s in engine.slots if s))
        streamed: dict[int, str] = {}
        whole, _ = engine.generate(reqs, on_text=lambda i, t: streamed.__setitem__(i, streamed.get(i, "") + t))
        kept: list[bool] = []
        stop = [Request(r.prompt_ids, SamplingParams(max_new_tokens=40, stop_strings=("e",)), id=r.id) for r in reqs]
        cut, _ = engine.generate(stop, on_token=lambda *_: kept.extend(s.streaming for s in engine.slots if s))
    assert deferred and all(deferred) and kept and all(kept)
    assert [o.text for o in once] == [o.text for o in whole] == [streamed.get(i, "") for i in range(3)]
    assert any(any(ord(c) > 127 for c in o.text) for o in once)  # a multi-byte character came out
    assert all("e" not in o.text for o in cut)


def test_stop_strings_and_seeded_sampling(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count from 1 to 20."}],
                                       max_tokens=64, temperature=0, stop=["5"])
    assert "5" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    sampled = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[3]}],
                                              max_tokens=32, temperature=1.0, seed=seed)
               for seed in (3, 3, 4)]
    assert sampled[0].usage.completion_tokens >= 1
    # a seed reproduces a sampled answer, whatever request id the server gives it
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
    assert sampled[2].choices[0].message.content != sampled[0].choices[0].message.content


def test_token_marks_stream_drafts_and_target_tokens(server, model):
    """The playground's extension: every streamed token with its text and whether it was an accepted draft."""
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 48,
            "temperature": 0, "stream": True, "token_marks": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    lines = [ln for ln in conn.getresponse().read().decode().split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    tokens = [t for ln in lines[:-1] for t in json.loads(ln[6:]).get("specrt", {}).get("tokens", [])]
    assert len(tokens) == 48 or tokens[-1]["id"] in (0, 2)
    assert not tokens[0]["drafted"]  # the prefill's token is the target's
    assert any(t["drafted"] for t in tokens) and sum(not t["drafted"] for t in tokens) < len(tokens)


BAD = [  # (what, path, body, status, param)
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("missing messages", "/v1/chat/completions", {"model": "M"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0]"),
    ("missing prompt", "/v1/completions", {"model": "M"}, 400, "prompt"),
    ("negative max_tokens", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("absurd max_tokens", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 10 ** 12}, 400,
     "max_tokens"),
    ("string max_tokens", "/v1/completions", {"model": "M", "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("prompt too long", "/v1/completions", {"model": "M", "prompt": "hello " * 2000}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"model": "M", "prompt": [1, 2, 10 ** 7]}, 400,
     "prompt"),
    ("temperature < 0", "/v1/completions", {"model": "M", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature NaN", "/v1/completions", b'{"model": "M", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    ("top_p 0", "/v1/completions", {"model": "M", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"model": "M", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", "/v1/completions", {"model": "M", "prompt": "x", "top_k": -3}, 400, "top_k"),
    ("empty stop", "/v1/completions", {"model": "M", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("n > 1", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 2},
     400, "n"),
    ("logprobs", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                          "logprobs": True}, 400, "logprobs"),
    ("completion logprobs", "/v1/completions", {"model": "M", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("penalty", "/v1/completions", {"model": "M", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("stream not a bool", "/v1/completions", {"model": "M", "prompt": "x", "stream": "yes"}, 400, "stream"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, model, client):
    for what, path, body, status, param in BAD:
        if isinstance(body, dict):
            body = {**body, "model": model} if body.get("model") == "M" else body
        else:
            body = body.replace(b'"M"', json.dumps(model).encode())
        got, answer = post(server, path, body)
        assert got == status, (what, got, answer)
        err = answer["error"]
        assert err["message"] and "\n" not in err["message"], what
        assert err["type"] == "invalid_request_error" and err["param"] == param, (what, err)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert post(server, "/v1/nothing", {})[0] == 404
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.usage.completion_tokens >= 1
    m = metrics(server)
    assert m["specrt_http_requests_total{endpoint=/v1/completions,status=400}"] >= 10


def _slots_free(url: str, before_aborted: float, n: int) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = metrics(url)
        if m["specrt_active_slots"] == 0 and m["specrt_requests_aborted_total"] >= before_aborted + n:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_disconnects_abort_and_free_slots(server, model):
    u = urlparse(server)
    before = metrics(server)["specrt_requests_aborted_total"]
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 400,
            "ignore_eos": True}
    conns = []
    for stream in (True, True, False):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": stream}),
                     {"Content-Type": "application/json"})
        conns.append((conn, stream))
    for conn, stream in conns:
        if stream:  # read the first chunks, then hang up mid-stream
            resp = conn.getresponse()
            assert resp.readline().startswith(b"data: ")
        else:
            time.sleep(1.0)  # the request is running
        conn.sock.shutdown(2)
        conn.close()
    m = _slots_free(server, before, 3)
    assert m["specrt_generation_tokens_total"] < m["specrt_requests_total"] * 400  # none ran to its end


def test_concurrent_streams_each_equal_their_direct_run(client, model, reference):
    results: dict[str, str] = {}

    def ask(q: str) -> None:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                                max_tokens=48, temperature=0, stream=True)
        results[q] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {q: reference[q][1].text for q in QUESTIONS}


def test_metrics_in_prometheus_format(server, client, model):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=8)
    m = metrics(server)
    assert m["specrt_requests_total"] >= 1 and m["specrt_generation_tokens_total"] >= 8
    assert m["specrt_slots"] == 4 and m["specrt_queue_depth"] == 0
    assert 1.0 <= m["specrt_tau"] <= 8.0
    positions = [k for k in m if k.startswith("specrt_draft_acceptance{")]
    assert len(positions) == 7 and all(0.0 <= m[k] <= 1.0 for k in positions)
    assert m["specrt_draft_seconds_total"] > 0 and m["specrt_verify_seconds_total"] > 0
    assert m["specrt_time_to_first_token_seconds_count"] >= 1
    with urllib_get(server + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def urllib_get(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


def test_serve_refuses_bad_flags(served_art, tmp_path):
    from click.testing import CliRunner

    from specrt.cli import main

    r = CliRunner().invoke(main, ["serve", str(tmp_path / "missing")])
    assert r.exit_code == 1 and "specrt: error:" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["serve", str(served_art), "--slots", "9"])
    assert r.exit_code == 1 and "--slots must be between 1 and 4" in r.output
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = CliRunner().invoke(main, ["serve", str(served_art), "--port", str(busy.getsockname()[1])])
    assert r.exit_code == 1 and "cannot listen on 127.0.0.1" in r.output
