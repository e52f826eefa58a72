"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

A full block is known by a hash of its tokens, the hash of the block before it and the adapter version
the sequence runs (keys and values depend on the adapter when it adapts k/v projections). Blocks are
registered only once their keys and values are computed, so a sequence never reuses a block that is
still being filled. Freed blocks keep their hash until they are handed out again, so a prompt that
returns soon after finds its prefix still cached.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


def _block_hash(prev: int, tokens: list[int], adapter) -> int:
    return hash((prev, adapter, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.cached_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        # free blocks in the order they should be reused: never-hashed first, then least recently freed
        self.free: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.lent = 0        # blocks lent to training (lend)
        self.short = False   # serving found too few free blocks while some were lent: training gives them back

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.hash_of[block] is not None:
            self.by_hash.pop(self.hash_of[block], None)
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks. False if short."""
        bs, tokens = self.block_size, seq.token_ids
        cached: list[int] = []
        prev = 0
        if self.prefix_caching:
            for i in range(len(tokens) // bs):
                h = _block_hash(prev, tokens[i * bs:(i + 1) * bs], seq.adapter)
                block = self.by_hash.get(h)
                if block is None:
                    break
                cached.append(block)
                prev = h
        fresh = self.blocks_needed(len(tokens)) - len(cached)
        revived = sum(1 for b in cached if self.ref[b] == 0)
        if fresh + revived > self.num_free:
            self.short = self.lent > 0
            return False
        for b in cached:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        seq.block_table = cached + [self._take() for _ in range(fresh)]
        seq.num_hashed_blocks, seq.prefix_hash = len(cached), prev
        # at least the last token is computed again: its logits are needed to sample
        seq.num_computed = min(len(cached) * bs, len(tokens) - 1)
        self.cached_tokens += seq.num_computed
        return True

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for the sequence to hold num_tokens tokens. False if the cache is out of blocks."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            self.short = self.lent > 0
            return False
        seq.block_table.extend(self._take() for _ in range(max(need, 0)))
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks for prefix reuse."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed:
            i = seq.num_hashed_blocks
            block = seq.block_table[i]
            h = _block_hash(seq.prefix_hash, seq.token_ids[i * bs:(i + 1) * bs], seq.adapter)
            if self.hash_of[block] is None and h not in self.by_hash:
                self.hash_of[block] = h
                self.by_hash[h] = block
            seq.prefix_hash = h
            seq.num_hashed_blocks += 1

    def free_seq(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_computed = seq.num_hashed_blocks = seq.prefix_hash = 0

    # --- lending free blocks (training keeps activations in them: dark.engine.loan) ---
    def lend(self, count: int, keep_free: int) -> int | None:
        """Take `count` free blocks with consecutive ids, leaving at least `keep_free` blocks free; the first id, or
        None when no such run is free. The highest ids are tried first (the free list hands out the lowest first).
        Their prefix-cache entries go: what training writes there is not the keys they described."""
        if count <= 0 or self.num_free - count < keep_free:
            return None
        n = len(self.ref)
        start = None
        if all(b in self.free for b in range(n - count, n)):
            start = n - count
        else:
            run = 0
            for b in range(n - 1, -1, -1):  # the highest run of `count` free ids
                run = run + 1 if b in self.free else 0
                if run == count:
                    start = b
                    break
        if start is None:
            return None
        for b in range(start, start + count):
            del self.free[b]
            if self.hash_of[b] is not None:
                self.by_hash.pop(self.hash_of[b], None)
                self.hash_of[b] = None
            self.ref[b] = 1
        self.lent += count
        return start

    def take_back(self, start: int, count: int) -> None:
        """Blocks lent by lend() are free again."""
        for b in range(start, start + count):
            if self.ref[b] != 1 or b in self.free:
                raise ValueError(f"block {b} was not lent")
            self.ref[b] = 0
            self.free[b] = None
        self.lent -= count
        self.short = False
