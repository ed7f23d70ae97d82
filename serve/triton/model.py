"""specrt's Triton Python model (decoupled): one specrt engine per instance, driven by serve/loop.py's EngineLoop.

    execute(requests) ──► parse inputs ──► EngineLoop.submit ──► loop thread: engine.step() ──► Event
                     └─► bad request: one error response (FINAL); the model keeps serving        │
    sender thread ◄── outbox ◄── on_event ◄─────────────────────────────────────────────────────────┘
        streaming: one response per engine step (text_output, token_ids, drafted), then an empty FINAL
        otherwise: one FINAL response with the whole text (the prompt first, unless exclude_input_in_output)
        cancelled (response_sender.is_cancelled()): aborted in the engine, its slot freed; a CANCELLED error

Inputs and outputs follow Triton's vLLM backend (text_input, stream, sampling_parameters, exclude_input_in_output ->
text_output), so its clients work; `input_ids` is an alternative to text_input, `token_ids` and `drafted` (per token:
an accepted draft, else the target's own token) are extra outputs. This file is copied into the repository by
`specrt triton`; it imports specrt. Triton's stub runs the base interpreter (it ignores PYTHONPATH and virtual
environments), so the environment `specrt triton` ran in, named in `specrt_env.json` beside this file, goes first on
sys.path before anything else is imported (paths that do not exist here, in a container, are skipped: there specrt
must be installed in the stub's own Python). Responses are sent from a thread of their own, so the engine never
waits on Triton's IPC.
"""
from __future__ import annotations

import json
import queue
import site
import sys
import threading
from pathlib import Path


def _add_environment(spec: Path) -> None:
    """Put the site folders `spec` names (processing their .pth files: an editable install's finder) ahead of the
    stub's own, so their numpy and specrt are the ones imported."""
    if not spec.is_file():
        return
    env = json.loads(spec.read_text())
    if tuple(env.get("python", ())) != sys.version_info[:2]:
        return  # another Python's packages cannot load here; the stub's own environment must have specrt
    before = list(sys.path)
    for folder in env.get("site", []):
        if Path(folder).is_dir():
            site.addsitedir(folder)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


_add_environment(Path(__file__).with_name("specrt_env.json"))

import numpy as np  # noqa: E402  (after the environment is in place)
import triton_python_backend_utils as pb_utils  # noqa: E402

from specrt.errors import SpecrtError
from specrt.runtime.backends import own_process_defaults
from specrt.runtime.engine import Engine
from specrt.runtime.prompts import encode_prompt
from specrt.serve.loop import EngineLoop, Event
from specrt.serve.triton.config import engine_settings
from specrt.serve.triton.sampling import sampling_params


class _Stream:
    """One request: where its responses go and what it has produced so far. (A plain class: Triton's stub may load
    this file without registering it in sys.modules, where dataclasses cannot resolve string annotations.)"""

    __slots__ = ("sender", "stream", "prefix", "token_ids", "drafted", "done")

    def __init__(self, sender, stream: bool, prefix: str) -> None:
        self.sender, self.stream = sender, stream
        self.prefix = prefix  # put before the text of a non-streamed response (the prompt, as vLLM does)
        self.token_ids: list[int] = []
        self.drafted: list[bool] = []
        self.done = False


