"""Model: a loaded looped model plus what serving it needs (tokenizer, the KV block pool, a busy lock)."""
from __future__ import annotations

import itertools
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .artifact import DEFAULT_ARTIFACT, ArtifactInfo, read_artifact
from .gguf import is_gguf, load_gguf, natural_format
from .hf import is_hf_dir, load_hf, with_init_scale
from .cache import BLOCK_TOKENS, CACHE_MODES, BlockPool, KVCache, bytes_per_token_slot, check_mode
from .env import env_bytes, env_choice, env_number
from .errors import BudgetError, BusyError, ConfigError, HandleError
from .fields import is_int
from .kernels import cpu as cpu_kernels
from .formats import DEFAULT_GROUP, QMatrix, check_format, parse_spec
from .memory import available_bytes, blocks_for, release_freed_memory, weight_bytes_of, workspace_bytes
from .model import LoopedLM, quantize_weights, release_linears, shapes_only, weight_bytes, weight_format
from .prefix_tree import PrefixTree

# Without an explicit budget the pool holds this many sequences of max_seq_len at max_loops (or what memory allows).
DEFAULT_POOL_SEQUENCES = 16
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill forward (TINYLOOP_PREFILL_CHUNK)
# Without an explicit budget at most this share of the available memory (free VRAM, available RAM) is planned.
DEFAULT_MEMORY_SHARE = 0.5

_model_ids = itertools.count(1)


class Model:
    """Not reentrant: a second concurrent call raises BusyError instead of racing on the shared cache."""

    def __init__(self, net: LoopedLM, info: ArtifactInfo, cache_mode: str, max_seq_len: int, pool_blocks: int,
                 prefix_caching: bool = False):
        self.net, self.info, self.cfg, self.codec = net, info, info.config, info.codec
        self.cache_mode, self.max_seq_len = cache_mode, max_seq_len
        self.device, self.dtype = net.embed.weight.device, net.embed.weight.dtype
        self.model_id = next(_model_ids)
        self.freed = False
        self._lock = threading.Lock()
        # Every cache of this model draws its blocks from one pool.
        self.pool = BlockPool(self.cfg, cache_mode, pool_blocks, device=self.device, dtype=self.dtype)
        # The model's one engine (a Runner, engine/calls.py's engine_of builds it at first use): every call, the
        # worker's scheduler and the benches run their sequences through it.
        self.engine: Any = None
        # Prompts are prefilled in pieces of this many tokens (0: whole), so the scheduler can interleave a long
        # prompt with decode steps; every call cuts at the same places, so outputs do not depend on the batch.
        self.prefill_chunk: int = env_number("TINYLOOP_PREFILL_CHUNK", int, DEFAULT_PREFILL_CHUNK, 0)
        # The prefix cache holds registered scaffolds (pinned) and, with prefix_caching, every call's prompt blocks:
        # calls then reuse the longest cached token prefix of their prompt (tinyloop/prefix_tree.py).
        self.prefixes = PrefixTree(self.cfg, self.pool)
        self.prefix_caching = prefix_caching

    def new_cache(self, lanes: int, max_len: int) -> KVCache:
        """Block tables for `lanes` sequences of up to max_len tokens (a windowed lane's ring: Executor.attach_ring)."""
        return KVCache(self.cfg, lanes, max_len, self.cache_mode, device=self.device, dtype=self.dtype, pool=self.pool)

    def admit(self, lanes: int, tokens: int, loops: int, window: int = 0, what: str = "the call", now: bool = True
              ) -> None:
        """BudgetError unless `lanes` sequences of `tokens` tokens at `loops` loops fit the pool: never (more blocks
        than the pool has) or, when `now`, not now (blocks held by handles)."""
        need = lanes * blocks_for(self.cfg, tokens, loops, window)
        pool = self.pool
        if need > pool.num_blocks:
            raise BudgetError(f"{what} needs {need} KV blocks ({lanes} x {tokens} tokens at {loops} loops, "
                              f"{need * pool.block_bytes / 2**20:.1f} MiB) but the model's pool has only "
                              f"{pool.num_blocks} ({pool.nbytes / 2**20:.1f} MiB): it can never fit; lower the "
                              f"lanes, beam_size, max_tokens or loops, or load the model with a larger memory_budget")
        if now and need > pool.room():
            raise BudgetError(f"{what} needs {need} KV blocks but only {pool.free_count} of {pool.num_blocks} are "
                              f"free now ({pool.used} held by handles and running sequences): free handles or retry")

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
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
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
        return weight_bytes(self.net)

    @property
    def weights(self) -> str:
        """The weight format the matrices are held in (tinyloop/formats.py)."""
        return weight_format(self.net)

    @property
    def act_quant(self) -> bool:
        """Whether the products quantise their input rows to int8 (int8 / int4 weights; load_model's act_quant)."""
        q = self.net.quantized
        return q is not None and isinstance(q.head, QMatrix) and q.head.act_quant


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pool_blocks_for(cfg, cache_mode: str, dtype: torch.dtype, device: torch.device, max_seq_len: int, weights: int,
                    memory_budget: int | None) -> int:
    """Blocks of the KV pool: (budget - weights - one step's workspace) / block bytes, the null block aside. Without a budget: enough for
    DEFAULT_POOL_SEQUENCES sequences of max_seq_len at max_loops, within DEFAULT_MEMORY_SHARE of available memory."""
    dbytes = torch.tensor([], dtype=dtype).element_size()
    block = BLOCK_TOKENS * bytes_per_token_slot(cfg, cache_mode, dbytes)
    if memory_budget is not None:
        return (memory_budget - weights - workspace_bytes(cfg, max_seq_len, dbytes)) // block - 1
    wanted = DEFAULT_POOL_SEQUENCES * blocks_for(cfg, max_seq_len, cfg.max_loops)
    allowed = (int(available_bytes(device) * DEFAULT_MEMORY_SHARE) - weights) // block - 1
    return min(wanted, allowed)


