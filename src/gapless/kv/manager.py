"""The KV manager: every sequence's blocks in every KV group (kv/groups.py), the prefix
cache's reuse of them, and their release once a sliding window has passed them. The
scheduler decides who runs; it asks this manager what a prompt has cached, whether a
sequence's next tokens fit, and to free a sequence, and never touches a pool or a block
table itself.

Positions are the scheduler's: `computed` is where a sequence's next query starts (its K/V
before it is in the cache), `end` how many tokens its blocks must hold. Nothing here knows a
request; a sequence's blocks are its `SeqBlocks`, which only this manager writes.

With a disk tier (disk.py), a prompt's cached prefix may go on past what RAM holds: the
blocks found on disk are read ahead on the tier's threads while the sequence waits, and
loaded into its blocks as they arrive (ready, take_loads), a step's share at a time. Every
block the prefix cache is offered is also queued for the disk (take_writes), unless the
disk holds it already.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch

from gapless.kv.block_pool import BlockPool
from gapless.kv.disk import DiskTier
from gapless.kv.groups import KVGroup, first_needed_block
from gapless.kv.prefix_cache import block_hashes

# Tokens as the prefix cache keys them: ids, or for an image's rows (its key, the offset).
KeyedTokens = Sequence[int | tuple[str, int]]
# Blocks read from disk ahead of their load, per sequence: enough to fill a few steps' loads
# while bounding the memory a long prefix's reads hold.
READ_AHEAD = 64


@dataclass
class DiskBlock:
    """A block of a sequence's prefix found on disk: its hash, the groups that need it (group
    0 always; a sliding group where its window reaches it), and their reads once started."""

    block_hash: int
    groups: tuple[int, ...]
    reads: dict[int, Future[torch.Tensor | None]] = field(default_factory=dict)


@dataclass
class SeqBlocks:
    """One sequence's KV blocks: its table in each group, group 0's first (-1 where a window
    has passed; empty before it is admitted), the chain hashes of its full computed blocks,
    and how many of those blocks the prefix cache has been offered."""

    tables: list[list[int]] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    registered: int = 0
    # The hash its chain starts from: its LoRA adapter's (prefix_cache.adapter_root), else 0.
    root: int = 0
    # The blocks after its computed ones still to load from disk, in order.
    loading: list[DiskBlock] = field(default_factory=list)

    @property
    def block_table(self) -> list[int]:
        """Group 0's table: the full-attention layers' (or the widest window's)."""
        return self.tables[0] if self.tables else []

    @property
    def window_tables(self) -> list[list[int]]:
        """The sliding-window groups' tables, in group order."""
        return self.tables[1:]


class KVManager:
    def __init__(
        self,
        pool: BlockPool,
        window: int | None = None,
        window_groups: Sequence[KVGroup] = (),
        prefix_cache: bool = True,
        disk: DiskTier | None = None,
    ) -> None:
        """`pool` and `window`: group 0's; `window_groups`: a hybrid model's sliding-window
        groups, each with its own pool. `prefix_cache`: whether full computed blocks are
        offered for reuse by later prompts with the same prefix; `disk`: the tier under it."""
        self.groups = [KVGroup(pool, window), *window_groups]
        self.prefix_cache = prefix_cache
        self.disk = disk if prefix_cache else None
        # (hash, group, block) offered to the cache and not on disk: the engine copies each
        # block's K/V out for the disk's writer (take_writes).
        self._writes: list[tuple[int, int, int]] = []

    @property
    def pool(self) -> BlockPool:
        return self.groups[0].pool

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def capacity_tokens(self) -> int:
        """The most tokens one sequence's group 0 blocks can hold."""
        return self.pool.num_blocks * self.block_size

    def can_start(self, tokens: int) -> bool:
        """Whether the pools have room for a sequence's first `tokens` tokens."""
        return self.pool.num_available > tokens // self.block_size

    # -- admission ----------------------------------------------------------------------------

    def admit(self, seq: SeqBlocks, keyed: KeyedTokens | None) -> int:
        """Gives a new sequence the cached blocks of its longest cached prefix, and returns
        that prefix's tokens. `keyed`: its tokens as the cache keys them, or None where no
        cached token may serve (prompt logprobs, mean pooling). Its last token is always left
        to compute: its logits pick the first output token (and a last-token embedding reads
        its hidden state)."""
        bs = self.block_size
        prefix: list[int] = []
        if self.prefix_cache and keyed is not None:
            prefix = block_hashes(keyed, bs, seq.root)[: (len(keyed) - 1) // bs]
        hashes = prefix[: self._reusable(prefix)]
        cached = len(hashes) * bs
        tables = []
        for group in self.groups:  # each claims the blocks the next position reads
            first = first_needed_block(cached, group.window, bs)
            tables.append([-1] * first + [group.pool.lookup(h) for h in hashes[first:]])
        seq.tables, seq.hashes, seq.registered = tables, hashes, len(hashes)
        if self.disk is not None:
            seq.loading = self._on_disk(prefix, len(hashes))
        return cached

    def _on_disk(self, prefix: list[int], start: int) -> list[DiskBlock]:
        """The blocks of the prefix after its first `start` that the disk holds: group 0's
        all, and each sliding group's those its window reaches from the position after
        them."""
        assert self.disk is not None
        bs, disk = self.block_size, self.disk
        # Each file is looked up once: cutting the prefix back below asks again for the
        # blocks before the cut, and each lookup is a stat on the step thread.
        holds = functools.cache(lambda i, g: disk.holds(prefix[i], g))
        n = start
        while n < len(prefix) and holds(n, 0):
            n += 1
        disk.missed(len(prefix) - n)

        def needs(end: int) -> list[tuple[int, ...]]:
            """The groups each block of start..end needs, for a prefix ending at end."""
            firsts = [first_needed_block(end * bs, g.window, bs) for g in self.groups]
            return [tuple(g for g, f in enumerate(firsts) if i >= f) for i in range(start, end)]

        while n > start and not all(
            holds(i, g) for i, groups in enumerate(needs(n), start) for g in groups
        ):
            n -= 1
        return [DiskBlock(prefix[i], g) for i, g in enumerate(needs(n), start)]

    @staticmethod
    def loading(seq: SeqBlocks) -> bool:
        """Whether blocks of the sequence's cached prefix are still to load from disk."""
        return bool(seq.loading)

    def ready(self, seq: SeqBlocks, most: int) -> int:
        """How many of the sequence's next blocks to load have been read and checked (at most
        `most`); reads ahead of them start. A block that failed its read ends the loading
        there: its tokens and those after it are computed."""
        assert self.disk is not None
        for block in seq.loading[:READ_AHEAD]:
            for g in block.groups:
                if g not in block.reads:
                    block.reads[g] = self.disk.read(block.block_hash, g)
        n = 0
        for block in seq.loading[:most]:
            reads = block.reads.values()
            if not all(r.done() for r in reads):
                break
            if any(r.result() is None for r in reads):
                self._stop_loading(seq, n)
                break
            n += 1
        return n

    def wait_for_reads(self, seqs: list[SeqBlocks], timeout: float) -> None:
        """Waits until a next block of one of the sequences is read (at most `timeout`
        seconds): what a step with nothing else to do does instead of spinning, which on a
        small machine takes the core the reader threads need."""
        pending = [
            read
            for seq in seqs
            for block in seq.loading[:1]
            for read in block.reads.values()
            if not read.done()
        ]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def take_loads(
        self, seq: SeqBlocks, n: int, computed: int
    ) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """The next n blocks' K/V, read, by KV group: the blocks reserved for them after the
        `computed` tokens and each one's K/V. They leave the sequence's loading."""
        first = computed // self.block_size
        loads: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for i, block in enumerate(seq.loading[:n]):
            for g, read in block.reads.items():
                blocks, kvs = loads.setdefault(g, ([], []))
                blocks.append(seq.tables[g][first + i])
                kvs.append(read.result())
        del seq.loading[:n]
        return loads

    def _stop_loading(self, seq: SeqBlocks, keep: int) -> None:
        for block in seq.loading[keep:]:
            for read in block.reads.values():
                read.cancel()
        del seq.loading[keep:]

    def take_writes(self) -> dict[int, list[tuple[int, int]]]:
        """The blocks offered to the cache since the last call that the disk lacks, by KV
        group, as (hash, block): the caller copies their K/V out (a gather per group) before
        a block can be reused."""
        writes: dict[int, list[tuple[int, int]]] = {}
        for block_hash, group, block in self._writes:
            writes.setdefault(group, []).append((block_hash, block))
        self._writes = []
        return writes

    def _reusable(self, hashes: list[int]) -> int:
        """How many leading blocks of these prefix hashes the cache can serve: group 0 holds
        them all, and each sliding group the ones the first position after them reads."""
        bs, first, *sliding = self.block_size, *self.groups
        n = 0
        while n < len(hashes) and first.pool.holds(hashes[n]):
            n += 1
        while n and not all(
            all(g.pool.holds(h) for h in hashes[first_needed_block(n * bs, g.window, bs) : n])
            for g in sliding
        ):
            n -= 1
        return n

    # -- growth -------------------------------------------------------------------------------

    def reserve(self, seq: SeqBlocks, computed: int, end: int) -> bool:
        """Makes room in the sequence's tables for `end` tokens, first releasing what the
        windows have passed at `computed`; False, with nothing allocated, where a pool is
        short."""
        self.drop_outside_window(seq, computed)
        tables = self._tables(seq)
        need = -(-end // self.block_size) - len(tables[0])
        if need <= 0:
            return True
        if any(need > g.pool.num_available for g in self.groups):
            return False
        for group, table in zip(self.groups, tables, strict=True):
            table += group.pool.allocate(need)
        return True

    def room(self, seq: SeqBlocks, scheduled: int) -> int:
        """How many more tokens after `scheduled` the sequence's blocks and the pools' free
        ones can hold."""
        spare = len(seq.block_table) * self.block_size - scheduled
        return spare + min(g.pool.num_available for g in self.groups) * self.block_size

    def drop_outside_window(self, seq: SeqBlocks, computed: int) -> None:
        """Releases the blocks a group's window has moved past (the rotating cache): none is
        read by the query at `computed` or any later one."""
        for group, table in zip(self.groups, seq.tables, strict=False):
            first = first_needed_block(computed, group.window, self.block_size)
            stale = [b for b in table[:first] if b >= 0]
            if stale:
                group.pool.release(stale)
                table[:first] = [-1] * first

    def truncate(self, seq: SeqBlocks, tokens: int) -> None:
        """Releases the blocks past the first `tokens` tokens' (rejected proposals', whose
        K/V is overwritten before anything reads it)."""
        keep = -(-tokens // self.block_size)
        for group, table in zip(self.groups, seq.tables, strict=False):
            group.pool.release([b for b in table[keep:] if b >= 0])
            del table[keep:]

    def register(
        self, seq: SeqBlocks, computed: int, keyed: Callable[[int, int], KeyedTokens]
    ) -> None:
        """Offers the sequence's blocks that `computed` tokens newly filled to the prefix
        cache. `keyed(start, end)`: its tokens start..end as the cache keys them."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        full, done = computed // bs, len(seq.hashes)
        if full <= done:
            return
        parent = seq.hashes[-1] if done else seq.root
        seq.hashes += block_hashes(keyed(done * bs, full * bs), bs, parent)
        stored = []  # group 0's blocks that entered the cache (not copies of cached ones)
        for g, (group, table) in enumerate(zip(self.groups, seq.tables, strict=False)):
            for i in range(seq.registered, full):
                if table[i] >= 0:
                    if group.pool.register(table[i], seq.hashes[i]) and g == 0:
                        stored.append(i)
                    if self.disk is not None and not self.disk.holds(seq.hashes[i], g):
                        self._writes.append((seq.hashes[i], g, table[i]))
        if stored and self.pool.events is not None:
            self._tell_stored(seq, stored, keyed)
        seq.registered = full

    def _tell_stored(
        self, seq: SeqBlocks, blocks: list[int], keyed: Callable[[int, int], KeyedTokens]
    ) -> None:
        """Tells the pool's events of these blocks of the sequence that entered the cache: a
        chain for each run of consecutive ones. A block with an image's rows, and every block
        after it, is left out: a router could match its tokens to no prompt's ids."""
        assert self.pool.events is not None
        bs = self.block_size
        runs: list[list[int]] = []
        for i in blocks:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            tokens = keyed(run[0] * bs, (run[-1] + 1) * bs)
            ids = []
            for token in tokens:
                if not isinstance(token, int):
                    break
                ids.append(token)
            n = len(ids) // bs
            if n:
                parent = seq.hashes[run[0] - 1] if run[0] else None
                self.pool.events.stored(seq.hashes[run[0] : run[0] + n], parent, ids[: n * bs])
            if n < len(run):
                return

    def free(self, seq: SeqBlocks) -> None:
        """Releases all the sequence's blocks (cached ones stay findable until evicted)."""
        for group, table in zip(self.groups, seq.tables, strict=False):
            group.pool.release([b for b in table if b >= 0])
        self._stop_loading(seq, 0)
        seq.tables, seq.hashes, seq.registered = [], [], 0

    # -- forks --------------------------------------------------------------------------------

    def fork_tail(self, seq: SeqBlocks, partial: bool) -> bool:
        """Gives a sequence that will fork from a parent's prompt its own block in each group
        for the copy of the parent's partly filled last block (none when the prompt fills its
        blocks); False where a pool has none free."""
        if partial and not all(g.pool.num_available for g in self.groups):
            return False
        seq.tables = [g.pool.allocate(1) if partial else [] for g in self.groups]
        return True

    def fork(
        self, parent: SeqBlocks, child: SeqBlocks, computed: int
    ) -> list[list[tuple[int, int]]]:
        """Starts the child on the parent's `computed` prompt tokens: their full blocks shared
        by reference, its own tail block (fork_tail) after them. Returns, for each group, the
        (source, destination) blocks whose K/V must be copied."""
        full = computed // self.block_size
        copies: list[list[tuple[int, int]]] = []
        tables = []
        for group, table, own in zip(self.groups, parent.tables, child.tables, strict=True):
            group.pool.share([b for b in table[:full] if b >= 0])
            tables.append(table[:full] + own)
            copies.append([(table[full], block) for block in own])
        child.tables = tables
        child.hashes = parent.hashes[:full]
        child.registered = min(parent.registered, full)
        return copies

    def _tables(self, seq: SeqBlocks) -> list[list[int]]:
        if not seq.tables:
            seq.tables = [[] for _ in self.groups]
        return seq.tables
