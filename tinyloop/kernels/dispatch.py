"""Which implementation runs: Triton kernels on CUDA, the plain torch references on CPU.

TINYLOOP_TRITON   unset/auto  Triton on CUDA tensors when triton imports, torch otherwise (the default)
                  1           force Triton everywhere; on CPU this needs TRITON_INTERPRET=1 (tests use it)
                  0           never Triton: the torch references everywhere

The decision is read from the environment on every call (it is one dict lookup) so tests can flip it
with monkeypatch; `set_mode` overrides the environment for a process (the bench uses it).
"""
from __future__ import annotations

import os

import torch

from ..errors import ConfigError

_override: str | None = None


def set_mode(mode: str | None) -> None:
    """'auto', '1' or '0' for this process; None goes back to the environment."""
    global _override
    if mode is not None and mode not in ("auto", "1", "0"):
        raise ConfigError(f"kernel mode {mode!r} not one of ('auto', '1', '0')")
    _override = mode


def mode() -> str:
    value = _override if _override is not None else os.environ.get("TINYLOOP_TRITON", "").strip() or "auto"
    if value not in ("auto", "1", "0"):
        raise ConfigError(f"environment TINYLOOP_TRITON={value!r} is not one of ('auto', '1', '0')")
    return value


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """True when the Triton kernels should run for tensors on `device`."""
    m = mode()
    if m == "0":
        return False
    if m == "1":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("TINYLOOP_TRITON=1 on CPU needs TRITON_INTERPRET=1 (Triton runs on CPU only interpreted)")
        return True
    return device.type == "cuda" and triton_available()


class lazy_jit:
    """`@lazy_jit` instead of `@triton.jit`: compile on first launch, not at import.

    Triton decides between compiling and interpreting when a kernel is decorated, so decorating lazily lets
    TRITON_INTERPRET be set after tinyloop is imported, and CPU-only users never import triton at all.
    """

    def __init__(self, fn):
        self.fn, self.kernel = fn, None

    def __getitem__(self, grid):
        if self.kernel is None:
            import triton
            self.kernel = triton.jit(self.fn)
        return self.kernel[grid]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