def load_model(path: str | Path | None = None, max_seq_len: int = 2048, *, device=None, dtype=None,
               cache_mode: str | None = None, memory_budget: int | None = None, prefix_caching: bool | None = None,
               init_scale: float | None = None, weights: str | None = None, group: int | None = None,
               act_quant: bool | None = None) -> Model:
    """Load a .tinyloop artifact (None: the bundled default model), a Hugging Face model directory (Ouro,
    Huginn-0125, Llama; docs/hf.md) or a GGUF file (docs/gguf.md). Raises ArtifactError on a bad file or directory.

    dtype: None keeps bf16 weights in bf16 and runs others in fp32 on CPU, bf16 on CUDA.
    init_scale: multiplies the init_sigma of a random initial state ("normal" state init; Huginn's init_scale, whose
    default is 1.0); 0 gives a zero state, the reference's deterministic init_scale=0.0 output.
    weights: the format every matrix is held and multiplied in (tinyloop/formats.py): fp32, bf16, int8 or int4
    (group: int4's group size, default 32); None: the artifact's own (fp32 unless `tinyloop quantize` wrote it;
    TINYLOOP_WEIGHTS overrides). A quantised artifact loads only in its own format; a GGUF file in any (default: int4
    when its layer matrices are all Q4_0, else fp32, its values exactly).
    act_quant: int8 / int4 products quantise their input rows to int8 per block of 32 and multiply on integers, as
    llama.cpp does (formats.quantize_activations; faster products on the CPU, docs/kernels.md); False: weight-only, the
    activations stay fp32. None: TINYLOOP_ACT_QUANT (on / off), else on for a CPU model, off on CUDA (its Triton
    products are weight-only and memory-bound already).

    memory_budget: bytes for the weights, the KV block pool and one step's workspace together (None: TINYLOOP_MEMORY_BUDGET, else a
    pool for DEFAULT_POOL_SEQUENCES full-length sequences within half the available memory). BudgetError when the
    pool could not hold even one sequence of max_seq_len tokens at the model's default loop count.

    prefix_caching: every call keeps its prompt's blocks in the model's prefix cache and reuses the longest cached
    token prefix of later prompts at the same loop count, until the pool needs the blocks (None: TINYLOOP_PREFIX_CACHE,
    default off in-process; a worker turns it on).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load_model(path={path!r}): expected the path of a .tinyloop artifact or a Hugging Face "
                          f"model directory (str or os.PathLike), or None for the bundled model, got {type(path).__name__}")
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 2:
        raise ConfigError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
    if memory_budget is None:
        memory_budget = env_bytes("TINYLOOP_MEMORY_BUDGET")
    if memory_budget is not None and (not isinstance(memory_budget, int) or isinstance(memory_budget, bool)
                                      or memory_budget <= 0):
        raise ConfigError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if prefix_caching is None:
        prefix_caching = env_choice("TINYLOOP_PREFIX_CACHE", ("on", "off"), "off") == "on"
    cache_mode = cache_mode or env_choice("TINYLOOP_CACHE_MODE", CACHE_MODES, "fp16")
    if cache_mode not in CACHE_MODES:
        raise ConfigError(f"cache_mode {cache_mode!r} not one of {CACHE_MODES}")
    device = check_device(device) if device is not None else default_device()
    if device.type == "cpu":
        cpu_kernels.available()  # build (or find in the cache) the compiled kernels now, not inside the first call
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"load_model(dtype={dtype!r}): expected a torch floating dtype (torch.float32, "
                          "torch.float16 or torch.bfloat16)")
    if is_gguf(path):  # a GGUF file: read in the format asked for (Q4_0 matrices are int4 as they are; tinyloop/gguf.py)
        fmt, group = weight_format_for(path, natural_format(path), weights, group)
        info, tensors = load_gguf(path, fmt, group)
    else:  # a Hugging Face model directory (Ouro, Huginn, Llama) is converted on the fly (tinyloop/hf.py)
        info, tensors = load_hf(path) if is_hf_dir(path) else read_artifact(path or DEFAULT_ARTIFACT)
        fmt, group = weight_format_for(info.path, (info.weights, info.group), weights, group)
    if fmt != "fp32" and dtype is None and device.type == "cpu":
        dtype = torch.float32  # weight-only formats: activations in fp32
    if init_scale is not None:
        info.config = with_init_scale(info.config, init_scale)
    if dtype is None:  # bf16 weights stay bf16; others run in bf16 on CUDA and fp32 on CPU (fp16 matmuls are slow there)
        stored = next(iter(tensors.values())).dtype
        dtype = stored if stored == torch.bfloat16 else torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = info.config
    check_mode(cfg, cache_mode)
    held = weight_bytes_of(cfg, dtype, fmt, group)
    blocks = pool_blocks_for(cfg, cache_mode, dtype, device, max_seq_len, held, memory_budget)
    need = blocks_for(cfg, max_seq_len, cfg.default_loops)
    if blocks < need:
        have = "memory_budget" if memory_budget is not None else "available memory"
        raise BudgetError(f"max_seq_len {max_seq_len} does not fit: one sequence of that length at "
                          f"{cfg.default_loops} loops needs {need} KV blocks, the {have} leaves room for "
                          f"{max(blocks, 0)} after {held / 2**20:.1f} MiB of weights; lower max_seq_len or raise "
                          f"memory_budget")
    with shapes_only():  # no random init of weights about to be replaced (seconds and GBs for real models)
        net = LoopedLM(cfg, max_seq_len=1)
    # assign: the loaded tensors become the parameters, so a bf16 checkpoint is held once, not widened and copied
    net.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=info.matrices is None, assign=True)
    del tensors
    if info.matrices is not None:  # a quantised artifact: its linear layers have no weights of their own
        release_linears(net)
    net.set_max_seq_len(max_seq_len)  # position tables on the weights' device and dtype
    net = net.to(device=device).eval().requires_grad_(False)
    net.set_max_seq_len(max_seq_len)  # rebuilt on the final device
    mats = None if info.matrices is None else {k: m.to(device) for k, m in info.matrices.items()}
    info.matrices = None
    if act_quant is None:
        act_quant = env_choice("TINYLOOP_ACT_QUANT", ("on", "off"), "on" if device.type == "cpu" else "off") == "on"
    quantize_weights(net, fmt, group, mats, act_quant=bool(act_quant))
    release_freed_memory(device)  # the fp32 matrices just released
    return Model(net, info, cache_mode, max_seq_len, blocks, bool(prefix_caching))


def weight_format_for(path, stored: tuple[str, int], weights: str | None, group: int | None) -> tuple[str, int]:
    """load_model's weight format and int4 group for a model stored as `stored` (format, group): asked for, else
    TINYLOOP_WEIGHTS, else the stored one. A worker plans its memory with the same answer before it loads."""
    spec = os.environ.get("TINYLOOP_WEIGHTS", "").strip()
    if weights is None and spec:
        weights, env_group = parse_spec(spec)
        group = group or env_group
    stored_weights, stored_group = stored
    weights = weights or stored_weights
    group = group or stored_group or DEFAULT_GROUP
    check_format(weights, group)
    if stored_weights != "fp32" and not is_gguf(path) and (weights != stored_weights or group != (stored_group or group)):
        raise ConfigError(f"{path} holds {stored_weights} weights" + (f" (group {stored_group})" if stored_group else "")
                          + f"; it loads only as such (asked: {weights}). Quantise the fp32 artifact instead")
    return weights, group


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
        if model.engine is not None:
            model.engine.cache.reset()
        # a freed model holds nothing: every later use raises HandleError first (Model checks `freed`)
        model.prefixes = None  # type: ignore[assignment]
        model.net = None  # type: ignore[assignment]
        model.engine = None
        model.pool = None  # type: ignore[assignment]
