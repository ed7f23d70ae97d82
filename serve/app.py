"""The OpenAI-compatible HTTP server: FastAPI routes over one EngineLoop.

    POST /v1/completions, /v1/chat/completions ─► parse (serve/protocol.py) ─► loop.submit ─► events
         ◄── SSE chunks ("data: {...}", "data: [DONE]") or one JSON body ◄────────────────────┘
    GET  /v1/models, /health, /metrics (Prometheus), / (the playground)

Handlers only submit, stream and abort: the engine is stepped by the loop's thread alone; parsing a body and
tokenizing its prompt run on a worker thread, so a large request never holds up the event loop. A client that
goes away (a closed stream, or a closed connection while a non-streaming answer is pending) aborts its
request, which frees its slot at the next step. In front of the routes, serve/guard.py applies the server's
limits, origin and key checks; every response, errors included, is JSON in OpenAI's error shape and counted.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specrt.errors import SpecrtError
from specrt.serve.guard import Guard, Limits
from specrt.serve.loop import EngineLoop, Event
from specrt.serve.metrics import Metrics
from specrt.serve.protocol import APIError, Parsed, parse
from specrt.tokenizer_info import render_stop

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json")
DISCONNECT_POLL_S = 0.25


class _Call:
    """One generation request in flight: its events arrive on an asyncio queue from the loop thread."""

    def __init__(self, server: "Server", parsed: Parsed, chat: bool) -> None:
        self.server, self.parsed, self.chat = server, parsed, chat
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished = False
        aloop = asyncio.get_running_loop()
        try:
            self.id = server.loop.submit(parsed.prompt_ids, parsed.params,
                                         lambda ev: aloop.call_soon_threadsafe(self.queue.put_nowait, ev))
        except SpecrtError as e:
            raise APIError(str(e), param="messages" if chat else "prompt") from None
        tok = server.loop.engine.tokenizer
        self.pieces = tok.stream_decoder(skip_special_tokens=True) if parsed.token_marks and tok else None
        self.name = f"{'chatcmpl' if chat else 'cmpl'}-{self.id}"
        self.created = int(time.time())

    async def next(self) -> Event:
        ev = await self.queue.get()
        if ev.error is not None:
            self.finished = True
            raise APIError(f"generation failed: {ev.error}", status=500, kind="server_error")
        if ev.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.server.metrics.ttft.observe(self.first_token_at - self.start)
        if ev.finished is not None:
            self.finished = True
            self.server.metrics.latency.observe(time.perf_counter() - self.start)
        return ev

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.server.loop.abort(self.id)

    def marks(self, ev: Event) -> list[dict[str, Any]]:
        """Per token: its text piece and whether it was an accepted draft (the playground colours them)."""
        return [{"id": t, "text": self.pieces.push([t]), "drafted": d} for t, d in zip(ev.token_ids, ev.drafted)]

    def usage(self, completion_tokens: int) -> dict[str, int]:
        n = len(self.parsed.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}

    def envelope(self, choices: list[dict], *, streamed: bool) -> dict[str, Any]:
        """A response object (or a streamed chunk of one) around `choices`."""
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.name, "object": kind, "created": self.created, "model": self.server.model,
                "choices": choices}

    def chunk(self, text: str, finish: str | None, ev: Event | None = None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = self.envelope([choice], streamed=True)
        if ev is not None and self.pieces is not None:
            out["specrt"] = {"tokens": self.marks(ev)}
        return out


class Server:
    """Routes and state of `specrt serve`: the model name, the loop, the metrics."""

    def __init__(self, loop: EngineLoop, model: str, limits: Limits | None = None) -> None:
        self.loop, self.model = loop, model
        engine = loop.engine
        self.room = engine.capacity - engine.gamma  # prompt + completion positions a request may use
        self.metrics = Metrics(loop, model)
        self.started = int(time.time())
        self.app = FastAPI(title="specrt", version="0.1.0", docs_url=None, redoc_url=None)
        self._routes()
        self.asgi = Guard(self.app, limits or Limits(),
                          lambda endpoint, status: self.metrics.http.labels(endpoint, str(status)).inc(), ROUTES)

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            err = APIError(str(exc.detail), status=exc.status_code)
            return JSONResponse(err.body(), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: logged with its traceback
            err = APIError(f"internal server error ({type(exc).__name__})", status=500, kind="server_error")
            return JSONResponse(err.body(), status_code=500)

        @app.get("/", response_class=HTMLResponse)
        async def playground() -> str:
            return resources.files("specrt.serve").joinpath("playground.html").read_text(encoding="utf-8")

        @app.get("/health")
        async def health() -> JSONResponse:
            alive = self.loop.alive
            return JSONResponse({"status": "ok" if alive else "engine loop stopped"}, status_code=200 if alive else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            e = self.loop.engine
            return {"object": "list", "data": [{
                "id": self.model, "object": "model", "created": self.started, "owned_by": "specrt",
                "max_model_len": self.room,
                "specrt": {"method": e.method, "gamma": e.gamma, "scheduler": e.scheduler_name,
                           "backend": e.backend, "slots": len(e.slots)}}]}

        @app.post("/v1/completions", openapi_extra=request_schema(chat=False, model=self.model))
        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions", openapi_extra=request_schema(chat=True, model=self.model))
        async def chat_completions(request: Request) -> Response:
            return await self._generate(request, chat=True)

    def _parse(self, raw: bytes, chat: bool, stop: threading.Event) -> Parsed:
        """JSON, validation and tokenization of one request body (on a worker thread); a chat template's render
        stops once `stop` is set (the client left)."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:  # ValueError: bad JSON, or an integer over 4300 digits
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from None
        except RecursionError:
            raise APIError("the request body is not valid JSON: nested too deeply") from None
        with render_stop(stop):
            return parse(body, chat=chat, model=self.model, tokenizer=self.loop.engine.tokenizer, room=self.room)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        stop = threading.Event()
        parsing = asyncio.ensure_future(asyncio.to_thread(self._parse, await request.body(), chat, stop))
        while not parsing.done():  # a render (bounded in work) still stops as soon as its client has left
            await asyncio.wait({parsing}, timeout=DISCONNECT_POLL_S)
            if not parsing.done() and await request.is_disconnected():
                stop.set()
                parsing.add_done_callback(lambda t: t.exception())  # it ends with an error nobody reads
                return Response(status_code=499)  # nginx's "client closed request": nobody receives it
        parsed = parsing.result()
        call = _Call(self, parsed, chat)
        headers = {"x-specrt-request-id": str(call.id)}
        if parsed.stream:
            return StreamingResponse(self._stream(call), media_type="text/event-stream", headers=headers)
        try:
            return JSONResponse(await self._complete(call, request), headers=headers)
        finally:
            call.abort()  # a no-op once finished; frees the slot when the client went away

    async def _complete(self, call: _Call, request: Request) -> dict:
        """Wait for the whole answer, aborting if the client disconnects meanwhile."""
        check_at = time.monotonic() + DISCONNECT_POLL_S
        while True:
            try:
                ev = await asyncio.wait_for(call.next(), DISCONNECT_POLL_S)
            except TimeoutError:
                ev = None
            if ev is not None and ev.finished is not None:
                break
            if time.monotonic() >= check_at:  # tokens may arrive faster than the poll: check by the clock
                check_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return {}
        out = ev.finished
        finish = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        if call.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish}
        return {**call.envelope([choice], streamed=False), "usage": call.usage(len(out.output_ids))}

    async def _stream(self, call: _Call):
        """SSE: a chunk per engine step, the finish reason, usage if asked, then [DONE]."""
        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if call.chat:
                yield sse(call.chunk("", None, first=True))
            while True:
                try:
                    ev = await call.next()
                except APIError as e:
                    yield sse(e.body())
                    break
                if ev.text or ev.token_ids:
                    yield sse(call.chunk(ev.text, None, ev))
                if ev.finished is not None:
                    out = ev.finished
                    yield sse(call.chunk("", FINISH_REASONS.get(out.finish_reason, out.finish_reason)))
                    if call.parsed.include_usage:
                        yield sse({**call.envelope([], streamed=True), "usage": call.usage(len(out.output_ids))})
                    break
            yield "data: [DONE]\n\n"
        finally:
            call.abort()  # the client closed the stream early (or the loop failed): free the slot


def create_app(loop: EngineLoop, model: str, limits: Limits | None = None):
    """The ASGI app serving `loop`'s engine under the model name `model`, behind serve/guard.py's `limits`."""
    return Server(loop, model, limits).asgi


def request_schema(*, chat: bool, model: str) -> dict[str, Any]:
    """The OpenAPI request body of a generation endpoint (the fields protocol.parse reads; others are refused
    or ignored there), so schema-driven clients and fuzzers know what to send."""
    text_or_ids = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
    props: dict[str, Any] = {
        "model": {"type": "string", "enum": [model]},
        "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "top_k": {"type": "integer", "minimum": -1},
        "seed": {"type": "integer", "minimum": 0}, "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": "boolean"}, "token_marks": {"type": "boolean"}, "n": {"type": "integer"}}
    if chat:
        props["messages"] = {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                           "content": {"type": "string"}}}}
        props["max_completion_tokens"] = {"type": "integer", "minimum": 1}
        required = ["model", "messages"]
    else:
        props["prompt"] = text_or_ids
        required = ["model", "prompt"]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": required, "properties": props}}}}}
