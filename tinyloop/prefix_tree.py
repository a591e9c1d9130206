"""Automatic prefix caching: the model's cache of prompt blocks, shared by every call and by registered scaffolds.

One tree per loop count. A node holds up to BLOCK_TOKENS tokens that continue its parent's, and one block of the
model's pool per slot a forward at that loop count writes (prelude, core x loops, coda): the entries of exactly those
positions. A path from the root spells a token prefix, so a prompt's longest cached prefix is a walk: whole blocks by
their 16 tokens (a dict lookup), then, where no whole block matches, the child sharing the most tokens with the rest
of the prompt, used only up to there (its block is lent as it is; the first write into it copies it). That last step
is what makes a scaffold ending in whitespace hit when a request continues it: the tokenizer merges the boundary
differently, and every token before the merge is still reused.

Why this is exact: at loop k a token attends to the loop-k entries of earlier tokens only, so the entries of a
prefix do not depend on what follows it (docs/cache-reuse.md). A tree per loop count, because the coda's entries
come from the state after exactly that many loops.

Eviction: least recently used first, when a block is taken and none is free (BlockPool.take); admission counts the
blocks only the cache holds as free (BlockPool.room), so a call finds its own prefix before anything is evicted. A use touches
a path leaf first and root last, so every node is newer than its descendants and the oldest node is always a leaf.
Pinned nodes (registered scaffolds: register_prefix, a worker's --prefix-file) are never evicted; unpinning a
scaffold drops those of its nodes nothing else extends.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from .cache import BLOCK_TOKENS, BlockPool, KVCache, Span
from .config import ModelConfig


class Node:
    __slots__ = ("tokens", "parent", "blocks", "depth", "children", "by_first", "pins", "alive")

    def __init__(self, tokens: tuple, parent: "Node | None", blocks: list[int]):
        self.tokens, self.parent, self.blocks = tokens, parent, blocks
        self.depth: int = (parent.depth if parent is not None else 0) + len(tokens)
        self.children: dict[tuple, Node] = {}
        self.by_first: dict[int, list[Node]] = {}  # children by their first token: a partial match scans only these
        self.pins = 0
        self.alive = True


class TreeListener(Protocol):
    """What the tree tells whoever watches it (called in the thread that runs the model; keep it cheap)."""

    def stored(self, node: Node, loops: int) -> None: ...

    def removed(self, node: Node) -> None: ...


def common_length(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixTree:
    def __init__(self, cfg: ModelConfig, pool: BlockPool):
        self.cfg, self.pool = cfg, pool
        self.roots: dict[int, Node] = {}
        self.lru: OrderedDict[Node, None] = OrderedDict()  # unpinned nodes, least recently used first
        self.lookups = self.hits = self.hit_tokens = self.evictions = 0
        # Told of every node stored and removed (a worker's KV-cache events: workers/kv_events.py); None: nobody.
        self.listener: "TreeListener | None" = None
        pool.prefixes = self

    # --- what a node stores ---------------------------------------------------------------------------------
    def slots(self, loops: int) -> list[int]:
        """The slots a forward of `loops` loops writes: prelude, core loops 0..loops-1, coda."""
        cfg = self.cfg
        return [*range(cfg.n_prelude + cfg.n_core * loops), *range(cfg.coda_slot(0), cfg.n_slots())]

    @property
    def nodes(self) -> int:
        return sum(1 for _ in self.walk())

    @property
    def blocks(self) -> int:
        return sum(len(n.blocks) for n in self.walk())

    def walk(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    # --- lookup -----------------------------------------------------------------------------------------------
    def match(self, ids: list[int], loops: int, limit: int | None = None) -> tuple[list[Node], int]:
        """The nodes of the longest cached prefix of ids[:limit] and its length in tokens."""
        node, path, m = self.roots.get(loops), [], 0
        limit = len(ids) if limit is None else limit
        bt = BLOCK_TOKENS
        while node is not None and m + bt <= limit:
            child = node.children.get(tuple(ids[m:m + bt]))
            if child is None:
                break
            path.append(child)
            node, m = child, m + bt
        if node is not None and m < limit:  # the rest of the prompt shares part of a block with a child
            rest = ids[m:limit]
            best, n = None, 0
            for child in node.by_first.get(rest[0], ()):
                k = common_length(child.tokens, rest)
                if k > n:
                    best, n = child, k
            if best is not None:
                path.append(best)
                m += n
        return path, m

    def restore(self, ids: list[int], loops: int, lane: KVCache) -> int:
        """Lend the blocks of the longest cached prefix of ids to `lane` (its lane 0) and return its length: at most
        len(ids) - 1, since the last prompt token's logits come from a forward."""
        self.lookups += 1
        path, m = self.match(ids, loops, len(ids) - 1)
        if not m:
            return 0
        slots = self.slots(loops)
        lane.adopt(Span(self.pool, {s: [n.blocks[i] for n in path] for i, s in enumerate(slots)}, m))
        self.touch(path)
        self.hits += 1
        self.hit_tokens += m
        return m

    # --- insertion --------------------------------------------------------------------------------------------
    def keep(self, ids: list[int], loops: int, lane: KVCache, *, tail: bool = False, pin: bool = False) -> list[Node]:
        """Keep the blocks of lane 0 holding the entries of ids (every slot of `loops` loops written at positions
        0..len(ids)-1): each whole block, and with `tail` the last partial one. Blocks of a prefix the tree holds
        already stay the tree's. Returns the path (pinned once more with `pin`)."""
        bt, slots = BLOCK_TOKENS, self.slots(loops)
        node = self.roots.setdefault(loops, Node((), None, []))
        path = []
        for i in range(0, len(ids) - (0 if tail else bt - 1), bt):
            tokens = tuple(ids[i:i + bt])
            child = node.children.get(tokens)
            if child is None:
                blocks = [lane.held[s][0][i // bt] for s in slots]
                for b in blocks:
                    self.pool.retain(b)
                child = node.children[tokens] = Node(tokens, node, blocks)
                node.by_first.setdefault(tokens[0], []).append(child)
                if self.listener is not None:
                    self.listener.stored(child, loops)
            path.append(child)
            node = child
        if pin:
            for n in path:
                n.pins += 1
                self.lru.pop(n, None)
        self.touch(path)
        return path

    def unpin(self, path: list[Node]) -> None:
        """A scaffold is no longer registered: its nodes that nothing else pins or extends leave the tree."""
        for n in reversed(path):
            n.pins -= 1
            if n.alive and not n.pins and not n.children:
                self.remove(n)
        self.touch([n for n in path if n.alive])

    def touch(self, path: list[Node]) -> None:
        for n in reversed(path):  # leaf first: every node stays newer than its descendants
            if not n.pins:
                self.lru[n] = None
                self.lru.move_to_end(n)

    # --- eviction ---------------------------------------------------------------------------------------------
    def evictable(self) -> int:
        """Blocks eviction would free: those of unpinned nodes that nothing else holds."""
        refs = self.pool.refs
        return sum(1 for n in self.lru for b in n.blocks if refs[b] == 1)

    def evict(self, need: int) -> None:
        """Drop least recently used unpinned leaves until the pool has `need` free blocks or nothing left would free
        any (a node whose blocks running sequences also hold stays: dropping it would free nothing now)."""
        refs = self.pool.refs
        while self.pool.free_count < need:
            # the oldest leaf that frees something (a node a running sequence shares would only be lost)
            node = next((n for n in self.lru if not n.children and any(refs[b] == 1 for b in n.blocks)), None)
            if node is None:
                return
            self.remove(node)
            self.evictions += 1

    def remove(self, node: Node) -> None:
        if self.listener is not None:
            self.listener.removed(node)
        parent = node.parent
        assert parent is not None  # (a stored node; the roots stay)
        del parent.children[node.tokens]
        parent.by_first[node.tokens[0]].remove(node)
        if not parent.by_first[node.tokens[0]]:
            del parent.by_first[node.tokens[0]]
        self.lru.pop(node, None)
        for b in node.blocks:
            self.pool.drop(b)
        node.blocks, node.alive = [], False

    def clear(self) -> None:
        """Drop every unpinned node nothing else holds."""
        self.evict(self.pool.num_blocks + 1)