class TritonPythonModel:
    """Triton's entry points: initialize (load the engine), execute (submit requests), finalize (stop the threads)."""

    def initialize(self, args: dict[str, str]) -> None:
        _check_numpy()
        config = json.loads(args["model_config"])
        s = engine_settings({k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()})
        art = Path(args["model_repository"]) / args["model_version"] / s["artifact"]
        if s["engine"].backend == "tensorrt" and args.get("model_instance_kind") == "GPU":
            import torch

            torch.cuda.set_device(int(args.get("model_instance_device_id") or 0))
        self.max_tokens = s["max_tokens"]
        self.metrics = _Metrics(args.get("model_name", "specrt"), args.get("model_instance_name", ""))
        own_process_defaults()  # Triton's Python backend gives each model instance a process of its own
        self.engine = Engine.open(art, s["engine"])
        self.loop = EngineLoop(self.engine)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="specrt-triton-send", daemon=True)
        self._sender.start()

    def execute(self, requests: list) -> None:
        """Queue every request on the engine; a bad one gets its error response now. Responses come later."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as e:  # noqa: BLE001 - a bad request gets an error; the model keeps serving
                message = str(e) if isinstance(e, SpecrtError) else f"{type(e).__name__}: {e}"
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self) -> None:
        """Stop the engine thread and the sender thread; release the engine."""
        self.loop.close()
        self._outbox.put(None)
        self._sender.join(10.0)
        self.engine.close()
        self.metrics.close()

    # -- requests ----------------------------------------------------------------------------------

    def _submit(self, request, sender) -> None:
        stream = _flag(request, "stream")
        exclude = _flag(request, "exclude_input_in_output")
        if stream and exclude is False:
            raise SpecrtError("exclude_input_in_output must not be false when streaming (streamed responses "
                              "never repeat the prompt)")
        text = _text(request)
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids_tensor is None):
            raise SpecrtError("send exactly one of text_input and input_ids")
        if text is not None:
            ids = encode_prompt(self.engine.tokenizer, text)
        else:
            ids = [int(t) for t in ids_tensor.as_numpy().reshape(-1)]
            if not ids:
                raise SpecrtError("input_ids is empty")
        params = sampling_params(_sampling_json(request), max_tokens=self.max_tokens)
        state = _Stream(sender, bool(stream), prefix=text if text is not None and not stream and not exclude else "")
        self.loop.submit(ids, params, lambda event: self._outbox.put((state, event)))  # called on the loop thread

    # -- the sender thread -------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                self._respond(*item)
            except Exception as e:  # noqa: BLE001 - one failed send must not stop the others' responses
                pb_utils.Logger.log_error(f"specrt: sending a response failed: {type(e).__name__}: {e}")

    def _respond(self, state: _Stream, event: Event) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if state.done:
            return
        if event.error is not None:
            state.done = True
            state.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error)), flags=final)
            return
        if state.sender.is_cancelled():
            state.done = True
            self.loop.abort(event.id)
            code = getattr(pb_utils.TritonError, "CANCELLED", None)
            error = pb_utils.TritonError("request cancelled", *(() if code is None else (code,)))
            state.sender.send(pb_utils.InferenceResponse(error=error), flags=final)
            return
        state.token_ids += event.token_ids
        state.drafted += event.drafted
        self.metrics.observe(event.drafted)
        if state.stream:
            if event.token_ids or event.text:
                state.sender.send(_response(event.text, event.token_ids, event.drafted), flags=0)
            if event.finished is not None:
                state.done = True
                state.sender.send(flags=final)
        elif event.finished is not None:
            state.done = True
            state.sender.send(_response(state.prefix + event.finished.text, state.token_ids, state.drafted),
                              flags=final)


STUB = "triton_python_backend_stub"


def _check_numpy() -> None:
    """Refuse to load where the first request would kill the stub: a stub built with pybind11 < 2.12 (no NumPy 2
    support: it names only `numpy.core`, never `numpy._core`) running NumPy >= 2 builds the uint8 view of every BYTES
    input wrongly (each element reads the buffer's first byte), so Triton's deserialize_bytes_tensor reads a
    length like 0x14141414 for a 20-byte prompt and raises inside the stub's C++ (struct.error: unpack_from
    requires a buffer of at least ... bytes), which aborts the stub process."""
    exe = Path("/proc/self/exe")
    if int(np.__version__.split(".")[0]) < 2 or not exe.exists() or exe.resolve().name != STUB:
        return  # NumPy 1, or not in Triton's stub process (a test's stand-in), or not Linux: nothing to check
    if b"numpy._core" not in exe.read_bytes():
        raise SpecrtError(f"numpy {np.__version__} in a Triton Python backend stub built without NumPy 2 support "
                          f"(pybind11 < 2.12): its BYTES inputs would crash the stub on the first request. Serve "
                          f"from an environment with numpy<2 (pip install 'specrt[cpu,triton-server]' pins it; "
                          f"`specrt triton ... --serve` runs from there), or use a Triton release whose stub supports "
                          f"NumPy 2")


class _Metrics:
    """specrt's counters in Triton's own /metrics (the Python backend's custom metrics API, where the stub has it):
    tokens generated, rounds (one target token each: the bonus of a round or an AR step) and accepted drafts, per
    model instance, and τ (tokens per round) as a gauge."""

    def __init__(self, model: str, instance: str) -> None:
        self.tokens = self.rounds = 0
        family = getattr(pb_utils, "MetricFamily", None)
        if family is None:
            self.families = None
            return
        labels = {"model": model, "instance": instance}
        counter, gauge = family.COUNTER, family.GAUGE
        self.families = [family("specrt_generated_tokens_total", "Tokens specrt generated", counter),
                         family("specrt_rounds_total", "Draft/verify rounds (or AR steps) that committed them",
                                counter),
                         family("specrt_accepted_drafts_total", "Generated tokens that were accepted drafts",
                                counter),
                         family("specrt_tau", "Mean tokens committed per round (tau) since the instance started",
                                gauge)]
        self.generated, self.round_count, self.accepted, self.tau = (f.Metric(labels=labels) for f in self.families)

    def close(self) -> None:
        """Metrics go before their families (the backend's rule)."""
        if self.families is not None:
            del self.generated, self.round_count, self.accepted, self.tau
            self.families = None

    def observe(self, drafted: list[bool]) -> None:
        if self.families is None or not drafted:
            return
        accepted = sum(drafted)
        self.tokens += len(drafted)
        self.rounds += len(drafted) - accepted
        self.generated.increment(len(drafted))
        self.round_count.increment(len(drafted) - accepted)
        self.accepted.increment(accepted)
        self.tau.set(self.tokens / max(self.rounds, 1))


def _response(text: str, token_ids: list[int], drafted: list[bool]):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("token_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("drafted", np.array(drafted, dtype=bool))])


def _flag(request, name: str) -> bool | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


def _text(request) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise SpecrtError("text_input is not valid UTF-8") from None


def _sampling_json(request) -> str | None:
    """The sampling_parameters input, else the request's parameters (what the HTTP generate endpoint sends)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    if tensor is not None:
        value = tensor.as_numpy().reshape(-1)[0]
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
    parameters = getattr(request, "parameters", None)
    return parameters() if parameters is not None else None
