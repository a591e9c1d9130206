"""Prefix reuse: a PrefixCache keeps a prefix's prefill (its KV entries at every slot it used), so a prompt
that starts with it only prefills its own suffix. A PrefixPool registers scaffolds as pinned entries of the model's
prefix cache (tinyloop/prefix_tree.py), where a prompt finds the longest cached token prefix, block by block.

Exactness: the cache holds the very entries `generate` would write for those positions (at loop k a token
only sees loop-k entries of earlier tokens), so greedy output equals `generate` on the whole prompt.
A prefix is cached at one loop count and serves only calls at that count: its coda entries come from
the prefix's state after exactly n_loops loops.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .cache import BLOCK_TOKENS, KVCache, Span
from .engine.calls import checked, engine
from .engine.sequence import Sequence, Start, Writes
from .errors import ConfigError, HandleError
from .handle_base import Handle, encode_tokens, prefill_by_steps, tensor_bytes
from .prefix_tree import Node, common_length
from .loader import Model
from .request import GenerateConfig, GenerateResult, OnToken

BLOCK = BLOCK_TOKENS  # tokens per cached block


def _check_loops(model: Model, n_loops) -> int:
    if not isinstance(n_loops, int) or isinstance(n_loops, bool) or not 1 <= n_loops <= model.cfg.max_loops:
        raise ConfigError(f"n_loops must be an integer in 1..{model.cfg.max_loops}, got {n_loops!r}")
    return n_loops


def _prefix_ids(model: Model, prefix) -> list[int]:
    ids = encode_tokens(model, prefix, "prefix")
    if len(ids) >= model.max_seq_len:
        raise ConfigError(f"prefix length {len(ids)} must be below max_seq_len {model.max_seq_len}")
    return ids


class PrefixCache(Handle):
    """The KV entries of `ids` (positions 0..len-1) at the slots a forward of n_loops loops writes, plus the
    last position's logits (so a prompt that is exactly the prefix needs no forward at all)."""

    kind = "PrefixCache"

    def __init__(self, model: Model, ids: list[int], n_loops: int, text: str | None = None):
        super().__init__(model)
        self.ids, self.n_loops, self.text = ids, n_loops, text
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

    def fill(self) -> None:
        """Prefill the prefix once and keep its blocks."""
        def keep(cache):
            self.span = cache.share(self.slots, len(self.ids))
        self.logits = prefill_by_steps(self.model, self.ids, self.n_loops, keep)

    def restore(self, cache, cells: int) -> None:
        """Lend the blocks of the first `cells` positions (shared: the suffix's first write into the last one copies
        it)."""
        n = -(-cells // BLOCK_TOKENS)
        assert self.span is not None  # (built, not released: the caller holds it)
        cache.adopt(Span(self.span.pool, {s: ids[:n] for s, ids in self.span.blocks.items()}, cells))


def create_prefix_cache(model: Model, prefix, n_loops: int) -> PrefixCache:
    """Prefill `prefix` (string or token ids) at n_loops loops and keep its cache entries."""
    n_loops = _check_loops(model, n_loops)
    pc = PrefixCache(model, _prefix_ids(model, prefix), n_loops, prefix if isinstance(prefix, str) else None)
    with model.busy():
        pc.fill()
    return pc


def _generate_from(model: Model, ids: list[int], cfg: GenerateConfig, on_token: OnToken | None,
                   pc: PrefixCache | None = None, hit: int = 0, prefixes=None) -> GenerateResult:
    """Generate from ids; the first `hit` of them are pc's (lent, not prefilled), or `prefixes` (the model's prefix
    cache, or a lookup-only view of it) finds what is cached. Model is held."""
    with engine(model, [ids], [cfg]) as (runner, client):
        seq = Sequence(model, ids, cfg, on_token)
        if prefixes is not None:
            seq.prefix_cache = prefixes
        if pc is None or not hit or (len(ids) == 1 and model.net.adaptive(seq.exit)):
            # generate runs a one-token prompt adaptively; reuse would not match it, so prefill plainly
            return runner.run([seq], client=client)[0]

        def lend(lane: KVCache) -> Writes | None:
            pc.restore(lane, hit)
            return None if hit == len(ids) else (model.cfg.slots_written(seq.loops), hit, len(ids) - 1)

        def rest(lane: KVCache) -> torch.Tensor:
            if hit == len(ids):
                assert pc.logits is not None  # (built, not released)
                return pc.logits[-1]
            return runner.prefill(ids[hit:], hit, seq.place.lane, seq.loops, seq.exit)[-1]  # all loops, as generate's

        seq.stats.prefix_hit_tokens = hit
        return runner.run([seq], cached=hit, first=Start(lend, rest), client=client)[0]


def _check_call(model: Model, cfg: GenerateConfig | None, n_loops: int | None) -> GenerateConfig:
    cfg = checked(model, cfg, "prefix")
    if n_loops is not None and cfg.resolved_loops(model) != n_loops:
        raise ConfigError(f"GenerateConfig.loops must equal the prefix cache's n_loops {n_loops} "
                          f"(a prefix cache serves only the loop count it was built at), got {cfg.resolved_loops(model)}")
    return cfg


def generate_from_prefix_cache(model: Model, cache: PrefixCache, suffix, cfg: GenerateConfig | None = None,
                               on_token: OnToken | None = None) -> GenerateResult:
    """Generate from cache's prefix + suffix (may be empty). Equals generate on the whole prompt: a string suffix of a
    prefix made from a string is tokenized with it as one text (the tokenizer may merge across the boundary), and
    every token up to the first that differs is reused; token ids are appended to the prefix's ids."""
    if not isinstance(cache, PrefixCache):
        raise HandleError(f"expected a PrefixCache, got {type(cache).__name__}")
    cache.check(model)
    cfg = _check_call(model, cfg, cache.n_loops)
    if isinstance(suffix, str) and cache.text is not None:
        ids = encode_tokens(model, cache.text + suffix, "prompt")
    else:
        ids = cache.ids + encode_tokens(model, suffix, "suffix", allow_empty=True)
    hit = common_length(cache.ids, ids)
    if hit == len(ids) < len(cache.ids):
        hit -= 1  # the prompt ends inside the prefix: the last token's logits need a forward
    with cache.using(model):
        return _generate_from(model, ids, cfg, on_token, cache, hit)


# --- the pool: scaffolds pinned in the model's prefix cache -----------------------------------------------
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


class PinnedPrefix(Handle):
    """A registered scaffold: its path of blocks in the model's prefix cache, pinned (never evicted) while it lives.
    It holds the whole prefix, the last partial block included."""

    kind = "PinnedPrefix"

    def __init__(self, model: Model, ids: list[int], n_loops: int, path: list[Node]):
        super().__init__(model)
        self.ids, self.n_loops, self.path = ids, n_loops, path
        self.block_bytes = model.pool.block_bytes

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(len(n.blocks) for n in self.path) * self.block_bytes

    def release(self) -> None:
        if self.path and self.model.prefixes is not None:
            self.model.prefixes.unpin(self.path)
        self.path = []


class LookupOnly:
    """The model's prefix cache seen by a call that may reuse but not add (prefix caching off: the cache holds the
    registered scaffolds only)."""

    def __init__(self, tree):
        self.tree = tree

    def restore(self, ids: list[int], loops: int, lane: KVCache) -> int:
        return self.tree.restore(ids, loops, lane)

    def keep(self, *args, **kwargs) -> None:
        pass


class PrefixPool(Handle):
    """Up to `capacity` registered scaffolds, pinned in the model's prefix cache; at capacity the least recently used
    is unpinned (and leaves the cache unless a cached sequence extends it)."""

    kind = "PrefixPool"

    def __init__(self, capacity: int):
        self.capacity = capacity
        # bound on the first register_prefix (check knows a pool not bound yet)
        self.model, self.model_id = None, None  # type: ignore[assignment]
        self.freed = False
        self._lock = threading.Lock()
        self.entries: OrderedDict[tuple, PinnedPrefix] = OrderedDict()  # least recently used first
        self.hits = self.misses = self.evictions = self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

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
        for key in list(self.entries):
            self.drop(key)

    def drop(self, key: tuple) -> None:
        entry = self.entries.pop(key)
        entry.release()
        entry.freed = True

    def prune(self) -> None:
        """Entries freed by free_handle leave the pool."""
        for key in [k for k, e in self.entries.items() if e.freed]:
            self.drop(key)

    def lookup(self, model: Model):
        """What a request through the pool reuses: the model's prefix cache (read-only when prefix caching is off, so
        it holds the scaffolds alone)."""
        return model.prefixes if model.prefix_caching else LookupOnly(model.prefixes)

    def count(self, ids: list[int], loops: int, hit: int) -> None:
        """Account a request through the pool that reused `hit` prompt tokens; the scaffold it shares the most
        tokens with counts as used."""
        self.hits, self.misses, self.hit_tokens = self.hits + (hit > 0), self.misses + (hit == 0), self.hit_tokens + hit
        if hit:
            shared = {k: common_length(e.ids, ids) for k, e in self.entries.items() if e.n_loops == loops}
            best = max(shared, key=lambda k: shared[k], default=None)
            if best is not None and shared[best]:
                self.entries.move_to_end(best)

    def add(self, entry: PinnedPrefix) -> None:
        self.prune()
        while len(self.entries) >= self.capacity:
            self.drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[(tuple(entry.ids), entry.n_loops)] = entry


def check_pool(pool: PrefixPool, model: Model) -> None:
    """HandleError unless `pool` is a live PrefixPool usable with `model`."""
    if not isinstance(pool, PrefixPool):
        raise HandleError(f"expected a PrefixPool, got {type(pool).__name__}")
    pool.check(model)


def create_prefix_pool(capacity: int) -> PrefixPool:
    """An empty pool of at most `capacity` registered scaffolds (least recently used unpinned first)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigError(f"PrefixPool capacity must be an integer >= 1, got {capacity!r}")
    return PrefixPool(capacity)


def register_prefix(pool: PrefixPool, model: Model, prefix, n_loops: int) -> PinnedPrefix:
    """Prefill `prefix` at n_loops loops and pin it in the model's prefix cache (a known prefix is only marked as
    recently used)."""
    n_loops = _check_loops(model, n_loops)
    ids = _prefix_ids(model, prefix)
    check_pool(pool, model)
    with pool.using(model):
        if pool.model is None:
            pool.model, pool.model_id = model, model.model_id
        pool.prune()
        key = (tuple(ids), n_loops)
        if key in pool.entries:
            pool.entries.move_to_end(key)
            return pool.entries[key]
        path = []
        prefill_by_steps(model, ids, n_loops, lambda cache: path.extend(
            model.prefixes.keep(ids, n_loops, cache, tail=True, pin=True)))
        entry = PinnedPrefix(model, ids, n_loops, path)
        pool.add(entry)
        return entry


def generate_with_pool(model: Model, pool: PrefixPool, prompt, cfg: GenerateConfig | None = None,
                       on_token: OnToken | None = None) -> GenerateResult:
    """Generate from prompt, skipping the prefill of the longest token prefix the model's prefix cache holds at the
    same loop count (a registered scaffold, or with prefix caching any earlier prompt); no match is a plain
    prefill. Output equals generate(model, prompt, cfg)."""
    check_pool(pool, model)
    cfg = _check_call(model, cfg, None)
    ids = model.encode_prompt(prompt)
    with pool.using(model):
        pool.prune()
        out = _generate_from(model, ids, cfg, on_token, prefixes=pool.lookup(model))
        pool.count(ids, cfg.resolved_loops(model), out.stats.prefix_hit_tokens)
        return out
