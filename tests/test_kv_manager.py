"""The KV manager on its own, with no scheduler: the blocks a sequence gets, the prefix it
finds cached, what a window releases, and that every block comes back."""

from __future__ import annotations

import pytest

from gapless.kv.block_pool import BlockPool
from gapless.kv.groups import KVGroup
from gapless.kv.manager import KVManager, SeqBlocks
from gapless.kv.prefix_cache import block_hashes

BS = 4


def ids(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


def keyed(tokens: list[int]):
    return lambda start, end: tokens[start:end]


def computed(kv: KVManager, tokens: list[int]) -> SeqBlocks:
    """A sequence whose whole prompt was computed and offered to the cache."""
    seq = SeqBlocks()
    cached = kv.admit(seq, tokens)
    assert kv.reserve(seq, cached, len(tokens))
    kv.register(seq, len(tokens), keyed(tokens))
    return seq


def test_reserve_allocates_the_blocks_a_sequence_grows_into_and_refuses_past_the_pool():
    kv = KVManager(BlockPool(4, BS))
    seq = SeqBlocks()
    assert kv.reserve(seq, 0, 5) and len(seq.block_table) == 2
    assert kv.reserve(seq, 0, 8) and len(seq.block_table) == 2  # the second block had room
    assert kv.room(seq, 8) == 2 * BS
    assert not kv.reserve(seq, 0, 17)  # five blocks: the pool has four
    assert len(seq.block_table) == 2 and kv.pool.num_free == 2  # a refusal takes nothing
    kv.free(seq)
    assert seq.tables == [] and kv.pool.num_free == 4


def test_a_prompt_reuses_the_full_blocks_of_a_computed_prefix_but_never_its_last_token():
    kv = KVManager(BlockPool(16, BS))
    first = computed(kv, ids(10))
    assert first.hashes and first.registered == 2  # the 3rd block is not full
    shared = ids(10) + ids(5, 100)
    seq = SeqBlocks()
    assert kv.admit(seq, shared) == 8
    assert seq.block_table == first.block_table[:2]  # the same blocks, referenced twice
    # A prompt of exactly the cached blocks leaves its last block to compute.
    same = SeqBlocks()
    assert kv.admit(same, ids(8)) == 4
    for s in (first, seq, same):
        kv.free(s)
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2


def test_no_reuse_without_the_prefix_cache_or_where_every_row_is_read():
    kv = KVManager(BlockPool(16, BS), prefix_cache=False)
    first = computed(kv, ids(10))
    assert first.hashes == [] and kv.admit(SeqBlocks(), ids(10)) == 0
    kv.free(first)
    assert kv.pool.num_cached == 0
    cached = KVManager(BlockPool(16, BS))
    computed(cached, ids(10))
    assert cached.admit(SeqBlocks(), None) == 0  # keyed None: prompt logprobs, say


def test_a_freed_sequence_finds_its_own_blocks_again_until_they_are_evicted():
    """What a preempted request relies on: its blocks stay cached after it is freed."""
    kv = KVManager(BlockPool(4, BS))
    tokens = ids(13)
    seq = computed(kv, tokens)
    kv.free(seq)
    assert kv.pool.num_cached == 3 and kv.pool.num_used == 0
    again = SeqBlocks()
    assert kv.admit(again, tokens) == 12
    kv.free(again)
    other = SeqBlocks()
    assert kv.reserve(other, 0, 4 * BS)  # takes every block: the cached ones are evicted
    kv.free(other)
    assert kv.admit(SeqBlocks(), tokens) == 0


def test_a_sliding_window_releases_the_blocks_no_later_query_reads():
    local = BlockPool(8, BS)
    kv = KVManager(BlockPool(8, BS), None, [KVGroup(local, 6)])
    seq = SeqBlocks()
    assert kv.reserve(seq, 0, 12)
    assert [len(t) for t in seq.tables] == [3, 3]
    # The query at 12 reads keys 7..12: block 0 (keys 0-3) is behind the window.
    assert kv.reserve(seq, 12, 16)
    assert seq.window_tables[0][0] == -1 and seq.block_table[0] >= 0
    assert local.num_used == 3 and kv.pool.num_used == 4
    kv.free(seq)
    assert local.num_used == 0 and kv.pool.num_used == 0


def test_a_prefix_is_served_only_where_each_window_holds_the_keys_after_it():
    local = BlockPool(8, BS)
    kv = KVManager(BlockPool(16, BS), None, [KVGroup(local, 6)])
    tokens = ids(17)
    kv.free(computed(kv, tokens))
    assert kv.admit(seq := SeqBlocks(), tokens) == 16
    assert seq.window_tables[0][:2] == [-1, -1]  # the window at 16 starts in block 2
    kv.free(seq)
    local.release(local.allocate(local.num_available))  # evicts every window block
    assert kv.admit(SeqBlocks(), tokens) == 0


def test_truncate_releases_the_blocks_of_rejected_proposals():
    kv = KVManager(BlockPool(8, BS))
    seq = SeqBlocks()
    assert kv.reserve(seq, 0, 3 * BS)
    kv.truncate(seq, BS + 1)
    assert len(seq.block_table) == 2 and kv.pool.num_used == 2


@pytest.mark.parametrize("prompt", [8, 10])
def test_a_fork_shares_full_blocks_and_copies_the_partly_filled_one(prompt):
    kv = KVManager(BlockPool(8, BS))
    parent = computed(kv, ids(prompt))
    child = SeqBlocks()
    partial = prompt % BS > 0
    assert kv.fork_tail(child, partial)
    [copies] = kv.fork(parent, child, prompt)
    assert child.block_table[:2] == parent.block_table[:2]
    if partial:
        assert copies == [(parent.block_table[2], child.block_table[2])]
    else:
        assert copies == [] and len(child.block_table) == 2
    kv.free(parent)
    assert kv.pool.num_used == 2 + partial  # the child still holds the shared blocks
    kv.free(child)
    assert kv.pool.num_used == 0


def test_a_fork_tail_is_refused_when_no_block_is_free():
    kv = KVManager(BlockPool(2, BS))
    parent = computed(kv, ids(6))
    child = SeqBlocks()
    assert not kv.fork_tail(child, True) and child.tables == []
    kv.free(parent)


class Recorder:
    """A CacheEvents sink that keeps what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        self.told.append(("stored", block_hashes, parent, token_ids))

    def removed(self, block_hashes: list[int]) -> None:
        self.told.append(("removed", block_hashes))


def test_the_cache_tells_what_enters_it_once_with_its_tokens_and_what_its_evictions_take():
    kv = KVManager(BlockPool(6, BS))
    kv.pool.events = events = Recorder()
    first = computed(kv, ids(10))
    hashes = block_hashes(ids(10), BS)
    assert events.told == [("stored", hashes, None, ids(8))]
    # A chunk later the chain goes on from its last block.
    assert kv.reserve(first, 10, 12)
    kv.register(first, 12, keyed(ids(12)))
    assert events.told[1:] == [("stored", block_hashes(ids(12), BS)[2:], hashes[1], ids(4, 8))]
    # The same prefix computed again is cached already: nothing to tell.
    events.told.clear()
    kv.free(computed(kv, ids(9)))
    kv.free(first)
    assert events.told == []
    # Six blocks for another prompt: the three cached ones go, least recently used first.
    kv.free(computed(kv, ids(24, 50)))
    evicted = [h for kind, *rest in events.told if kind == "removed" for h in rest[0]]
    assert evicted == block_hashes(ids(12), BS)
    assert not any(kv.pool.holds(h) for h in evicted)


def test_blocks_from_an_images_rows_on_are_not_told():
    kv = KVManager(BlockPool(8, BS))
    kv.pool.events = events = Recorder()
    tokens = [*ids(5), *(("image", i) for i in range(4)), *ids(7, 100)]
    computed(kv, tokens)
    assert kv.pool.num_used == 4  # all four full blocks are cached, for this server's reuse
    assert events.told == [("stored", block_hashes(tokens, BS)[:1], None, ids(4))]
