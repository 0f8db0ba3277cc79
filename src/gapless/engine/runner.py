"""Turns a step's scheduled chunks into one ragged batch and runs the model on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gapless.engine.scheduler import ScheduledChunk
from gapless.model.decoder import AttentionGroup, BatchInput, Decoder
from gapless.model.parallel import RankFailed


@dataclass
class ChunkInput:
    """What the forward needs of one scheduled chunk. Under tensor parallelism this is what
    rank 0 broadcasts each step: every rank derives the same batch from it (masks included,
    which would be far larger to send)."""

    token_ids: list[int]
    start: int  # the position of the first token
    block_table: list[int]  # the sequence's blocks, up to the one its last token is in
    all_logits: bool  # return the logits of every token, not only the last one's

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) if self.all_logits else 1


class ModelRunner:
    # A runner that cannot prefill in chunks sets this False; the engine then prefills every
    # prompt whole.
    supports_chunked_prefill = True

    def __init__(self, decoder: Decoder, num_blocks: int, block_size: int) -> None:
        cfg = decoder.config
        self.decoder = decoder
        self.kernels = decoder.kernels
        self.full_attention = all(w is None for w in cfg.layer_windows)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = sorted(set(cfg.layer_windows), key=lambda w: -1 if w is None else w)
        self.max_window = cfg.max_window
        self.head_group = cfg.num_heads // cfg.num_kv_heads
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: padded attention reads masked slots, and 0 * NaN would poison it.
        self.kv_cache = [
            (
                torch.zeros(shape, dtype=self.kernels.kv_dtype, device=decoder.device),
                torch.zeros(shape, dtype=self.kernels.kv_dtype, device=decoder.device),
            )
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_token(decoder: Decoder) -> int:
        cfg = decoder.config
        return (
            2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * decoder.kernels.kv_dtype.itemsize
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the K/V of block src into block dst, for each (src, dst)."""
        if not pairs:
            return
        src, dst = (torch.tensor(p, device=self.decoder.device) for p in zip(*pairs, strict=True))
        for keys, values in self.kv_cache:
            keys[dst] = keys[src]
            values[dst] = values[src]

    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int]) -> list[torch.Tensor]:
        """Runs the chunks in one forward pass.

        Returns for each chunk the logits of its last token, or of every token when its index
        is in all_logits (prompt logprobs).
        """
        # Decodes go first so that they form one contiguous block of rows: one attention call.
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1)
        inputs = [self._input(chunks[i], i in all_logits) for i in order]
        logits = self.run(inputs).split([c.num_rows for c in inputs])
        by_chunk: list[torch.Tensor] = [logits[0]] * len(chunks)
        for position, i in enumerate(order):
            by_chunk[i] = logits[position]
        return by_chunk

    def run(self, inputs: list[ChunkInput]) -> torch.Tensor:
        """One forward over the inputs' rows. Under tensor parallelism, rank 0 first sends
        them to the other ranks, which call this with them; then any failure is a rank's."""
        parallel = self.decoder.parallel
        if parallel is None:
            return self.decoder.forward(self._build(inputs), self.kv_cache)
        try:
            if parallel.rank == 0:
                parallel.broadcast(inputs)
            return self.decoder.forward(self._build(inputs), self.kv_cache)
        except Exception as exc:
            raise RankFailed(parallel.diagnose(exc)) from exc

    def _input(self, chunk: ScheduledChunk, all_logits: bool) -> ChunkInput:
        req, start = chunk.request, chunk.request.num_computed
        end = start + chunk.num_tokens
        table = req.block_table[: -(-end // self.block_size)]
        return ChunkInput(req.tokens(start, end), start, table, all_logits)

    def _decodes_paged(self) -> bool:
        return self.kernels.decodes_paged(self.decoder.config.head_dim)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _key_start(self, first_query: int) -> int:
        """First key position (block-aligned) that any layer's window lets the query see."""
        if self.max_window is None:
            return 0
        first = max(0, first_query - self.max_window + 1)
        return first - first % self.block_size

    def _build(self, inputs: list[ChunkInput]) -> BatchInput:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logit_rows: list[int] = []
        decode_keys: list[tuple[int, int, list[int]]] = []  # (first key pos, query pos, blocks)
        groups: list[AttentionGroup] = []
        for chunk in inputs:
            start, n = chunk.start, len(chunk.token_ids)
            row = len(token_ids)
            token_ids += chunk.token_ids
            positions += range(start, start + n)
            write_slots += self._slots(chunk.block_table, start, start + n)
            logit_rows += range(row, row + n) if chunk.all_logits else [row + n - 1]
            key_start = self._key_start(start)
            blocks = chunk.block_table[key_start // bs :]
            if n == 1:
                decode_keys.append((key_start, start, blocks))
            else:
                groups.append(self._prefill_group(row, start, n, key_start, blocks))
        # A lone decode sees all its keys, its own included, unmasked.
        lone = decode_keys[0] if len(decode_keys) == 1 and not self._decodes_paged() else None
        if lone and (runs := self._history_runs(lone[1] + 1, lone[2])) is not None:
            groups.insert(0, AttentionGroup(slice(0, 1), 1, 1, None, {}, history_runs=runs))
        elif decode_keys:
            groups.insert(0, self._decode_group(decode_keys))
        dev = self.decoder.device
        return BatchInput(
            token_ids=torch.tensor(token_ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            write_slots=torch.tensor(write_slots, device=dev),
            groups=groups,
            logit_rows=torch.tensor(logit_rows, device=dev),
        )

    def _masks(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, valid: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """Per window: 0 where a query may attend a key (causal, in window, not padding),
        -inf elsewhere."""
        delta = query_pos[..., :, None] - key_pos[..., None, :]
        causal = (delta >= 0) & valid
        allowed = {w: causal if w is None else causal & (delta < w) for w in self.windows}
        # Additive float masks, built once per step: SDPA would convert a bool mask per layer.
        zeros = torch.zeros(causal.shape, dtype=self.kernels.kv_dtype, device=causal.device)
        return {w: zeros.masked_fill(~m, float("-inf")) for w, m in allowed.items()}

    def _history_runs(self, end: int, blocks: list[int]) -> list[tuple[int, int]] | None:
        """The runs of consecutive cache slots holding keys 0 .. end - 1, when the kernels
        attend them in place; else None."""
        if not (self.kernels.in_place_attention and self.full_attention):
            return None
        bs = self.block_size
        runs: list[tuple[int, int]] = []
        for i, block in enumerate(blocks[: -(-end // bs)]):
            keys = min(bs, end - i * bs)  # only the last block can be partly filled
            if runs and sum(runs[-1]) == block * bs:
                runs[-1] = (runs[-1][0], runs[-1][1] + keys)
            else:
                runs.append((block * bs, keys))
        return runs if len(runs) <= self.kernels.max_history_runs else None

    def _prefill_group(
        self, row: int, start: int, n: int, key_start: int, blocks: list[int]
    ) -> AttentionGroup:
        dev = self.decoder.device
        rows = slice(row, row + n)
        if self.kernels.prefills_paged(self.decoder.config.head_dim):
            key_blocks = torch.tensor(blocks, device=dev)[None]
            num_keys = torch.tensor([start + n - key_start], device=dev)
            return AttentionGroup(rows, 1, n, key_blocks, {}, num_keys=num_keys)
        fold_max = self.kernels.fold_max_queries
        fresh = start == 0 and n % self.block_size == 0
        if n > fold_max and fresh and all(w is None or w >= n for w in self.windows):
            masks = dict.fromkeys(self.windows)  # whole fresh blocks: plain causal is exact
            return AttentionGroup(rows, 1, n, torch.tensor(blocks, device=dev)[None], masks)
        if start > 0 and (runs := self._history_runs(start, blocks)) is not None:
            return AttentionGroup(rows, 1, n, None, {}, history_runs=runs)
        q_pos = torch.arange(start, start + n, device=dev)
        k_pos = torch.arange(key_start, key_start + len(blocks) * self.block_size, device=dev)
        masks = self._masks(q_pos, k_pos, torch.tensor(True))
        fold = n <= fold_max
        if fold:
            masks = {w: m.repeat_interleave(self.head_group, dim=0) for w, m in masks.items()}
        masks = {w: m[None, None] for w, m in masks.items()}
        key_blocks = torch.tensor(blocks, device=dev)[None]
        return AttentionGroup(rows, 1, n, key_blocks, masks, fold)

    def _decode_group(self, keys: list[tuple[int, int, list[int]]]) -> AttentionGroup:
        """The decodes, which come first in the batch: rows 0 .. len(keys) - 1."""
        dev = self.decoder.device
        width = max(len(blocks) for _, _, blocks in keys)
        # Padding points at block 0 and is never attended: masks drop it, and positions past
        # the query, or on our kernel num_keys stops before it.
        padded = [blocks + [0] * (width - len(blocks)) for _, _, blocks in keys]
        key_blocks = torch.tensor(padded, device=dev)
        b = len(keys)
        if self._decodes_paged():
            num_keys = torch.tensor([q - k0 + 1 for k0, q, _ in keys], device=dev)
            return AttentionGroup(slice(0, b), b, 1, key_blocks, {}, num_keys=num_keys)
        offsets = torch.arange(width * self.block_size, device=dev)
        k_pos = torch.tensor([k0 for k0, _, _ in keys], device=dev)[:, None] + offsets[None, :]
        q_pos = torch.tensor([q for _, q, _ in keys], device=dev)[:, None]
        # [B, 1, 1, L]: one query per sequence, so a folded group's rows share it by broadcast.
        masks = {w: m[:, None] for w, m in self._masks(q_pos, k_pos, torch.tensor(True)).items()}
        return AttentionGroup(slice(0, b), b, 1, key_blocks, masks, True)
