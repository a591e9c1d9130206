"""Prefix reuse: a PrefixCache keeps a prefix's prefill (its KV entries at every slot it used), so a prompt
that starts with it only prefills its own suffix. A PrefixPool holds several, finds the longest registered
prefix of a prompt through hashes of token blocks, and evicts the least recently used at capacity.

Exactness: the cache holds the very entries `generate` would write for those positions (at loop k a token
only sees loop-k entries of earlier tokens), so greedy output equals `generate` on prefix + suffix.
A prefix cache is built at one loop count and serves only calls at that count: its coda entries come from
the prefix's state after exactly n_loops loops.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .cache import Span
from .engine.calls import checked, lanes
from .engine.runner import Runner
from .engine.sequence import Sequence
from .errors import ConfigError, HandleError
from .kernels import step as cached
from .handles import Handle, encode_tokens, tensor_bytes
from .runtime import Model
from .types import GenerateConfig, GenerateResult, OnToken

BLOCK = 16  # tokens per hashed block in a PrefixPool


def _check_loops(model: Model, n_loops) -> int:
    if not isinstance(n_loops, int) or isinstance(n_loops, bool) or not 1 <= n_loops <= model.cfg.max_loops:
        raise ConfigError(f"n_loops must be an integer in 1..{model.cfg.max_loops}, got {n_loops!r}")
    return n_loops


class PrefixCache(Handle):
    """The KV entries of `ids` (positions 0..len-1) at the slots a forward of n_loops loops writes, plus the
    last position's logits (so a prompt that is exactly the prefix needs no forward at all)."""

    kind = "PrefixCache"

    def __init__(self, model: Model, ids: list[int], n_loops: int):
        super().__init__(model)
        self.ids, self.n_loops = ids, n_loops
        cfg = model.cfg
        # prelude + loops 0..n-1, then the coda
        self.slots = [*range(cfg.n_prelude + cfg.n_core * n_loops), *range(cfg.coda_slot(0), cfg.n_slots())]
        self.span: Span | None = None
        self.logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return (self.span.nbytes if self.span is not None else 0) + tensor_bytes(self.logits)

    def release(self) -> None:
        if self.span is not None:
            self.span.release()
        self.span, self.logits = None, None

    @torch.inference_mode()
    def fill(self) -> None:
        """Prefill the prefix once (all n_loops loops over the whole chunk, as generate does) and keep its blocks."""
        model, net, T = self.model, self.model.net, len(self.ids)
        model.admit(1, T, self.n_loops, what=f"a {T}-token prefix")
        cache = model.decode_cache
        cache.reset()
        try:
            x = torch.tensor([self.ids], device=model.device)
            step = net.make_step(torch.arange(T, device=model.device).unsqueeze(0), T)
            self.logits = cached.forward(net, x, self.n_loops, step, cache)[0, -1:].clone()
            self.span = cache.share(self.slots, T)
        finally:
            cache.reset()

    def restore(self, cache) -> None:
        cache.adopt(self.span)  # shared blocks: the suffix's first write into the last one copies it


def create_prefix_cache(model: Model, prefix, n_loops: int) -> PrefixCache:
    """Prefill `prefix` (string or token ids) at n_loops loops and keep its cache entries."""
    n_loops = _check_loops(model, n_loops)
    ids = encode_tokens(model, prefix, "prefix")
    if len(ids) >= model.max_seq_len:
        raise ConfigError(f"prefix length {len(ids)} must be below max_seq_len {model.max_seq_len}")
    pc = PrefixCache(model, ids, n_loops)
    with model.busy():
        pc.fill()
    return pc


def _generate_from(model: Model, pc: PrefixCache | None, ids: list[int], cfg: GenerateConfig,
                   on_token: OnToken | None) -> GenerateResult:
    """Generate from ids whose first len(pc) tokens are pc's prefix (pc None: plain prefill). Model is held."""
    with lanes(model, [ids], [cfg]) as cache:
        seq = Sequence(model, ids, cfg, on_token)
        runner = Runner(model, cache, seq.loops, cfg.early_exit_threshold)
        if pc is None or (len(ids) == 1 and runner.adaptive):
            # generate runs a one-token prompt adaptively; reuse would not match it, so prefill plainly
            return runner.run([seq])[0]

        def first(seq: Sequence) -> torch.Tensor:
            pc.restore(cache)  # here, so lending the blocks counts in stats.prefill_ms
            rest = ids[len(pc):]
            return pc.logits[-1] if not rest else runner.prefill(rest, len(pc))[-1]  # all loops, as generate's prefill

        seq.stats.prefix_hit_tokens = len(pc)
        return runner.run([seq], cached=len(pc), first=first)[0]


def _check_call(model: Model, cfg: GenerateConfig | None, n_loops: int | None) -> GenerateConfig:
    cfg = checked(model, cfg, "prefix")
    if n_loops is not None and cfg.resolved_loops(model) != n_loops:
        raise ConfigError(f"GenerateConfig.loops must equal the prefix cache's n_loops {n_loops} "
                          f"(a prefix cache serves only the loop count it was built at), got {cfg.resolved_loops(model)}")
    return cfg


def generate_from_prefix_cache(model: Model, cache: PrefixCache, suffix, cfg: GenerateConfig | None = None,
                               on_token: OnToken | None = None) -> GenerateResult:
    """Generate from cache's prefix + suffix (string or ids; may be empty). Equals generate on the joined ids."""
    if not isinstance(cache, PrefixCache):
        raise HandleError(f"expected a PrefixCache, got {type(cache).__name__}")
    cache.check(model)
    cfg = _check_call(model, cfg, cache.n_loops)
    ids = cache.ids + encode_tokens(model, suffix, "suffix", allow_empty=True)
    with cache.using(model):
        return _generate_from(model, cache, ids, cfg, on_token)


