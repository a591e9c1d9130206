"""plan_memory: what serving a model costs, item by item, before anything is allocated.

Memory is weights plus one KV block pool (tinyloop/cache.py); every cache draws blocks from the pool. A plan
sizes the pool for `lanes` sequences of `max_seq_len` tokens at `loops` loops plus `max_handles` handles of
`handle_tokens` tokens, and says how many sequences of a length and loop count that pool holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .cache import BLOCK_TOKENS, bytes_per_token_slot
from .config import ModelConfig
from .errors import BudgetError


def blocks_for(cfg: ModelConfig, tokens: int, loops: int, window: int = 0) -> int:
    """Blocks one sequence of `tokens` tokens at `loops` loops holds (a window bounds the cells per slot)."""
    cells = min(tokens, window) if window else tokens
    return cfg.n_slots(loops) * -(-cells // BLOCK_TOKENS)


def handle_state_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Tensors a handle keeps beside its blocks: at most e and s per token (ResumeHandle) plus one row of logits
    (PrefixCache)."""
    return tokens * 2 * cfg.d_model * dtype_bytes + cfg.vocab_size * dtype_bytes


@dataclass
class MemoryPlan:
    items: list[tuple[str, int]] = field(default_factory=list)
    cfg: ModelConfig | None = None
    pool_blocks: int = 0
    block_bytes: int = 0
    per_handle_bytes: int = 0  # the most one handle of the planned length holds (its blocks and states)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.items)

    def bytes_of(self, name: str) -> int:
        return sum(b for n, b in self.items if n.startswith(name))

    def holds(self, tokens: int, loops: int) -> int:
        """How many sequences of `tokens` tokens at `loops` loops the pool holds at once."""
        assert self.cfg is not None  # (a plan of a model: plan_memory)
        return self.pool_blocks // blocks_for(self.cfg, tokens, loops)

    def table(self) -> str:
        rows = [f"  {name:<66} {b / 2**20:>10.2f} MiB" for name, b in self.items]
        rows.append(f"  {'total':<66} {self.total_bytes / 2**20:>10.2f} MiB")
        return "\n".join(rows)

    def check(self, budget_bytes: int, what: str = "budget") -> None:
        if self.total_bytes > budget_bytes:
            raise BudgetError(f"memory plan {self.total_bytes / 2**20:.1f} MiB exceeds the {what} of "
                              f"{budget_bytes / 2**20:.1f} MiB:\n{self.table()}")


WORKSPACE_LANES = 4  # the gathered keys and values of this many full-length lanes are set aside
READ_AHEAD_BYTES = 32 * 2**20  # the most a decode step's read-ahead buffer holds (engine/forward.py: Cached.read_ahead)
READ_AHEAD_GROWTH = 1  # blocks of room per lane and slot in that buffer: it is gathered again every 16 tokens


def workspace_bytes(cfg: ModelConfig, max_seq_len: int, dtype_bytes: int) -> int:
    """Transient tensors of one step: a prefill chunk of max_seq_len tokens (hidden states, q/k/v, the MLP's
    intermediates, a row of logits per position) plus the keys and values one layer gathers for WORKSPACE_LANES
    full-length lanes (twice: the stored form and the attention's copy) and a decode step's read-ahead buffer,
    doubled for what the allocator keeps of freed tensors (measured by tests/test_engine.py under a load that
    fills the pool). load_model sets it aside."""
    chunk = max_seq_len * (4 * cfg.d_model + 2 * cfg.kv_dim + 3 * cfg.ffn_hidden + cfg.vocab_size) * dtype_bytes
    gathered = 2 * WORKSPACE_LANES * max_seq_len * 2 * cfg.kv_dim * dtype_bytes
    return 2 * (chunk + gathered + READ_AHEAD_BYTES)


def weight_bytes_of(cfg: ModelConfig, dtype: torch.dtype, fmt: str = "fp32", group: int = 32) -> int:
    """Bytes of a model's weights: parameters in `dtype`, the matrices in weight format fmt (tinyloop/formats.py)."""
    from .model import LoopedLM, quantize_weights, shapes_only, weight_bytes  # the model layer sits beside this one
    with shapes_only():
        net = LoopedLM(cfg, max_seq_len=1).to(dtype)
        quantize_weights(net, fmt, group)
        return weight_bytes(net)


