"""Attention plans: how each part of a step's batch attends, decided once per step.

The runner hands the kernels the batch's spans (per sequence: its new tokens' rows, how many
tokens it has computed, its KV blocks) and the layout every step shares (block size, layer
windows, heads); `Planner` picks a path for each part and returns its plan, data that the
decoder passes to `Kernels.attention` every layer. Each plan type is one path and runs itself:

- PagedPlan: our C++ kernel (paged.py) walks each sequence's block table in place;
- GatheredPlan: the KV blocks are gathered and attended by SDPA under masks (attention.py);
- InPlacePlan: one sequence's history attended where it lies, run by run, by the CPU flash op
  (attention.py).

A new attention path is one more plan type here, with `attend`, and its choice in `Planner`.

A query sees the keys up to its own position (causal), or, inside a span's bidirectional
range (an image's tokens in Gemma 3), up to the range's last position: every path takes that
bound per query, its "last key", instead of the query's own position. A range must end within
its chunk (the scheduler keeps it whole): the keys after a query are its chunk's own.

Attention-logit soft-capping (Gemma 2) and attention sinks (gpt-oss) are not paths of their
own: no fused op here takes a cap or a sink, and the runner plans a step without knowing the
model. A layer with a cap or sinks passes them to `attend`, and every plan then computes its
scores explicitly over the same keys under the same mask (attention.explicit); without them
each plan runs its fast path, unchanged.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from gapless.kernels import attention, paged

# One layer's keys and values, [blocks, block_size, Hkv, row]: row is D, or for an int8
# cache kv_format's row of codes and scales (kv_format.kv_cache_row).
KVCache = tuple[Tensor, Tensor]


def int64s(values: Sequence[int], device: torch.device) -> Tensor:
    """values as an int64 tensor on device. On the CPU, in place of the Python ints' buffer:
    torch.tensor(list) is four torch ops (~24 of a decode step's ~60 were theirs)."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    cpu = torch.frombuffer(array("q", values), dtype=torch.int64)
    return cpu if device.type == "cpu" else cpu.to(device)


class PathChoices(Protocol):
    """What picking a path reads of the machine's kernels (kernels.Kernels has it)."""

    in_place_attention: bool
    fold_max_queries: int
    max_history_runs: int

    @property
    def attention_dtype(self) -> torch.dtype: ...

    def decodes_paged(self, head_dim: int, cache_dtype: torch.dtype) -> bool: ...

    def prefills_paged(self, head_dim: int, cache_dtype: torch.dtype) -> bool: ...


class AttentionPlan(Protocol):
    rows: slice  # the contiguous rows of the flat batch whose queries this plan attends

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        window: int | None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Attention of the batch's queries q [T, H, D] in this plan's rows, for a layer with
        this window, in q's dtype whatever the cache stores; their own keys and values k, v
        [T, Hkv, D], in q's dtype, are already in the cache (k_cache, v_cache). softcap: scores are soft-capped; sinks [H]:
        a logit per head joins the softmax; either computed explicitly (see the module's
        docstring). Returns [len(rows), H * D]."""
        ...


def _allowed(
    query_pos: Tensor, key_pos: Tensor, window: int | None, last: Tensor | None = None
) -> Tensor:
    """Where queries at query_pos [..., n] may attend keys at key_pos [..., L], [..., n, L]: up
    to each one's last key, `last` [..., n] (None: its own position), and no further back
    than the window from its own position."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]
    seen = k <= (q if last is None else last[..., :, None])
    return seen if window is None else seen & (q - k < window)


@dataclass
class PagedPlan:
    """Sequences with the same number of new queries, attended by our paged kernel (decodes,
    and prompt chunks where it takes them).

    key_blocks: the KV-cache blocks each sequence attends to, padded, [B, nb];
    num_keys: how many keys of its row of key_blocks each sequence has, its new ones
    included, [B]; its queries are the last len(rows) / B of them.
    last_keys: each query's last key [len(rows)], counted from its row's first key as
    num_keys counts; None: its own (causal).
    """

    rows: slice
    key_blocks: Tensor
    num_keys: Tensor
    last_keys: Tensor | None = None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        window: int | None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if softcap is None and sinks is None:
            return paged.paged_attention(
                q[self.rows], *cache, self.key_blocks, self.num_keys, window, self.last_keys
            )
        keys, values = attention.gather_blocks(*cache, self.key_blocks, q.dtype)
        b = self.key_blocks.shape[0]
        n = (self.rows.stop - self.rows.start) // b
        dev = keys.device
        # Positions counted from each sequence's first gathered key: its queries are the last n
        # of its num_keys.
        query_pos = self.num_keys[:, None] - n + torch.arange(n, device=dev)
        last = None if self.last_keys is None else self.last_keys.view(b, n)
        allowed = _allowed(query_pos, torch.arange(keys.shape[1], device=dev), window, last)
        return attention.explicit(q[self.rows], keys, values, allowed, softcap, sinks)


@dataclass
class GatheredPlan:
    """Sequences with the same number of new queries whose attention runs as one SDPA call
    over their gathered KV blocks (see attention.gathered).

    key_blocks: KV-cache blocks each sequence attends to, padded, [B, nb]: whole blocks are
    gathered (one index per block, not per token), and masks drop what is not attended.
    masks: per distinct layer window, an additive mask [B, 1, n, nb * block_size], or None
    when a plain causal mask over fresh keys is exact.
    fold_heads: run the query heads that share a KV head as extra query rows of that head
    (GQA folding). The SDPA kernel then sees 7x the rows per call: 2x faster for decodes and
    short chunks against long histories. Masks of folded plans have n * group rows, each
    query's row repeated group times.
    """

    rows: slice
    num_queries: int  # per sequence, n
    key_blocks: Tensor
    masks: dict[int | None, Tensor | None]
    fold_heads: bool = False

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        window: int | None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        mask, n = self.masks[window], self.num_queries
        if softcap is None and sinks is None:
            return attention.gathered(
                q[self.rows], *cache, self.key_blocks, n, mask, self.fold_heads
            )
        keys, values = attention.gather_blocks(*cache, self.key_blocks, q.dtype)
        if mask is None:  # fresh whole blocks: plain causal
            keys_pos = torch.arange(keys.shape[1], device=keys.device)
            allowed = _allowed(keys_pos[:n], keys_pos, None)[None]
        else:  # [B, 1, rows, L]; a folded chunk's rows are each query's, repeated per head
            mask = mask[:, 0]
            allowed = mask.view(mask.shape[0], n, -1, mask.shape[-1])[:, :, 0] == 0
        return attention.explicit(q[self.rows], keys, values, allowed, softcap, sinks)


@dataclass
class InPlacePlan:
    """One sequence with full attention, its history attended in place (see
    attention.in_place).

    runs: the runs of consecutive slots in the flattened cache, as (first slot, length),
    holding the keys before its new tokens (and, for a decode, its own key). Every query sees
    them all, so they are attended unmasked; a chunk's own tokens attend causally, or up to
    each query's last key, last_keys [n], counted from the chunk's first token.
    """

    rows: slice
    runs: list[tuple[int, int]]
    last_keys: Tensor | None = None

    def _own_allowed(self, n: int, device: torch.device) -> Tensor:
        """Where the chunk's queries may attend its own keys, [n, n]."""
        own = torch.arange(n, device=device)
        return _allowed(own, own, None, self.last_keys)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        window: int | None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        rows = self.rows
        n = rows.stop - rows.start
        if softcap is None and sinks is None:
            own_mask = None
            if self.last_keys is not None:
                own_mask = torch.zeros(n, n, dtype=q.dtype, device=q.device)
                own_mask.masked_fill_(~self._own_allowed(n, q.device), float("-inf"))
            return attention.in_place(q[rows], k[rows], v[rows], *cache, self.runs, own_mask)
        slots = torch.cat([torch.arange(first, first + n) for first, n in self.runs])
        slots = slots.to(q.device)
        keys, values = (
            attention.values(c.flatten(0, 1).index_select(0, slots), q.dtype) for c in cache
        )
        allowed = torch.ones(n, len(slots), dtype=torch.bool, device=q.device)
        if n > 1:  # the chunk's own keys
            keys, values = torch.cat((keys, k[rows])), torch.cat((values, v[rows]))
            allowed = torch.cat((allowed, self._own_allowed(n, q.device)), dim=1)
        return attention.explicit(q[rows], keys[None], values[None], allowed[None], softcap, sinks)


class Span(NamedTuple):
    """One sequence's new tokens in a step's flat batch (a tuple: one is made per sequence
    per step)."""

    row: int  # the row of its first new token
    start: int  # how many tokens it has computed: the position of its first new token
    num_tokens: int
    block_table: list[int]  # its KV blocks, up to the one its last new token is in
    # Ranges of positions (first, end) whose queries see every key of their range, later
    # ones included (an image's tokens in Gemma 3); each ends within the span.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AttentionLayout:
    """What every step's plans share: the KV cache's blocks and the model's attention."""

    block_size: int
    layer_windows: tuple[int | None, ...]  # per layer; None: full attention
    head_dim: int
    head_group: int  # query heads per KV head
    device: torch.device
    cache_dtype: torch.dtype  # the KV cache's storage type (kv_format.KV_CACHE_DTYPES)

    @functools.cached_property
    def windows(self) -> list[int | None]:
        """The distinct layer windows, full attention first: one mask each."""
        return sorted(set(self.layer_windows), key=lambda w: -1 if w is None else w)

    @functools.cached_property
    def max_window(self) -> int | None:
        """The widest window any layer looks back; None if some layer attends to everything."""
        return None if None in self.layer_windows else max(self.layer_windows)  # type: ignore[type-var]

    @functools.cached_property
    def full_attention(self) -> bool:
        return all(w is None for w in self.layer_windows)


@dataclass
class Planner:
    """Picks the path of each part of a step's batch (see the module's docstring)."""

    kernels: PathChoices
    layout: AttentionLayout

    def plan(self, spans: list[Span]) -> list[AttentionPlan]:
        """The batch's plans, one per part, covering every span's rows: every prompt chunk its
        own, the decodes (spans of one token, which must be adjacent rows) one together."""
        plans: list[AttentionPlan] = []
        decodes: list[Span] = []
        for span in spans:
            if span.num_tokens == 1:
                decodes.append(span)
            else:
                plans.append(self._chunk(span))
        if not decodes:
            return plans
        rows = slice(decodes[0].row, decodes[-1].row + 1)
        if rows.stop - rows.start != len(decodes):
            raise ValueError("a batch's decodes must be adjacent rows")
        # A lone decode sees all its keys, its own included, unmasked.
        lone = decodes[0] if len(decodes) == 1 and not self._decodes_paged() else None
        if lone and (runs := self._history_runs(lone.start + 1, self._blocks(lone)[1])) is not None:
            plans.insert(0, InPlacePlan(rows, runs))
        else:
            plans.insert(0, self._decodes(rows, decodes))
        return plans

    def _decodes_paged(self) -> bool:
        return self.kernels.decodes_paged(self.layout.head_dim, self.layout.cache_dtype)

    def _key_start(self, first_query: int) -> int:
        """First key position (block-aligned) that any layer's window lets the query see."""
        window = self.layout.max_window
        if window is None:
            return 0
        first = max(0, first_query - window + 1)
        return first - first % self.layout.block_size

    def _blocks(self, span: Span) -> tuple[int, list[int]]:
        """The first key position the span's queries may see, and the blocks from there."""
        key_start = self._key_start(span.start)
        return key_start, span.block_table[key_start // self.layout.block_size :]

    def _masks(
        self, query_pos: Tensor, key_pos: Tensor, last: Tensor | None = None
    ) -> dict[int | None, Tensor]:
        """Per window: 0 where a query may attend a key (up to its last key, see _allowed; a
        decode's padding lies past it), -inf elsewhere."""
        allowed = {w: _allowed(query_pos, key_pos, w, last) for w in self.layout.windows}
        # Additive float masks, built once per step: SDPA would convert a bool mask per layer.
        shape = next(iter(allowed.values())).shape  # every window's is the same
        zeros = torch.zeros(shape, dtype=self.kernels.attention_dtype, device=query_pos.device)
        return {w: zeros.masked_fill(~m, float("-inf")) for w, m in allowed.items()}

    def _last_keys(self, span: Span) -> Tensor | None:
        """Each of the span's queries' last key position: its own, or in a bidirectional
        range the range's last; None when every one is its own."""
        if not span.bidirectional:
            return None
        start, end = span.start, span.start + span.num_tokens
        last = torch.arange(start, end, device=self.layout.device)
        for first, stop in span.bidirectional:
            if not (first < end and start < stop <= end):
                raise ValueError(
                    f"bidirectional range {first}..{stop} does not end within the chunk "
                    f"{start}..{end}: its later keys would not be in the cache"
                )
            last[max(first, start) - start : stop - start] = stop - 1
        return last

    def _history_runs(self, end: int, blocks: list[int]) -> list[tuple[int, int]] | None:
        """The runs of consecutive cache slots holding keys 0 .. end - 1, when the kernels
        attend them in place; else None."""
        if not (self.kernels.in_place_attention and self.layout.full_attention):
            return None
        bs = self.layout.block_size
        runs: list[tuple[int, int]] = []
        for i, block in enumerate(blocks[: -(-end // bs)]):
            keys = min(bs, end - i * bs)  # only the last block can be partly filled
            if runs and sum(runs[-1]) == block * bs:
                runs[-1] = (runs[-1][0], runs[-1][1] + keys)
            else:
                runs.append((block * bs, keys))
        return runs if len(runs) <= self.kernels.max_history_runs else None

    def _chunk(self, span: Span) -> AttentionPlan:
        """A prompt chunk's plan."""
        layout, dev = self.layout, self.layout.device
        start, n = span.start, span.num_tokens
        rows = slice(span.row, span.row + n)
        key_start, blocks = self._blocks(span)
        key_blocks = torch.tensor(blocks, device=dev)[None]
        last = self._last_keys(span)
        if self.kernels.prefills_paged(layout.head_dim, layout.cache_dtype):
            num_keys = torch.tensor([start + n - key_start], device=dev)
            return PagedPlan(rows, key_blocks, num_keys, None if last is None else last - key_start)
        fold_max = self.kernels.fold_max_queries
        fresh = start == 0 and n % layout.block_size == 0 and last is None
        if n > fold_max and fresh and all(w is None or w >= n for w in layout.windows):
            masks = dict.fromkeys(layout.windows)  # whole fresh blocks: plain causal is exact
            return GatheredPlan(rows, n, key_blocks, masks)
        if start > 0 and (runs := self._history_runs(start, blocks)) is not None:
            return InPlacePlan(rows, runs, None if last is None else last - start)
        q_pos = torch.arange(start, start + n, device=dev)
        k_pos = torch.arange(key_start, key_start + len(blocks) * layout.block_size, device=dev)
        masks = self._masks(q_pos, k_pos, last)
        fold = n <= fold_max
        if fold:
            masks = {w: m.repeat_interleave(layout.head_group, dim=0) for w, m in masks.items()}
        return GatheredPlan(rows, n, key_blocks, {w: m[None, None] for w, m in masks.items()}, fold)

    def _decodes(self, rows: slice, decodes: list[Span]) -> AttentionPlan:
        """The decodes' plan, all in one."""
        dev, bs = self.layout.device, self.layout.block_size
        queries = [s.start for s in decodes]  # each decode's position
        key_starts = [self._key_start(q) for q in queries]
        tables = [s.block_table[k0 // bs :] for s, k0 in zip(decodes, key_starts, strict=True)]
        width = max(map(len, tables))
        # Padding points at block 0 and is never attended: masks drop it, and positions past
        # the query, or on our kernel num_keys stops before it.
        padded = [b for t in tables for b in (*t, *[0] * (width - len(t)))]
        key_blocks = int64s(padded, dev).view(len(tables), width)
        if self._decodes_paged():
            keys = [q - k0 + 1 for k0, q in zip(key_starts, queries, strict=True)]
            return PagedPlan(rows, key_blocks, int64s(keys, dev))
        offsets = torch.arange(width * bs, device=dev)
        k_pos = torch.tensor(key_starts, device=dev)[:, None] + offsets[None, :]
        q_pos = torch.tensor(queries, device=dev)[:, None]
        # [B, 1, 1, L]: one query per sequence, so a folded plan's rows share it by broadcast.
        masks = {w: m[:, None] for w, m in self._masks(q_pos, k_pos).items()}
        return GatheredPlan(rows, 1, key_blocks, masks, True)
