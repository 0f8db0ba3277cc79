"""Fixed-size KV blocks: allocation, reference counts, and LRU reuse of cached blocks.

A block is in exactly one of three states:
- used: referenced by at least one running sequence;
- cached: unreferenced but holding a known prompt prefix (found by its hash), evictable;
- free: holding nothing anyone can find.
Allocation takes free blocks first and evicts cached ones, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol


class CacheEvents(Protocol):
    """Told when full blocks enter the prefix cache and leave it, so that a prefix-aware
    router knows what this server holds (server/kv_events.py publishes them). Called on the
    engine thread, so it must not block."""

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        """Blocks of one chain entered the cache: their hashes in order, the hash of the
        block before the first (None: it starts the prompt) and all their tokens."""

    def removed(self, block_hashes: list[int]) -> None:
        """Cached blocks were evicted: their prefixes are found here no more."""


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU first
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        # Where the prefix cache's changes are told (the KV manager tells what enters, with its
        # tokens; this pool what its evictions take out); None: nowhere.
        self.events: CacheEvents | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free plus evictable cached ones."""
        return self.num_free + self.num_cached

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_available} available")
        blocks, evicted = [], []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                evicted.append(self._hash_of.pop(block))
                del self._block_of[evicted[-1]]
            self._refs[block] = 1
            blocks.append(block)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released twice"
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of these used blocks (a forked sequence reads them)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not in use"
            self._refs[block] += 1

    def holds(self, block_hash: int) -> bool:
        """Whether a block holding this prefix hash is cached or in use."""
        return block_hash in self._block_of

    def lookup(self, block_hash: int) -> int | None:
        """A cached block holding this prefix hash, now referenced by the caller; or None."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        return block

    def register(self, block: int, block_hash: int) -> bool:
        """Marks a full block as holding the prefix `block_hash`, so others can reuse it;
        False where it was cached already."""
        if block_hash in self._block_of or block in self._hash_of:
            return False  # an identical prefix is cached already; keep the first copy
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True
