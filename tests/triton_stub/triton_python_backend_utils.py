"""A stand-in for Triton's `triton_python_backend_utils`: only the transport (tensors, responses, senders).

Enough of the Python backend's API for serve/triton/model.py to run outside tritonserver, injected as
sys.modules["triton_python_backend_utils"] by the test; the engine behind it is the real one.
"""
from __future__ import annotations

import threading

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Records (response, flags) pairs; `cancel()` plays a client going away; `wait()` blocks until FINAL."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancel_after = cancel_after  # the client goes away once this many responses arrived
        self._cancelled = False
        self._final = threading.Event()
        self.first = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._final.is_set():
            raise RuntimeError("a response was sent after the final flag")
        self.sent.append((response, flags))
        self.first.set()
        if self.cancel_after is not None and len(self.sent) >= self.cancel_after:
            self._cancelled = True
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._final.set()

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def wait(self, timeout: float = 60.0) -> list[tuple[InferenceResponse | None, int]]:
        if not self._final.wait(timeout):
            raise TimeoutError("no final response")
        return self.sent


class InferenceRequest:
    """A request as the model sees it: named input arrays, request parameters (JSON), one response sender."""

    def __init__(self, inputs: dict[str, np.ndarray], parameters: str = "{}", cancel_after: int | None = None) -> None:
        self._inputs = {k: Tensor(k, v) for k, v in inputs.items()}
        self._parameters = parameters
        self.sender = ResponseSender(cancel_after)

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> ResponseSender:
        return self.sender


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request._inputs.get(name)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


class Logger:
    messages: list[str] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.messages.append(message)

    log_warn = log_error = log_verbose = log_info
