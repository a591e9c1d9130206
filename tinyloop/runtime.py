"""Model: a loaded looped model plus what serving it needs (tokenizer, decode cache, a busy lock)."""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from .artifact import DEFAULT_ARTIFACT, ArtifactInfo, read_artifact
from .cache import CACHE_MODES, KVCache
from .env import env_choice
from .errors import BusyError, ConfigError, HandleError
from .model import LoopedLM

_model_ids = itertools.count(1)


class Model:
    """Not reentrant: a second concurrent call raises BusyError instead of racing on the shared cache."""

    def __init__(self, net: LoopedLM, info: ArtifactInfo, cache_mode: str, max_seq_len: int):
        self.net, self.info, self.cfg, self.codec = net, info, info.config, info.codec
        self.cache_mode, self.max_seq_len = cache_mode, max_seq_len
        self.device, self.dtype = net.embed.weight.device, net.embed.weight.dtype
        self.model_id = next(_model_ids)
        self.freed = False
        self._lock = threading.Lock()
        # One lane of decode cache for the longest sequence, allocated once (plan_memory counts it).
        self.decode_cache = KVCache(self.cfg, 1, max_seq_len, cache_mode, device=self.device, dtype=self.dtype)

    @property
    def eos_id(self) -> int:
        return self.cfg.eos_id

    def check_alive(self) -> None:
        if self.freed:
            raise HandleError("model has been freed (free_model) and cannot be used")

    @contextmanager
    def busy(self):
        self.check_alive()
        if not self._lock.acquire(blocking=False):
            raise BusyError("model is already running a call in another thread (a Model is not reentrant; "
                            "use one model per worker or serialise calls)")
        try:
            yield
        finally:
            self._lock.release()

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ConfigError(f"prompt: token id(s) {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        else:
            raise ConfigError("prompt must be a string or a list of token ids")
        if not ids:
            raise ConfigError("prompt is empty")
        return ids

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.net.parameters())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path: str | Path | None = None, max_seq_len: int = 2048, *, device=None, dtype=None,
               cache_mode: str | None = None) -> Model:
    """Load a .tinyloop artifact (None: the bundled default model). Raises ArtifactError on a bad file."""
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
    cache_mode = cache_mode or env_choice("TINYLOOP_CACHE_MODE", CACHE_MODES, "fp16")
    if cache_mode not in CACHE_MODES:
        raise ConfigError(f"cache_mode {cache_mode!r} not one of {CACHE_MODES}")
    device = check_device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"load_model(dtype={dtype!r}): expected a torch floating dtype (torch.float32, "
                          "torch.float16 or torch.bfloat16)")
    info, tensors = read_artifact(path or DEFAULT_ARTIFACT)
    net = LoopedLM(info.config, max_seq_len=max_seq_len)
    net.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    net = net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    net.set_max_seq_len(max_seq_len)  # rebuild position tables in the final dtype and device
    net.to(device)
    return Model(net, info, cache_mode, max_seq_len)


def check_device(device) -> torch.device:
    """load_model's `device` as a torch.device; ConfigError naming the argument when it cannot be used here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"load_model(device={device!r}): not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"load_model(device={device!r}): CUDA is not available on this machine; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"load_model(device={device!r}): this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"load_model(device={device!r}): TinyLoop runs on 'cpu' or 'cuda'")
    return dev


def free_model(model: Model) -> None:
    """Release the weights and caches; every later use of the model or its handles raises HandleError.
    Freeing a freed model does nothing (like free_handle)."""
    if model.freed:
        return
    with model.busy():
        model.freed = True
        model.net = None
        model.decode_cache = None
