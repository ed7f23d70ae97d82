"""The `sampling_parameters` JSON of Triton's vLLM backend, read into specrt's SamplingParams.

vLLM clients send numbers as JSON numbers or as strings ("0.1", "100"); both are accepted. top_k -1 (vLLM's "off")
is specrt's 0. Keys specrt has no meaning for are refused (a misspelt key must not be silently ignored), except
`stream`, which clients of the HTTP generate endpoint put there and which the `stream` input decides, and vLLM
options specrt lacks when set to their neutral value (n 1, repetition_penalty 1, ...).
"""
from __future__ import annotations

import json
from typing import Any

from specrt.errors import SpecrtError, clipped, quoted
from specrt.runtime.sampling import SamplingParams

IGNORED = ("stream",)
# vLLM parameters specrt does not implement, accepted at the value that leaves sampling unchanged
NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
           "min_tokens": 0}


def _int(key: str, v: Any) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    raise SpecrtError(f"sampling_parameters: {key} must be an integer, got {quoted(v)}")


def _float(key: str, v: Any) -> float:
    try:
        if isinstance(v, bool):
            raise ValueError
        return float(v)
    except (TypeError, ValueError):
        raise SpecrtError(f"sampling_parameters: {key} must be a number, got {quoted(v)}") from None


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise SpecrtError(f"sampling_parameters: {key} must be true or false, got {quoted(v)}")


def _strings(key: str, v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise SpecrtError(f"sampling_parameters: {key} must be a string or a list of strings, got {quoted(v)}")
    return tuple(items)


def _ints(key: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise SpecrtError(f"sampling_parameters: {key} must be a list of integers, got {quoted(v)}")
    return tuple(_int(key, t) for t in v)


FIELDS = {  # vLLM name -> (SamplingParams field, reader)
    "max_tokens": ("max_new_tokens", _int), "temperature": ("temperature", _float), "top_p": ("top_p", _float),
    "top_k": ("top_k", _int), "seed": ("seed", _int), "stop": ("stop_strings", _strings),
    "stop_token_ids": ("stop_token_ids", _ints), "ignore_eos": ("ignore_eos", _bool),
}


def sampling_params(text: str | None, *, max_tokens: int) -> SamplingParams:
    """SamplingParams from a JSON object string (None or empty: the defaults, `max_tokens` new tokens at most)."""
    try:
        given = json.loads(text) if text and text.strip() else {}
    except RecursionError:
        raise SpecrtError("sampling_parameters is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's 4,300 digits
        raise SpecrtError(f"sampling_parameters is not valid JSON: {clipped(str(e))}") from None
    if not isinstance(given, dict):
        raise SpecrtError(f"sampling_parameters must be a JSON object, got {type(given).__name__}")
    fields: dict[str, Any] = {"max_new_tokens": max_tokens}
    for key, value in given.items():
        if key in IGNORED or value is None:
            continue
        if key in NEUTRAL:
            if _float(key, value) != NEUTRAL[key]:
                raise SpecrtError(f"sampling_parameters: specrt does not implement {key} (only {NEUTRAL[key]}), "
                                  f"got {quoted(value)}")
            continue
        if key not in FIELDS:
            raise SpecrtError(f"sampling_parameters: unknown key {quoted(key)}; specrt reads {', '.join(FIELDS)}")
        name, read = FIELDS[key]
        fields[name] = read(key, value)
    if fields.get("top_k") == -1:
        fields["top_k"] = 0
    try:
        return SamplingParams(**fields)
    except SpecrtError as e:  # its messages name the CLI flags; say which request field it was
        raise SpecrtError(f"sampling_parameters: {e}") from None
