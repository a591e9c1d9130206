"""The worker's handle registry: live runtime handles under a least-recently-used cap.

A handle is anything a request leaves behind on the worker for a later request (today a
warm-start ResumeHandle). The cap is on the number of live handles, never on memory
pressure: at the cap the least recently used handle is evicted, and a request naming an
evicted handle gets the error "handle_evicted" (not a silent rebuild).

Handle ids are "<worker identity>:<n>", so the broker routes a request naming a handle
to the worker that holds it without keeping a table of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from broker.protocol import Codes


class EngineError(Exception):
    """A request failed in a way the client should hear about; `code` is a protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Remember this many evicted ids, so a late request hears "evicted" rather than "unknown".
EVICTED_MEMORY = 4096


class HandleRegistry:
    def __init__(self, capacity: int, id_prefix: str, on_evict: Callable[[Any], None] | None = None):
        self.capacity = capacity
        self.id_prefix = id_prefix
        self.on_evict = on_evict or (lambda obj: None)
        self.live: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self.evicted: OrderedDict[str, None] = OrderedDict()
        self.next_number = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.live)

    def add(self, obj: Any) -> str:
        if self.capacity <= 0:
            raise EngineError(
                Codes.CONFIG_ERROR, "this worker keeps no handles (its live-handle cap leaves no room); start it with --max-handles"
            )
        while len(self.live) >= self.capacity:
            old_id, old = self.live.popitem(last=False)
            self._remember_evicted(old_id)
            self.evictions += 1
            self.on_evict(old)
        self.next_number += 1
        handle_id = f"{self.id_prefix}:{self.next_number}"
        self.live[handle_id] = obj
        return handle_id

    def get(self, handle_id: str) -> Any:
        obj = self.live.get(handle_id)
        if obj is None:
            if handle_id in self.evicted:
                raise EngineError(
                    Codes.HANDLE_EVICTED,
                    f"handle {handle_id!r} was evicted: the worker's live-handle cap of {self.capacity} was reached "
                    "and it was the least recently used; build it again",
                )
            raise EngineError(Codes.HANDLE_UNKNOWN, f"handle {handle_id!r} does not exist on this worker (never built, or released)")
        self.live.move_to_end(handle_id)
        return obj

    def release(self, handle_id: str) -> None:
        self.get(handle_id)  # same errors as a use
        self.on_evict(self.live.pop(handle_id))

    def _remember_evicted(self, handle_id: str) -> None:
        self.evicted[handle_id] = None
        while len(self.evicted) > EVICTED_MEMORY:
            self.evicted.popitem(last=False)
