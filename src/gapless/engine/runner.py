"""Turns a step's scheduled chunks into one ragged batch and runs the model on it."""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gapless.engine.plan import ScheduledChunk
from gapless.engine.request import Request
from gapless.kernels import AttentionLayout, AttentionPlan, Span, kv_cache_name, kv_cache_row
from gapless.kernels.plans import int64s
from gapless.kv.groups import LayerGroups, first_needed_block
from gapless.model.decoder import BatchInput, Decoder
from gapless.model.parallel import RankFailed
from gapless.model.vision import MediaRegion, VisionEncoder, chunk_embeds, mrope_slice

# The runner logs one line, the KV cache's `kernels:` report, beside the kernels' own.
log = logging.getLogger("gapless.kernels")


@dataclass
class ChunkInput:
    """What the forward needs of one scheduled chunk. Under tensor parallelism this is what
    rank 0 broadcasts each step: every rank derives the same batch from it (masks included,
    which would be far larger to send)."""

    token_ids: list[int]
    start: int  # the position of the first token
    block_table: list[int]  # the sequence's blocks, up to the one its last token is in
    all_logits: bool  # return the logits of every token, not only the last one's
    # An embedding request's chunk returns, instead of logits, its hidden states after the
    # final norm: its last token's ("last") or the sum of its tokens' ("sum").
    hidden: str | None = None
    # Each token attends as a decode of its own (a draft's verification), so that its row is
    # computed exactly as a plain decode at its position computes it.
    decodes: bool = False
    # The images' embeddings at the chunk's rows (rows counted from its first), if any.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE's (t, h, w) positions [3, tokens]; None: each token's position.
    rope_positions: torch.Tensor | None = None
    # The images in the chunk whose tokens attend to each other both ways, as position ranges
    # (first, end); the scheduler ends each within its chunk (Span.bidirectional).
    bidirectional: tuple[tuple[int, int], ...] = ()
    # The sequence's blocks in each sliding-window KV group of a runner that groups its layers
    # (kv/groups.py), as block_table; -1 where the window has passed.
    window_tables: tuple[list[int], ...] = ()
    # The index of the LoRA adapter it runs on (Decoder.adapters); -1: the base model.
    adapter: int = -1

    @property
    def num_rows(self) -> int:
        """Its logit rows: none where it reads hidden states instead (no vocabulary product)."""
        if self.hidden is not None:
            return 0
        return len(self.token_ids) if self.all_logits else 1

    @property
    def num_hidden_rows(self) -> int:
        if self.hidden is None:
            return 0
        return 1 if self.hidden == "last" else len(self.token_ids)


@dataclass
class CopyBlocks:
    """Rank 0's message to the other ranks: copy these blocks (ModelRunner.copy_blocks)."""

    pairs: list[list[tuple[int, int]]]