# --- the pool ------------------------------------------------------------------------------------------
@dataclass
class PoolStats:
    capacity: int
    entries: int
    hits: int
    misses: int
    evictions: int
    bytes: int
    hit_tokens: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def block_hashes(ids: list[int]) -> list[int]:
    """h[i] identifies ids[:i * BLOCK]: each block's hash chains the one before, so equal hashes mean equal
    prefixes (up to collisions, which a token comparison rules out)."""
    hs = [0]
    for i in range(len(ids) // BLOCK):
        hs.append(hash((hs[-1], tuple(ids[i * BLOCK:(i + 1) * BLOCK]))))
    return hs


class PrefixPool(Handle):
    """Up to `capacity` PrefixCaches. An entry is indexed by the hash of its whole blocks; a lookup walks the
    prompt's block hashes from the longest down, so the first verified match is the longest prefix."""

    kind = "PrefixPool"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.model, self.model_id = None, None  # bound on the first register_prefix
        self.freed = False
        self._lock = threading.Lock()
        self.entries: OrderedDict[tuple, PrefixCache] = OrderedDict()  # least recently used first
        self.index: dict[int, set[tuple]] = {}
        self.hits = self.misses = self.evictions = self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(pc.nbytes for pc in self.entries.values())

    @property
    def stats(self) -> PoolStats:
        return PoolStats(self.capacity, len(self.entries), self.hits, self.misses, self.evictions, self.nbytes,
                         self.hit_tokens)

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, model: Model) -> None:
        if self.model is None and not self.freed:
            model.check_alive()
            return
        super().check(model)

    def release(self) -> None:
        for pc in self.entries.values():
            pc.release()
            pc.freed = True
        self.entries.clear()
        self.index.clear()

    def _key_hash(self, key: tuple) -> int:
        ids = key[0]
        return block_hashes(list(ids))[len(ids) // BLOCK]

    def drop(self, key: tuple) -> None:
        pc = self.entries.pop(key)
        self.index[self._key_hash(key)].discard(key)
        pc.release()
        pc.freed = True

    def add(self, pc: PrefixCache) -> None:
        key = (tuple(pc.ids), pc.n_loops)
        while len(self.entries) >= self.capacity:
            self.drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = pc
        self.index.setdefault(self._key_hash(key), set()).add(key)

    def lookup(self, ids: list[int], n_loops: int) -> PrefixCache | None:
        """The longest registered prefix of ids at n_loops loops (marked most recently used), or None."""
        for key in [k for k, pc in self.entries.items() if pc.freed]:  # entries freed by free_handle
            self.drop(key)
        hs = block_hashes(ids)
        for i in range(len(hs) - 1, -1, -1):
            best = None
            for key in self.index.get(hs[i], ()):
                n = len(key[0])
                if key[1] == n_loops and n <= len(ids) and (best is None or n > len(best[0])) and tuple(ids[:n]) == key[0]:
                    best = key
            if best is not None:
                self.entries.move_to_end(best)
                return self.entries[best]
        return None


def create_prefix_pool(capacity: int) -> PrefixPool:
    """An empty pool of at most `capacity` prefix caches (least recently used evicted first)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigError(f"PrefixPool capacity must be an integer >= 1, got {capacity!r}")
    return PrefixPool(capacity)


def register_prefix(pool: PrefixPool, model: Model, prefix, n_loops: int) -> PrefixCache:
    """Prefill `prefix` at n_loops loops into the pool (a known prefix is only marked as recently used)."""
    if not isinstance(pool, PrefixPool):
        raise HandleError(f"expected a PrefixPool, got {type(pool).__name__}")
    n_loops = _check_loops(model, n_loops)
    ids = encode_tokens(model, prefix, "prefix")
    if len(ids) >= model.max_seq_len:
        raise ConfigError(f"prefix length {len(ids)} must be below max_seq_len {model.max_seq_len}")
    pool.check(model)
    with pool.using(model):
        if pool.model is None:
            pool.model, pool.model_id = model, model.model_id
        key = (tuple(ids), n_loops)
        if key in pool.entries:
            pool.entries.move_to_end(key)
            return pool.entries[key]
        pc = PrefixCache(model, ids, n_loops)
        pc.fill()
        pool.add(pc)
        return pc


def generate_with_pool(model: Model, pool: PrefixPool, prompt, cfg: GenerateConfig | None = None,
                       on_token: OnToken | None = None) -> GenerateResult:
    """Generate from prompt, skipping the prefill of the longest registered prefix it starts with (same
    loop count); no match is a plain prefill. Output equals generate(model, prompt, cfg)."""
    if not isinstance(pool, PrefixPool):
        raise HandleError(f"expected a PrefixPool, got {type(pool).__name__}")
    pool.check(model)
    cfg = _check_call(model, cfg, None)
    ids = model.encode_prompt(prompt)
    with pool.using(model):
        out = _generate_from(model, pool.lookup(ids, cfg.resolved_loops(model)), ids, cfg, on_token)
        hit = out.stats.prefix_hit_tokens
        pool.hits, pool.misses, pool.hit_tokens = pool.hits + (hit > 0), pool.misses + (hit == 0), pool.hit_tokens + hit
        return out
