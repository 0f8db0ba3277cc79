"""KV groups: a model's layers grouped by attention window, each group with its own block pool,
and each request with its own block table per group.

A sliding-window layer never reads a key more than `window - 1` positions behind its query, so
a group of such layers keeps only the blocks that some future query still reaches: with the
next query at position p (the first of a prompt chunk, or of a speculative verification span,
which both read back from their first position), blocks wholly before p - window + 1 are
released. Full-attention layers keep every block. A hybrid model (Gemma 2/3, gpt-oss) thus
holds its full layers' KV for the whole context and its sliding layers' for about a window.

Group 0 is the full-attention group when any layer attends to everything, else the widest
window (a model whose layers share one window, Mistral's, is one group, as it always was).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gapless.kv.block_pool import BlockPool


@dataclass
class KVGroup:
    """The blocks of one group of layers, as the scheduler allocates them."""

    pool: BlockPool
    window: int | None  # None: full attention


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int | None, ...]  # each group's window, group 0 first
    layers: tuple[tuple[int, ...], ...]  # each group's layers

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> LayerGroups:
        distinct = set(layer_windows)
        first = None if None in distinct else max(distinct)  # type: ignore[type-var]
        windows = (first, *sorted(distinct - {first}, reverse=True))  # type: ignore[type-var]
        layers = tuple(
            tuple(i for i, w in enumerate(layer_windows) if w == window) for window in windows
        )
        return cls(windows, layers)

    def bytes_per_token(self, per_layer: int) -> list[int]:
        """Each group's KV bytes per token, given one layer's."""
        return [per_layer * len(layers) for layers in self.layers]


def first_needed_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position`, or any later one, reads in a layer with this
    window."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def window_blocks(window: int, tokens: int, block_size: int) -> int:
    """The most blocks a sliding group holds for a sequence whose step brings `tokens` new
    ones: its first query's window-1 keys back and the new tokens, over one more block where
    they straddle block edges."""
    return -(-(window - 1 + tokens) // block_size) + 1


def split_blocks(
    groups: LayerGroups,
    block_size: int,
    bytes_per_token: Sequence[int],
    max_num_seqs: int,
    max_step_tokens: int,
    max_model_len: int,
    kv_tokens: int | None,
    kv_bytes: int,
) -> tuple[int, tuple[int, ...]]:
    """Each group's blocks: group 0's, and the sliding groups'. A sliding group gets what every
    running sequence's window needs at once, plus one step's new tokens, or one whole
    prompt's (a prompt prefilled in one step); never more than group 0 (no sequence holds more
    blocks there). So the sliding groups are not what limits the batch, and the rest of the
    budget goes to group 0: `kv_tokens` tokens there, or what `kv_bytes` holds after the
    sliding groups' share, but no more than every running sequence at full context."""
    bs = block_size
    seq_blocks = -(-max_model_len // bs)
    cap = max_num_seqs * seq_blocks
    step_blocks = -(-max_step_tokens // bs)
    wanted = [
        max(max_num_seqs * window_blocks(w, 1, bs) + step_blocks, seq_blocks + 1)
        for w in groups.windows[1:]
    ]
    if kv_tokens is not None:
        full = -(-kv_tokens // bs)
    else:
        per_block = [b * bs for b in bytes_per_token]
        sliding_bytes = sum(n * b for n, b in zip(wanted, per_block[1:], strict=True))
        full = (kv_bytes - sliding_bytes) // per_block[0]
        if any(n > full for n in wanted):
            # Too little for every window: the groups share the budget block for block,
            # as they would with no sliding group (their blocks are still freed early).
            full = kv_bytes // sum(per_block)
        full = min(full, cap)
    return full, tuple(min(n, full) for n in wanted)
