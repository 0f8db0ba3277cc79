"""The decoder every family runs: embedding, the family's layers, final norm and lm_head, over a
ragged mixed batch.

A step's batch is flat: the new tokens of every sequence are concatenated, whether a sequence
brings one decode token or a chunk of its prompt. Projections and MLPs run once over all of
them; attention reads each sequence's history from the paged KV cache. A family's layer
(model/families/) gets the step's shared pieces from `Step`: the rotations of its rope, the
write of its new K/V and attention over the cache, and the tensor-parallel all-reduce.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from gapless.kernels import AttentionPlan, Kernels, Linear
from gapless.kernels.decode_layers import DecodeLayers, DecodeSpec
from gapless.kernels.lora import Adapters
from gapless.kernels.plans import KVCache
from gapless.kernels.quant import BlockQuant
from gapless.kernels.step_ops import apply_rope as apply_rope  # the families' seam
from gapless.kernels.step_ops import rms_norm, write_kv
from gapless.model.config import ModelConfig
from gapless.model.parallel import TensorParallel
from gapless.model.pipeline import Stage

# The decoder logs one line, the decode call's `kernels:` report, beside the kernels' own.
log = logging.getLogger("gapless.kernels")


@dataclass
class BatchInput:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] KV-cache slot of each new token
    attention: list[AttentionPlan]  # how each part of the batch attends (kernels/plans.py)
    logit_rows: torch.Tensor  # rows whose logits are returned
    # The write slots and plans of the layers with each of these windows, whose K/V lies in
    # blocks of their own (a sliding-window KV group: kv/groups.py); other layers' are
    # write_slots and attention.
    windows: dict[int | None, tuple[torch.Tensor, list[AttentionPlan]]] = field(
        default_factory=dict
    )
    # Rows whose hidden states after the final norm forward also keeps, float32, in `hidden`
    # (embeddings); None: none.
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # Rows whose input is given instead of looked up: (rows [N], embeddings [N, hidden]), an
    # image's embeddings at its placeholder tokens (model/vision.py); None: none.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE's (t, h, w) positions [3, T] (Qwen2.5-VL: an image's tokens on its grid);
    # None: positions on all three.
    rope_positions: torch.Tensor | None = None
    # (adapter index, rows [N]) for each LoRA adapter with rows in the batch (kernels/lora.py);
    # rows on the base model are in none.
    lora_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class RMSNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, rope_type: str = "default", scaling: dict | None = None
) -> torch.Tensor:
    """The inverse frequencies of a rotary embedding over head_dim dims (ROPE_TYPES)."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = scaling or {}
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass(eq=False)
class Rope:
    """One rotary embedding: its inverse frequencies, and a factor on cos and sin (LongRoPE's
    attention factor; 1 elsewhere). Layers with the same rope share one, so that a step
    computes its rotations once. With long_inv_freq (LongRoPE), positions from long_from on
    rotate by those instead. With sections (M-RoPE), runs of that many frequencies rotate by
    the batch's rope_positions t, h, w in turn."""

    inv_freq: torch.Tensor
    scale: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    long_from: int = 0
    sections: tuple[int, ...] | None = None


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class Step:
    """What every layer of one forward shares."""

    batch: BatchInput
    kernels: Kernels
    dtype: torch.dtype
    # Tensor parallel: sums the ranks' partial outputs of a row-split linear (o, down).
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    _rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rotation(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([T, 1, D], see apply_rope) of the batch's positions under
        rope, computed once per step."""
        if (cached := self._rotations.get(id(rope))) is not None:
            return cached
        inv_freq = rope.inv_freq[None, :]
        if rope.long_inv_freq is not None:
            long = (self.batch.positions >= rope.long_from)[:, None]
            inv_freq = torch.where(long, rope.long_inv_freq[None, :], inv_freq)
        positions = self.batch.positions.float()[:, None]
        if rope.sections is not None and self.batch.rope_positions is not None:
            axis = [i % 3 for i, n in enumerate(rope.sections) for _ in range(n)]
            positions = self.batch.rope_positions[axis].T.float()  # [T, frequencies]
        freqs = positions * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if rope.scale != 1.0:
            cos, sin = cos * rope.scale, sin * rope.scale
        cos = cos.repeat(1, 2)[:, None, :].to(self.dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(self.dtype)
        self._rotations[id(rope)] = cos, signed_sin
        return cos, signed_sin

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes the batch's new keys and values k, v [T, Hkv, D] into this layer's cache,
        then attends the queries q [T, H, D] (scaled by D ** -0.5) over it, within window;
        softcap: scores become softcap * tanh(scores / softcap) (Gemma 2); sinks [H]: a
        logit per head that joins the softmax's denominator (gpt-oss). Returns [T, H * D]."""
        batch = self.batch
        slots, plans = batch.windows.get(window, (batch.write_slots, batch.attention))
        k, v = write_kv(k, v, *kv_cache, slots)
        return self.kernels.attention(q, k, v, kv_cache, plans, window, softcap, sinks)


class Layer(Protocol):
    """A family's decoder layer."""

    def forward(self, x: torch.Tensor, step: Step, kv_cache: KVCache) -> torch.Tensor:
        """The hidden states x [T, hidden] after this layer; writes its K/V to kv_cache."""
        ...


@dataclass
class Body:
    """What a family builds from its weights, for the Decoder to run between the embedding
    lookup and lm_head; embed_scale and logit_softcap as Decoder's."""

    layers: list[Layer]
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    embed_scale: float | None = None
    logit_softcap: float | None = None


def _decode_spec(layer: Layer) -> DecodeSpec | str:
    """The layer as data for the decode call (its family's decode_spec), or why it is not."""
    if (spec := getattr(layer, "decode_spec", None)) is not None:
        return spec()
    family = type(layer).__module__.rsplit(".", 1)[-1]
    return f"{family}.{type(layer).__qualname__} gives no decode spec"


class Decoder:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor | BlockQuant | None,
        layers: list[Layer],
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Linear | None,
        kernels: Kernels,
        parallel: TensorParallel | None = None,
        embed_scale: float | None = None,
        logit_softcap: float | None = None,
        stage: Stage | None = None,
        classifier: torch.Tensor | None = None,
    ) -> None:
        """embed_scale: a factor on the embeddings, in their dtype (Gemma's sqrt(hidden));
        logit_softcap: logits become cap * tanh(logits / cap) (Gemma 2). stage: the pipeline
        stage this decoder is (layers: its own; embed only on the first, lm_head only on the
        last); config stays the whole model's. classifier: a sequence classifier's head
        `score.weight`, float32 [num_labels, hidden], which it has in place of lm_head
        (engine/scoring.py reads it)."""
        self.config = config
        self.kernels = kernels
        head = getattr(lm_head, "weight", None)
        tied = config.tie_word_embeddings and isinstance(embed, BlockQuant)
        if tied and isinstance(head, BlockQuant) and head.interleaved:
            # The embeddings' own blocks, which the tied lm_head holds interleaved
            # (Kernels.lm_head): lookups gather rows from them too, and the file's layout is
            # let go: one copy.
            embed = head
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.classifier = classifier
        self.dtype = kernels.dtype
        self.device = kernels.device
        self.parallel = parallel
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale).to(self.dtype)
        self.logit_softcap = logit_softcap
        # Tensor parallel: sums the ranks' partial outputs of o and down; gathers the ranks'
        # vocabulary slices of the logits.
        self.all_reduce = parallel.all_reduce if parallel else _unchanged
        self.gather_vocab = parallel.gather_vocab if parallel else _unchanged
        self.stage = stage
        # The whole model's numbers of the layers held here.
        self.layer_ids = stage.layers if stage else range(config.num_layers)
        # The group's ranks, whatever the split: rank 0 broadcasts each step's inputs on them.
        self.ranks = stage.ranks if stage else parallel
        self.decode_layers = self._decode_layers()
        # The LoRA adapters its layers' linears hold (model/lora.py attaches them); None: none.
        self.adapters: Adapters | None = None

    def _decode_layers(self) -> DecodeLayers | None:
        """Decode steps' layers in one native call, where every layer gives itself as data
        (decode_spec) and the kernels take it; else None, and the log says why."""
        if self.parallel is not None or self.stage is not None:
            built: DecodeLayers | str = "a tensor- or pipeline-parallel rank"
        else:
            built = DecodeLayers.build([_decode_spec(layer) for layer in self.layers], self.kernels)
        if isinstance(built, str):
            log.info("kernels: decode steps' layers on torch ops (%s)", built)
            return None
        log.info("kernels: decode steps' layers in one native call")
        return built

    def forward(self, batch: BatchInput, kv_cache: list[KVCache]) -> torch.Tensor:
        """Runs the batch, writes its K/V into kv_cache, returns float32 logits [R, vocab]
        (and sets batch.hidden when it has hidden_rows). A pipeline stage runs its layers
        between the stages before and after it; there rank 0 returns the last stage's logits,
        and the other stages what they computed (the last its logits, others nothing)."""
        return self.start(batch, kv_cache)()

    @torch.inference_mode()
    def start(self, batch: BatchInput, kv_cache: list[KVCache]) -> Callable[[], torch.Tensor]:
        """forward() in two halves: this one runs what this rank computes of the batch, and
        returns the other, which gives the logits. Only a pipeline's rank 0 has anything left
        to wait for then: the last stage's logits, which it may receive after starting further
        batches (up to one a stage in flight, engine.py)."""
        step = Step(batch, self.kernels, self.dtype, self.all_reduce)
        self._set_lora_rows(batch)
        stage, cfg = self.stage, self.config
        if stage is None or stage.first:
            x = self._embed(batch)
        else:
            x = stage.receive_hidden(len(batch.token_ids), cfg.hidden_size, self.dtype)
        fused, plans = self.decode_layers, (batch.write_slots, batch.attention, batch.windows)
        # The decode call holds the base linears only: a step with adapter rows runs the ops.
        if fused is not None and not batch.lora_groups and fused.takes(*plans):
            x = fused.run(x, kv_cache, *plans, step.rotation)  # type: ignore[arg-type]
        else:
            for layer, cache in zip(self.layers, kv_cache, strict=True):
                x = layer.forward(x, step, cache)
        if stage is None or stage.last:
            logits = self._head(x, batch)
            if stage is not None:
                stage.send_result(logits, batch.hidden)
            return lambda: logits
        sent = stage.send_hidden(x)
        if stage.ranks.rank != 0:
            sent()
            return lambda: x.new_empty(0, cfg.vocab_size)

        def result() -> torch.Tensor:
            sent()
            hidden_rows = None if batch.hidden_rows is None else len(batch.hidden_rows)
            logits, batch.hidden = stage.receive_result(
                len(batch.logit_rows), cfg.vocab_size, hidden_rows, cfg.hidden_size
            )
            return logits

        return result

    @torch.inference_mode()
    def run_layers(self, batch: BatchInput, kv_cache: list[KVCache], which: list[int]) -> None:
        """The batch through only these of this rank's layers, in order, then the head (its
        K/V written, its logits dropped): a step's memory and op caches at a fraction of
        its time (ModelRunner.run_largest_step)."""
        step = Step(batch, self.kernels, self.dtype, self.all_reduce)
        self._set_lora_rows(batch)
        x = self._embed(batch)
        for i in which:
            x = self.layers[i].forward(x, step, kv_cache[i])
        self._head(x, batch)

    def _set_lora_rows(self, batch: BatchInput) -> None:
        """Tells the adapters' linears which rows of this batch each adapter has."""
        if self.adapters is not None:
            self.adapters.groups = batch.lora_groups

    def _embed(self, batch: BatchInput) -> torch.Tensor:
        assert self.embed is not None  # every decoder's but a later pipeline stage's
        if isinstance(self.embed, BlockQuant):  # rows dequantized as they are gathered
            x = self.embed.rows(batch.token_ids, self.dtype)
        else:
            x = F.embedding(batch.token_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if batch.embeds is not None:  # after the scale, which transformers applies to text only
            rows, embeds = batch.embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        return x

    def _head(self, x: torch.Tensor, batch: BatchInput) -> torch.Tensor:
        if batch.hidden_rows is not None:
            batch.hidden = self.final_norm(x.index_select(0, batch.hidden_rows)).float()
        if len(batch.logit_rows) == 0 or self.lm_head is None:
            # Every chunk reads hidden states (embeddings, scores); or a classifier's, which
            # has no lm_head and generates nothing (Intake refuses it): only the start-up
            # step's throwaway row asks it for logits.
            return x.new_zeros(len(batch.logit_rows), self.config.vocab_size, dtype=torch.float32)
        x = self.final_norm(x.index_select(0, batch.logit_rows))
        logits = self.gather_vocab(self.lm_head(x))[:, : self.config.vocab_size].float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
