"""OpenAI request bodies in, (prompt ids, sampling parameters) out; anything we cannot honour is a 4xx error.

The fields follow OpenAI's `/v1/completions` and `/v1/chat/completions`. Extensions, as vLLM names them:
`top_k`, `ignore_eos`, `stop_token_ids`; and `token_marks` (the playground): each streamed chunk carries
which tokens were accepted drafts. Defaults are OpenAI's (temperature 1, top_p 1, max_tokens: what the
cache has left).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specrt.errors import SpecrtError
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer

MAX_STOP = 4  # OpenAI's limit on `stop` sequences
# A text longer than room x (the longest token's characters) x this cannot fit, whatever it tokenizes to: refused
# before tokenizing. The factor leaves room for normalizers that compose several characters into one.
CHARS_SLACK = 4


class APIError(Exception):
    """An error the client caused (or a missing model): becomes {"error": {...}} with `status`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # no lone surrogates in a reply
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = message, status, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    """A validated request: what the engine needs and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    token_marks: bool


def parse(body: Any, *, chat: bool, model: str, tokenizer: Tokenizer | None, room: int) -> Parsed:
    """Validate an OpenAI request body. `room`: cache positions a request may use (prompt + output)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if body.get("model") != model:
        if "model" not in body:
            raise APIError("you must provide a model parameter", param="model")
        raise APIError(f"the model {body['model']!r} does not exist; this server serves {model!r}",
                       status=404, param="model", code="model_not_found")
    _refuse_unsupported(body, chat=chat)
    ids = _chat_prompt(body, tokenizer, room) if chat else _completion_prompt(body, tokenizer, room)
    if len(ids) >= room:
        raise APIError(f"the prompt is {len(ids)} tokens; this model's cache holds {room} positions for prompt "
                       f"and completion together", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, limit_name, default=room - len(ids), low=1)
    if len(ids) + max_tokens > room:
        raise APIError(f"{limit_name} {max_tokens} + the prompt's {len(ids)} tokens exceed this model's {room} "
                       f"positions; ask for at most {room - len(ids)}", param=limit_name,
                       code="context_length_exceeded")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise APIError(f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings",
                       param="stop")
    for s in stop:
        _text(s, "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise APIError("stop_token_ids must be a list of token ids", param="stop_token_ids")
    # every value is checked above, in the request's own names; SamplingParams' checks cannot fail after them
    params = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, above_low=True),
                            top_k=0 if body.get("top_k") == -1 else _int(body, "top_k", default=0, low=0),
                            seed=_int(body, "seed", default=None, low=0),
                            max_new_tokens=max_tokens, stop_strings=tuple(stop),
                            stop_token_ids=tuple(stop_ids), ignore_eos=_bool(body, "ignore_eos"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    stream = _bool(body, "stream")
    if options and not stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    return Parsed(ids, params, stream, bool(options.get("include_usage")), _bool(body, "token_marks"))


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise APIError(f"n must be 1 (specrt returns one choice per request), got {n!r}", param="n")
    if body.get("best_of") not in (None, 1):
        raise APIError("best_of is not supported (send separate requests)", param="best_of")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") is not None:
        raise APIError("logprobs are not supported by this server", param="logprobs")
    if body.get("echo"):
        raise APIError("echo is not supported", param="echo")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(f"{name} is not supported (penalties would change the target's distribution "
                           f"outside the lossless loop)", param=name)
    if body.get("logit_bias"):
        raise APIError("logit_bias is not supported", param="logit_bias")
    for name in ("tools", "functions", "response_format", "suffix"):
        if body.get(name) and not (name == "response_format" and body[name] == {"type": "text"}):
            raise APIError(f"{name} is not supported", param=name)
    if chat and body.get("prompt") is not None:
        raise APIError("chat completions take messages, not prompt", param="prompt")


def _text(value: str, param: str) -> str:
    """A string the engine will tokenize or match: it must be valid Unicode (JSON's "\ud800" escapes can
    carry a lone UTF-16 surrogate, which no tokenizer encodes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{param} contains an unpaired UTF-16 surrogate (invalid Unicode)", param=param) from None
    return value


def _check_length(chars: int, tokenizer: Tokenizer, room: int, param: str) -> None:
    """Refuse, before tokenizing, a text too long to fit in `room` positions whatever its tokens."""
    most = room * tokenizer.max_token_chars * CHARS_SLACK
    if chars > most:
        raise APIError(f"the {param} is {chars} characters; this model's cache holds {room} positions, which no "
                       f"text over {most} characters fits", param=param, code="context_length_exceeded")


def _chat_prompt(body: dict, tokenizer: Tokenizer | None, room: int) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise APIError("missing required parameter: messages", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(f"messages[{i}] must be an object with role system, user or assistant",
                           param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string", param=f"messages[{i}]")
        _text(content, f"messages[{i}].content")
        flat.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    _check_length(sum(len(m["content"]) for m in flat), tokenizer, room, "messages")
    try:
        text = tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    except SpecrtError as e:
        raise APIError(str(e), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _completion_prompt(body: dict, tokenizer: Tokenizer | None, room: int) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("missing required parameter: prompt", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if tokenizer is None:
            raise APIError("this model has no tokenizer; send prompt as a list of token ids", param="prompt")
        _check_length(len(_text(prompt, "prompt")), tokenizer, room, "prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError("batched prompts are not supported; send one request per prompt", param="prompt")
    raise APIError("prompt must be a non-empty string or a list of token ids", param="prompt")


def _number(body: dict, name: str, default: float, low: float, high: float, *, above_low: bool = False) -> float:
    """A number in [low, high] (in (low, high] if `above_low`), or `default` when absent."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if above_low else low <= value) or value > high:
        interval = f"({low:g}, {high:g}]" if above_low else f"[{low:g}, {high:g}]"
        raise APIError(f"{name} must be a number in {interval}, got {value!r}", param=name)
    return float(value)


def _int(body: dict, name: str, *, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise APIError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {value!r}", param=name)
    return value
