"""A request and what the engine keeps of it while it runs: its tokens, its text, when it stops.

    Request         what a caller asks for: prompt token ids, sampling parameters, an id
    Sequence        one request in a slot of the cache: the tokens it holds and has emitted, the draft head's pending
                    context rows, the detokenizer, the stop checks (EOS, stop tokens and strings, the length limit)
    RequestDelta    what one engine step did for one request: new tokens, which of them were accepted drafts, its
                    rounds, new text, and its output if it finished
    RequestOutput   a finished request

The engine's round reads a Sequence through `SlotState` (runtime/host_round.py) and `SlotView` (drafters); only
the engine's commit changes one (`append`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specrt.runtime.drafters import Context
from specrt.runtime.round import Outcome
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: int = 0
    seed_offset: int | None = None  # the sampler is seeded with params.seed + this (None: + id, distinct per request)


@dataclass
class RequestOutput:
    id: int
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "abort"


@dataclass
class RequestDelta:
    """What one step did for one request: new tokens (`drafted[i]`: token i was an accepted draft, else the target's
    own), its rounds as (verify length, drafts accepted, tokens committed), new text, and its output if it
    finished."""

    id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    drafted: list[bool] = field(default_factory=list)
    rounds: list[tuple[int, int, int]] = field(default_factory=list)
    finished: RequestOutput | None = None


class Sequence:
    """One active request: the cache holds `length` tokens; `pending` (the anchor) is committed, not yet written."""

    def __init__(self, request: Request, *, capacity: int, eos_ids: frozenset[int] | set[int],
                 tokenizer: Tokenizer | None, stream: bool) -> None:
        """`capacity`: cache positions; `stream`: detokenize token by token (someone reads the text as it grows, or
        stop strings must be found in it), else once, when the request finishes."""
        self.request = request
        seed, offset = request.params.seed, request.id if request.seed_offset is None else request.seed_offset
        self.rng = np.random.default_rng(None if seed is None else seed + offset)
        self.ids = np.zeros(capacity + 1, np.int64)  # prompt + output token ids
        self.size = len(request.prompt_ids)  # valid entries of `ids`
        self.ids[:self.size] = request.prompt_ids
        self.length = 0
        self.pending = -1
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.ctx: Context | None = None  # target positions the draft head has not seen yet
        self.rounds = 0
        self._eos = eos_ids
        self._tokenizer = tokenizer
        self._stream = (tokenizer.stream_decoder(skip_special_tokens=True)
                        if tokenizer is not None and (stream or request.params.stop_strings) else None)

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def temperature(self) -> float:
        return self.request.params.temperature

    @property
    def budget(self) -> int:
        return self.request.params.max_new_tokens - len(self.output_ids)

    @property
    def streaming(self) -> bool:
        """Whether its text is decoded token by token (else once, at the end)."""
        return self._stream is not None

    def history(self) -> np.ndarray:
        """Prompt + output token ids so far (the anchor last)."""
        return self.ids[:self.size]

    def append(self, tokens: list[int], delta: RequestDelta, *, drafted: int = 0) -> int:
        """Emit tokens until the request finishes (EOS, stop string or token, length); the first `drafted` of them
        are accepted drafts. Returns how many were emitted."""
        params = self.params
        emitted = 0
        for token in tokens:
            self.output_ids.append(token)
            self.ids[self.size] = token
            self.size += 1
            self.pending = token
            delta.token_ids.append(token)
            delta.drafted.append(emitted < drafted)
            emitted += 1
            if self._stream is not None:
                text = self._stream.push([token])
                if text:
                    before = len(self.text)
                    self.text += text
                    for stop in params.stop_strings:
                        cut = self.text.find(stop, max(0, before - len(stop) + 1))
                        if cut >= 0:
                            self.text = self.text[:cut]
                            self.finish_reason = "stop"
                            break
                    delta.text += self.text[before:]
            if self.finish_reason:
                break
            if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
                self.finish_reason = "eos"
            elif len(self.output_ids) >= params.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return emitted

    def commit(self, o: Outcome, delta: RequestDelta, *, keep_rows: bool) -> int:
        """A round's outcome: its accepted drafts and bonus emitted (up to a stop), the cache length moved past them,
        the verified rows kept as the draft head's next context rows (`keep_rows`: where the host holds them).
        Returns the tokens emitted."""
        position, a = self.length, o.verdict.accepted
        committed = self.append(o.tokens, delta, drafted=a)
        if self.finish_reason is None:
            self.length += a + 1
            self.ctx = (Context(pos=position, features=o.features.copy(), next_tokens=np.asarray(o.tokens, np.int64))
                        if keep_rows and o.features is not None else None)
        else:
            self.length += committed
        delta.rounds.append((o.verify_len, a, committed))
        self.rounds += 1
        return committed

    def output(self, reason: str) -> RequestOutput:
        """The request's output, finished for `reason` (the detokenizer's tail flushed, or the text decoded once)."""
        if self._stream is not None and reason not in ("stop", "abort"):
            self.text += self._stream.flush()
        elif self._stream is None and self._tokenizer is not None:  # decoded once: what the deltas add up to
            self.text = self._tokenizer.decode(self.output_ids, skip_special_tokens=True)
            if reason == "abort":  # as a stream stops: without a character still partial
                self.text = self.text.rstrip("\ufffd")
        return RequestOutput(id=self.id, prompt_tokens=len(self.request.prompt_ids), output_ids=self.output_ids,
                             text=self.text, finish_reason=reason)
