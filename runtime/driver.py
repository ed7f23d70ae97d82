"""One thread at a time drives an engine: a second one gets a clear error instead of corrupting its slots and queue
half-way through a round. The driving thread may call in again (generate's callbacks, generate -> step)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from specrt.errors import SpecrtError


class OneDriver:
    def __init__(self) -> None:
        self.closed = False  # the engine takes no more calls
        self._lock = threading.Lock()  # held by the driving thread
        self._user: int | None = None  # that thread

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.closed:
            raise SpecrtError("this engine is closed")
        me = threading.get_ident()
        if self._user == me:
            yield
            return
        if not self._lock.acquire(blocking=False):
            raise SpecrtError("this Engine is in use by another thread: an Engine is driven by one thread at a time; "
                              "to serve requests from several threads, share it through "
                              "specrt.serve.loop.EngineLoop (submit and abort are thread-safe)")
        self._user = me
        try:
            yield
        finally:
            self._user = None
            self._lock.release()
