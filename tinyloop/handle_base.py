"""What PrefixCache, PrefixPool and ResumeHandle share: a binding to the model that built them, a busy lock, their
bytes (blocks of the model's pool, and the tensors kept beside them), and the engine steps that build them
(`prefill_by_steps`).

The handles themselves live in prefix.py (PrefixCache, PrefixPool) and resume.py (ResumeHandle).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .cache import KVCache
from .engine import forward as paged
from .engine.calls import engine
from .engine.sequence import Sequence
from .errors import BusyError, ConfigError, HandleError
from .loader import Model
from .request import GenerateConfig


def tensor_bytes(*groups) -> int:
    """Bytes of every tensor in the given tensors, dicts of tensors and lists of them."""
    total = 0
    for g in groups:
        if g is None:
            continue
        if isinstance(g, torch.Tensor):
            total += g.numel() * g.element_size()
        elif isinstance(g, dict):
            total += tensor_bytes(*g.values())
        else:
            total += tensor_bytes(*g)
    return total


class Handle(ABC):
    """Bound to the model that built it (model_id); not reentrant (a second concurrent call raises BusyError)."""

    kind = "handle"

    def __init__(self, model: Model):
        self.model, self.model_id = model, model.model_id
        self.freed = False
        self._lock = threading.Lock()

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensors the handle holds (every concrete handle says what it keeps)."""

    def release(self) -> None:
        """Drop the tensors the handle holds (free_handle)."""

    def check(self, model: Model) -> None:
        if self.freed:
            raise HandleError(f"{self.kind} has been freed (free_handle) and cannot be used")
        if model.model_id != self.model_id:
            raise HandleError(f"{self.kind} was built by model {self.model_id} and cannot be used with model "
                              f"{model.model_id} (a handle is bound to the model that built it)")
        if model.freed or self.model.freed:
            raise HandleError(f"{self.kind}: its model has been freed (free_model); the handle is no longer usable")

    @contextmanager
    def using(self, model: Model) -> Iterator[None]:
        """Hold this handle and the model for one call."""
        with self.held(model), model.busy():
            yield

    @contextmanager
    def held(self, model: Model) -> Iterator[None]:
        """Hold this handle (not the model: a scheduler's step holds it) while something reads it."""
        self.check(model)
        if not self._lock.acquire(blocking=False):
            raise BusyError(f"{self.kind} is already in use by another call (handles are not reentrant; "
                            "serialise calls on one handle)")
        try:
            yield
        finally:
            self._lock.release()


def free_handle(handle: Handle) -> None:
    """Release what a PrefixCache, ResumeHandle or PrefixPool holds; later use raises HandleError."""
    if not isinstance(handle, Handle):
        raise HandleError(f"free_handle expects a PrefixCache, PrefixPool or ResumeHandle, got {type(handle).__name__}")
    if handle.freed:
        return
    if not handle._lock.acquire(blocking=False):
        raise BusyError(f"{handle.kind} is in use by another call and cannot be freed now")
    try:
        handle.release()
        handle.freed = True
    finally:
        handle._lock.release()


def prefill_by_steps(model: Model, ids: list[int], loops: int, keep: Callable[[KVCache], object], *,
                     window: int = 0, latent: paged.Latent | None = None, what: str = "prefix") -> torch.Tensor:
    """Prefill ids once, by steps of the engine (their blocks taken in Scheduler.schedule, as every step's): the
    prefill of a one-token request whose prompt is ids, every one of `loops` loops, in the pieces generate's prefill
    runs (with a cache window: one piece, in a ring of that window). keep(lane) takes what it wants of the lane's
    blocks once the prompt is in, before they go back. With `latent` ([1, len(ids), d] each), every prompt token's
    latent rows are written into it: e, the prelude's output, and s, the state after `loops` loops. Returns the last
    position's logits [1, V]."""
    cfg = GenerateConfig(max_tokens=1, loops=loops, early_exit_threshold=0.0, cache_window=window)
    kept: list[torch.Tensor] = []
    seq = Sequence(model, ids, cfg)
    if latent is not None:
        seq.latents = {}

    def prefilled(lane: KVCache, logits: torch.Tensor) -> None:
        keep(lane)
        kept.append(logits.reshape(1, -1).clone())
        if latent is not None:
            assert seq.latents is not None  # (asked above)
            for a, (e, s) in seq.latents.items():
                latent.e[:, a:a + e.shape[1]].copy_(e)
                latent.s[:, a:a + s.shape[1]].copy_(s)

    seq.on_prefilled = prefilled
    # a windowed prompt goes in as one piece (what ResumeHandle.pieces cuts, so a deepening runs the same pieces)
    seq.whole_prompt = bool(window)
    seq.prefix_cache = None  # (its own forwards: nothing of the automatic prefix cache is reused)
    with engine(model, [ids], [cfg], what=what) as (runner, client):
        runner.run([seq], client=client)
    return kept[0]


def encode_tokens(model: Model, text_or_ids, what: str, allow_empty: bool = False) -> list[int]:
    """Token ids of a prompt piece; a suffix may be empty (the prefix alone is the prompt)."""
    if allow_empty and (text_or_ids == "" or (isinstance(text_or_ids, (list, tuple)) and len(text_or_ids) == 0)):
        return []
    try:
        return model.encode_prompt(text_or_ids)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None