class ModelRunner:
    # A runner that cannot prefill in chunks sets this False; the engine then prefills every
    # prompt whole.
    supports_chunked_prefill = True

    def __init__(
        self,
        decoder: Decoder,
        num_blocks: int,
        block_size: int,
        encoder: VisionEncoder | None = None,
        window_blocks: tuple[int, ...] = (),
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """window_blocks: the blocks of each sliding-window KV group but the first, for a
        runner that keeps a hybrid model's layers in groups (kv/groups.py; the scheduler's
        window_groups); num_blocks are then the first group's. Empty: every layer keeps its
        K/V in num_blocks blocks of one block table. kv_cache_dtype: the cache's storage
        type (Kernels.kv_cache_dtype resolves --kv-cache-dtype); None: the attention dtype."""
        cfg = decoder.config
        self.decoder = decoder
        self.encoder = encoder  # a vision-language model's: encodes a prompt's images
        self.kernels = decoder.kernels
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_blocks = window_blocks
        self.kv_cache_dtype = kv_cache_dtype or self.kernels.attention_dtype
        grouped = bool(window_blocks)
        self.groups = LayerGroups((cfg.max_window,), (tuple(range(cfg.num_layers)),))
        if grouped:
            self.groups = LayerGroups.of(cfg.layer_windows)
        if len(self.groups.layers) != 1 + len(window_blocks):
            raise ValueError(
                f"the model has {len(self.groups.layers) - 1} sliding-window KV groups,"
                f" window_blocks {len(window_blocks)}"
            )
        windows = [(w,) for w in self.groups.windows] if grouped else [tuple(cfg.layer_windows)]
        head_group = cfg.num_heads // cfg.num_kv_heads
        self.layouts = [  # each KV group's
            AttentionLayout(
                block_size, w, cfg.head_dim, head_group, decoder.device, self.kv_cache_dtype
            )
            for w in windows
        ]
        self._kv_memory: list[mmap.mmap] = []  # the CPU cache's pages (see _zeroed)
        caches = {}
        own = decoder.layer_ids  # a pipeline stage keeps its own layers' K/V only
        for blocks, layers in zip((num_blocks, *window_blocks), self.groups.layers, strict=True):
            row = kv_cache_row(cfg.head_dim, self.kv_cache_dtype)
            shape = (blocks, block_size, cfg.num_kv_heads, row)
            for layer in filter(own.__contains__, layers):
                caches[layer] = (self._zeroed(shape), self._zeroed(shape))
        self.layer_caches = caches  # by the whole model's layer number
        self.kv_cache = [caches[layer] for layer in own]
        layout = self.layouts[0]
        decodes = (
            "our paged kernel"
            if self.kernels.decodes_paged(cfg.head_dim, layout.cache_dtype)
            else "sdpa"
        )
        log.info(
            "kernels: %s KV cache, %s attention, decodes on %s",
            kv_cache_name(self.kv_cache_dtype),
            kv_cache_name(self.kernels.attention_dtype),
            decodes,
        )

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed tensor for the KV cache (zeroed, not empty: padded attention reads masked
        slots, and 0 * NaN would poison it). On the CPU it lies in private anonymous pages,
        which the OS maps as zeros and makes resident only when written: the cache costs
        memory as far as sequences have filled it, however much is reserved, as llama.cpp's
        does (SmolLM2's 16k tokens are 360 MiB reserved, a few MiB resident after start)."""
        dtype, device = self.kv_cache_dtype, self.decoder.device
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        memory = mmap.mmap(
            -1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        self._kv_memory.append(memory)
        return torch.frombuffer(memory, dtype=dtype).view(shape)

    @staticmethod
    def kv_bytes_per_token(decoder: Decoder, kv_cache_dtype: torch.dtype | None = None) -> int:
        layers = decoder.config.num_layers
        return layers * ModelRunner.kv_bytes_per_layer_token(decoder, kv_cache_dtype)

    @staticmethod
    def kv_bytes_per_layer_token(
        decoder: Decoder, kv_cache_dtype: torch.dtype | None = None
    ) -> int:
        """K and V of one token in one layer, in a cache of this storage type (None: the
        attention dtype, as ModelRunner's): int8 is q8_0's 34 bytes per 32 values."""
        cfg, dtype = decoder.config, kv_cache_dtype or decoder.kernels.attention_dtype
        return 2 * cfg.num_kv_heads * kv_cache_row(cfg.head_dim, dtype) * dtype.itemsize

    def run_largest_step(self, num_tokens: int, context: int) -> None:
        """Runs one throwaway chunk of num_tokens ending at position context, then zeroes the
        cache it wrote. With context the longest a sequence gets, this is the step with the
        most activations and the widest attention masks."""
        bs, start = self.block_size, context - num_tokens
        table, *window_tables = [
            [-1] * (first := first_needed_block(start, window, bs))
            + list(range(-(-context // bs) - first))
            for window in self.groups.windows[: 1 + len(self.window_blocks)]
        ]
        inputs = [
            ChunkInput([0] * num_tokens, start, table, False, window_tables=(*window_tables,))
        ]
        if self.decoder.ranks is None:
            # One layer of each kind (window, and dense or sparse MLP) is enough: layers run
            # one after another and free what they allocate, so one reaches the step's
            # high-water mark. The whole step held the default model's first answer for 9.3 s
            # on 2 Zen 4 cores.
            decoder = self.decoder
            kinds = zip(decoder.config.layer_windows, map(type, decoder.layers), strict=True)
            first = {kind: i for i, kind in reversed(list(enumerate(kinds)))}
            decoder.run_layers(self._build(inputs), self.kv_cache, sorted(first.values()))
        else:  # every rank takes the whole step
            self.run(inputs)
        if self._kv_memory:  # back to untouched zero pages, resident no more
            for memory in self._kv_memory:
                memory.madvise(mmap.MADV_DONTNEED)
            return
        for keys, values in self.kv_cache:
            keys.zero_()
            values.zero_()

    def copy_blocks(self, pairs: list[list[tuple[int, int]]]) -> None:
        """Copies the K/V of block src into block dst, for each (src, dst) of each KV group;
        on every rank, each in its own cache, when rank 0 asks."""
        ranks = self.decoder.ranks
        if ranks is not None and ranks.rank == 0 and any(pairs):
            try:
                ranks.broadcast(CopyBlocks(pairs))
            except Exception as exc:
                raise RankFailed(ranks.diagnose(exc)) from exc
        for group_pairs, layers in zip(pairs, self.groups.layers, strict=False):
            if not group_pairs:
                continue
            dev = self.decoder.device
            src, dst = (torch.tensor(p, device=dev) for p in zip(*group_pairs, strict=True))
            for layer in filter(self.layer_caches.__contains__, layers):
                keys, values = self.layer_caches[layer]
                keys[dst] = keys[src]
                values[dst] = values[src]

    def blocks_kv(self, group: int, blocks: list[int]) -> torch.Tensor:
        """A copy of some blocks' K/V in one KV group, [blocks, layers, 2, block_size,
        kv_heads, row]: what the disk tier stores, a block each (kv/disk.py). One gather per
        layer, not per block: a long prompt's blocks are copied out in the step that
        completes it."""
        index = torch.tensor(blocks, device=self.decoder.device)
        layers = [self.layer_caches[layer] for layer in self.groups.layers[group]]
        kv = torch.stack([torch.stack((k[index], v[index]), 1) for k, v in layers], 1)
        return kv.cpu()

    def load_blocks(self, group: int, blocks: list[int], kvs: list[torch.Tensor]) -> None:
        """Writes K/V that blocks_kv gave, one tensor per block, into these blocks of one KV
        group: stacked layer-major, so that each layer's scatter copies contiguous rows."""
        index = torch.tensor(blocks, device=self.decoder.device)
        kv = torch.stack(kvs, 2).to(self.decoder.device)  # [layers, 2, blocks, ...]
        for i, layer in enumerate(self.groups.layers[group]):
            keys, values = self.layer_caches[layer]
            keys.index_copy_(0, index, kv[i, 0])
            values.index_copy_(0, index, kv[i, 1])

    def block_shapes(self) -> list[tuple[int, ...]]:
        """Each KV group's shape of one block in blocks_kv."""
        keys = [self.layer_caches[layers[0]][0] for layers in self.groups.layers]
        return [
            (len(layers), 2, *k.shape[1:])
            for layers, k in zip(self.groups.layers, keys, strict=True)
        ]

    def execute(self, chunks: list[ScheduledChunk], all_logits: set[int]) -> list[torch.Tensor]:
        """Runs the chunks in one forward pass.

        Returns for each chunk the logits of its last token, or of every token when its index
        is in all_logits (prompt logprobs) or it carries a draft (proposed tokens: each row
        verifies the next, computed as a decode at its position). An embedding request's
        chunk returns instead its hidden states after the final norm, float32 [1, hidden]: its
        last token's (pooling `last`), or the sum of its tokens' (`mean`).
        """
        return self.launch(chunks, all_logits)()

    def launch(
        self, chunks: list[ScheduledChunk], all_logits: set[int]
    ) -> Callable[[], list[torch.Tensor]]:
        """execute() in two halves: this one sends the chunks on and runs this rank's part of
        their forward; the one it returns gives what execute() returns. Between the two, a
        pipeline's rank 0 may launch other chunks: never a decode of a request in flight (its
        next token needs this one), but a prompt's next chunk, which starts at num_scheduled;
        every stage runs the chunks in launch order, so it has written this chunk's K/V first."""
        # Decodes (and verifications, which attend as decodes) go first so that they form one
        # contiguous block of rows: one attention call.
        order = sorted(
            range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1 and not chunks[i].draft
        )
        inputs = [self._input(chunks[i], i in all_logits) for i in order]
        pending = self.start(inputs)

        def by_chunk() -> list[torch.Tensor]:
            all_logits_rows, all_hidden = pending()
            logits = all_logits_rows.split([c.num_rows for c in inputs])
            hidden = ()
            if all_hidden is not None:
                hidden = all_hidden.split([c.num_hidden_rows for c in inputs])
            rows: list[torch.Tensor] = [logits[0]] * len(chunks)
            for position, i in enumerate(order):
                if inputs[position].hidden is None:
                    rows[i] = logits[position]
                else:  # one row for "last"
                    rows[i] = hidden[position].sum(0, keepdim=True)
            return rows

        return by_chunk

    def run(self, inputs: list[ChunkInput]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over the inputs' rows: the logits of their logit rows, and the hidden
        states of their hidden rows (None if none has any). Under tensor or pipeline
        parallelism, rank 0 first sends them to the other ranks, which call this with them;
        then any failure is a rank's."""
        return self.start(inputs)()

    def start(
        self, inputs: list[ChunkInput]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """run() in two halves (Decoder.start): rank 0's broadcast of the inputs is waited for
        only in the second, so that a pipeline's later stages may take them while rank 0
        runs its stage."""
        parallel = self.decoder.ranks
        sent = None
        with self._failures_are_ranks():
            if parallel is not None and parallel.rank == 0:
                sent = parallel.post(inputs)
            batch = self._build(inputs)
            logits = self.decoder.start(batch, self.kv_cache)

        def result() -> tuple[torch.Tensor, torch.Tensor | None]:
            with self._failures_are_ranks():
                if sent is not None:
                    sent()
                return logits(), batch.hidden

        return result

    @contextmanager
    def _failures_are_ranks(self) -> Iterator[None]:
        """Under tensor or pipeline parallelism any failure of a forward is a rank's: the
        ranks' collectives are out of step, and no further step can run."""
        parallel = self.decoder.ranks
        try:
            yield
        except Exception as exc:
            if parallel is None:
                raise
            raise RankFailed(parallel.diagnose(exc)) from exc

    def _input(self, chunk: ScheduledChunk, all_logits: bool) -> ChunkInput:
        req, start = chunk.request, chunk.request.num_scheduled
        end = start + chunk.num_tokens
        blocks = -(-end // self.block_size)
        table = req.kv.block_table[:blocks]
        hidden = None
        if req.pooling is not None:
            hidden = "sum" if req.pooling == "mean" else "last"
        tokens = req.tokens(start, end - len(chunk.draft)) + chunk.draft
        verify = bool(chunk.draft)
        rope = None if req.rope_positions is None else mrope_slice(req.rope_positions, start, end)
        whole = tuple(
            (image.start, image.end)
            for image in req.images
            if image.bidirectional and image.start < end and start < image.end
        )
        return ChunkInput(
            tokens,
            start,
            table,
            all_logits or verify,
            hidden,
            verify,
            self._image_embeds(req, start, end),
            rope,
            whole,
            tuple(t[:blocks] for t in req.kv.window_tables),
            self._adapter_index(req.params.adapter),
        )

    def _adapter_index(self, name: str | None) -> int:
        adapters = self.decoder.adapters
        return -1 if name is None or adapters is None else adapters.names.index(name)

    @torch.inference_mode()
    def encode(self, chunk: ScheduledChunk) -> None:
        """Runs the encode work the scheduler put in this step (chunk.encodes), before the
        step's forward (the engine calls it once per chunk): an image's embeddings stay on
        the request until its prompt passes them, its encode in progress until it completes."""
        req = chunk.request
        for i, units in chunk.encodes:
            encode = req.image_encodes.get(i)
            if encode is None:
                encode = req.image_encodes[i] = self.encoder.encode_steps(req.images[i].image)
            try:
                done = encode.advance(units)
            except Exception:
                del req.image_encodes[i]  # its generator is closed: a retry starts it again
                raise
            if done:
                req.image_embeds[i] = req.image_encodes.pop(i).finish()

    def _image_embeds(
        self, req: Request, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chunk's slices of the images it reaches, each encoded in this step or before."""
        regions = []
        for i, image in enumerate(req.images):
            if image.start < end and start < image.end:
                regions.append(MediaRegion(image.start, req.image_embeds[i], image.key))
        return chunk_embeds(regions, start, end)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _group_inputs(
        self, slots: list[int], spans: list[Span], layout: AttentionLayout
    ) -> tuple[torch.Tensor, list[AttentionPlan]]:
        """A KV group's write slots and attention plans."""
        dev = self.decoder.device
        return int64s(slots, dev), self.kernels.plan_attention(layout, spans)

    def _build(self, inputs: list[ChunkInput]) -> BatchInput:
        token_ids: list[int] = []
        positions: list[int] = []
        groups = len(self.layouts)
        write_slots: list[list[int]] = [[] for _ in range(groups)]  # per KV group
        logit_rows: list[int] = []
        hidden_rows: list[int] = []
        spans: list[list[Span]] = [[] for _ in range(groups)]
        embed_rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        mrope = any(chunk.rope_positions is not None for chunk in inputs)
        rope_positions: list[torch.Tensor] = []
        lora_rows: dict[int, list[int]] = {}  # by adapter index
        for chunk in inputs:
            start, n = chunk.start, len(chunk.token_ids)
            row = len(token_ids)
            if chunk.embeds is not None:
                embed_rows.append(chunk.embeds[0] + row)
                embeds.append(chunk.embeds[1])
            if mrope:  # a prompt without images rotates every section by its position
                plain = torch.arange(start, start + n).expand(3, -1)
                rope_positions.append(
                    plain if chunk.rope_positions is None else chunk.rope_positions
                )
            if chunk.adapter >= 0:
                lora_rows.setdefault(chunk.adapter, []).extend(range(row, row + n))
            token_ids += chunk.token_ids
            positions += range(start, start + n)
            logit_rows += range(row + n - chunk.num_rows, row + n)
            hidden_rows += range(row + n - chunk.num_hidden_rows, row + n)
            tables = (chunk.block_table, *chunk.window_tables)
            for table, slots, group_spans in zip(tables, write_slots, spans, strict=True):
                slots += self._slots(table, start, start + n)
                if chunk.decodes:
                    bs = self.block_size
                    group_spans += [
                        Span(row + i, start + i, 1, table[: (start + i) // bs + 1])
                        for i in range(n)
                    ]
                else:
                    group_spans.append(Span(row, start, n, table, chunk.bidirectional))
        dev = self.decoder.device
        by_group = list(map(self._group_inputs, write_slots, spans, self.layouts))
        return BatchInput(
            token_ids=int64s(token_ids, dev),
            positions=int64s(positions, dev),
            write_slots=by_group[0][0],
            attention=by_group[0][1],
            windows={
                layout.layer_windows[0]: group
                for layout, group in zip(self.layouts[1:], by_group[1:], strict=True)
            },
            logit_rows=int64s(logit_rows, dev),
            hidden_rows=int64s(hidden_rows, dev) if hidden_rows else None,
            embeds=(torch.cat(embed_rows).to(dev), torch.cat(embeds)) if embeds else None,
            rope_positions=torch.cat(rope_positions, dim=1).to(dev) if mrope else None,
            lora_groups=[(a, int64s(rows, dev)) for a, rows in lora_rows.items()],
        )
