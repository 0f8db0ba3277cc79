"""Fixed-size KV blocks: allocation, reference counts, and LRU reuse of cached blocks.

A block is in exactly one of three states:
- used: referenced by at least one running sequence;
- cached: unreferenced but holding a known prompt prefix (found by its hash), evictable;
- free: holding nothing anyone can find.
Allocation takes free blocks first and evicts cached ones, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict, deque


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
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
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

    def register(self, block: int, block_hash: int) -> None:
        """Marks a full block as holding the prefix `block_hash`, so others can reuse it."""
        if block_hash in self._block_of or block in self._hash_of:
            return  # an identical prefix is cached already; keep the first copy
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