def plan_memory(model, max_seq_len: int | None = None, cache_mode: str | None = None, lanes: int = 1,
                max_handles: int = 0, handle_tokens: int | None = None, dtype: torch.dtype | None = None,
                loops: int | None = None, weights: str = "fp32", group: int = 32) -> MemoryPlan:
    """Itemise weights and the KV block pool for a Model (or a ModelConfig with explicit values).

    pool = (lanes x blocks of one max_seq_len sequence at `loops` (default max_loops)
            + max_handles x blocks of a handle_tokens prefix at max_loops + 1 null block) x block bytes
    handle states = max_handles x (e and s per token + one row of logits), kept beside a handle's blocks.
    weights / group: a ModelConfig's weight format (tinyloop/formats.py); a Model counts what it holds.
    workspace = the transient tensors of one step (workspace_bytes).
    """
    if isinstance(model, ModelConfig):
        cfg, fmt = model, weights
        max_seq_len, cache_mode = max_seq_len or 2048, cache_mode or "fp16"
        dtype = dtype or torch.float32
        held_bytes = weight_bytes_of(cfg, dtype, fmt, group)
    else:
        cfg, fmt, held_bytes = model.cfg, model.weights, model.weight_bytes()
        max_seq_len, cache_mode, dtype = max_seq_len or model.max_seq_len, cache_mode or model.cache_mode, dtype or model.dtype
    dbytes = torch.tensor([], dtype=dtype).element_size()
    loops = loops or cfg.max_loops
    block = BLOCK_TOKENS * bytes_per_token_slot(cfg, cache_mode, dbytes)
    seq_blocks = blocks_for(cfg, max_seq_len, loops)
    tokens = handle_tokens or max_seq_len
    handle_blocks = blocks_for(cfg, tokens, cfg.max_loops)
    blocks = lanes * seq_blocks + max_handles * handle_blocks
    what = f"{lanes} x {max_seq_len} tok at {loops} loops"
    if max_handles:
        what += f" + {max_handles} handles x {tokens} tok"
    held = str(dtype).replace("torch.", "") if fmt == "fp32" else f"{fmt} matrices"
    plan = MemoryPlan([(f"weights ({held})", held_bytes),
                       (f"KV block pool ({blocks} blocks x {block // 1024} KiB, {cache_mode}: {what})",
                        (blocks + 1) * block)], cfg, blocks, block)
    plan.items.append(("workspace (one step's activations)", workspace_bytes(cfg, max_seq_len, dbytes)))
    plan.per_handle_bytes = handle_blocks * block + handle_state_bytes(cfg, tokens, dbytes)
    if max_handles:
        plan.items.append((f"handle states ({max_handles} x {tokens} tok)",
                           max_handles * handle_state_bytes(cfg, tokens, dbytes)))
    return plan


def available_bytes(device: torch.device | str) -> int:
    """Free VRAM on a CUDA device, MemAvailable on CPU (available_what names which)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


CUDA_CONTEXT_BYTES = 512 * 2**20  # a CUDA context's device memory where NVML cannot measure it (several hundred MiB)


def process_bytes(device: torch.device | str) -> int:
    """What this process holds before a model: its resident memory on CPU (the interpreter, torch and the runtime:
    `import torch` alone is ~280 MiB); on a CUDA device its context (kernels, cuBLAS workspace) and the allocator's
    reserve, as NVML reports this process's use of the device, else the reserve plus CUDA_CONTEXT_BYTES. A budget
    that is everything a worker may use counts it (workers/startup.py)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.init()  # the context exists from here on: what it takes is part of the process
        reserved = int(torch.cuda.memory_reserved(device))
        return max(reserved, cuda_process_bytes(device) or reserved + CUDA_CONTEXT_BYTES)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def cuda_process_bytes(device: torch.device) -> int | None:
    """This process's memory on a CUDA device as NVML (nvidia-ml-py, where installed) reports it; None without it."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index if device.index is not None else
                                                   torch.cuda.current_device())
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        return int(mine[0]) if mine and mine[0] else None
    except pynvml.NVMLError:
        return None


def baseline_what(device: torch.device | str) -> str:
    """What process_bytes counts on this device, for the plan's line."""
    if torch.device(device).type != "cuda":
        return "interpreter, torch, runtime"
    measured = cuda_process_bytes(torch.device(device)) is not None
    return "CUDA context and allocator reserve" + ("" if measured else f", the context estimated at "
                                                   f"{CUDA_CONTEXT_BYTES // 2**20} MiB without NVML")


def available_what(device: torch.device | str) -> str:
    """What available_bytes measures on this device, for messages."""
    return f"free VRAM on {device}" if torch.device(device).type == "cuda" else "available RAM"


def _libc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_malloc_trim = _libc_trim()


def release_freed_memory(device: torch.device) -> None:
    """Hand freed heap memory back to the OS (glibc malloc_trim) after a large transient on CPU, such as a long
    prompt's prefill. glibc raises its mmap threshold to the size of the largest block freed, so later tensors of
    that size come from the heap and stay resident after they are freed: without this, RSS under a load of long
    prompts grows well past the pool and workspace the budget set aside (measured by `tinyloop bench engine`)."""
    if device.type == "cpu" and _malloc_trim is not None:
        _malloc_trim(0)
