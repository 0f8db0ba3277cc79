"""One pre-norm decoder for Llama, Mistral, Qwen2 and Qwen3, run over a ragged mixed batch.

A step's batch is flat: the new tokens of every sequence are concatenated, whether a sequence
brings one decode token or a chunk of its prompt. Projections and MLPs run once over all of
them; attention reads each sequence's history from the paged KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gapless.model.config import ModelConfig


class Linear:
    """y = x @ weight.T + bias.

    On CPU the weight is repacked once into oneDNN's blocked layout, tuned for 512-row
    inputs (prompt chunks ran ~10% faster than with the batch-1 layout, decode the same).
    A decode step then streams weights at about 25 GB/s instead of 15 with F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, 512)
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    # oneDNN applies these epilogues inside the matmul: no extra pass over the activations,
    # and no bf16 rounding in between (the MLP ran ~12% faster on 512-token chunks).
    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ weight.T + bias)"""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ weight.T + bias) * other"""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, other, self.weight, self.bias, "mul"
            )
        return F.linear(x, self.weight, self.bias) * other


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused: one matmul instead of three
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one SDPA call.

    rows: the contiguous rows of the flat batch holding these sequences' new tokens (B * n).
    key_blocks: KV-cache blocks each sequence attends to, padded, [B, nb]: whole blocks are
    gathered (one index per block, not per token), and masks drop what is not attended.
    masks: per distinct layer window, an additive mask [B, 1, n, nb * block_size], or None
    when a plain causal mask over fresh keys is exact.
    fold_heads: run the query heads that share a KV head as extra query rows of that head
    (GQA folding). The SDPA kernel then sees 7x the rows per call: 2x faster for decodes and
    short chunks against long histories. Masks of folded groups have n * group rows, each
    query's row repeated group times.
    """

    rows: slice
    num_seqs: int
    num_queries: int  # per sequence
    key_blocks: torch.Tensor
    masks: dict[int | None, torch.Tensor | None]
    fold_heads: bool = False
    # For a long chunk after a history (full attention only): the number of history keys.
    # Attention then runs unmasked over the history and causally over the chunk, merged by
    # log-sum-exp, instead of one masked call: ~1.7x faster for a 4096-token chunk at 4096.
    split_at: int | None = None


@dataclass
class BatchInput:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] KV-cache slot of each new token
    groups: list[AttentionGroup]
    logit_rows: torch.Tensor  # rows whose logits are returned


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Accumulates in float32 like the reference; fewer dispatches than spelling it out.
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (i, i + D/2). signed_sin is sin with its first half negated, so the
    rotation is x * cos + swap_halves(x) * signed_sin: three ops instead of six."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, history: int
) -> torch.Tensor:
    """Attention of a chunk q [B, n, Hkv, G, D] that sees all `history` keys plus itself
    causally, as two unmasked flash calls merged by their log-sum-exps. Returns [B * n, H * D].
    k, v: [B, Hkv, L, D] with the chunk's own keys at history .. history + n."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # CPU only
    b, n, kv_heads, group, dim = q.shape
    # History: every query sees every key; GQA heads folded into rows (query-major).
    folded = q.transpose(1, 2).reshape(b, kv_heads, n * group, dim)
    o_hist, lse_hist = flash(folded, k[:, :, :history], v[:, :, :history])[:2]
    o_hist = o_hist.view(b, kv_heads, n, group, dim)
    lse_hist = lse_hist.view(b, kv_heads, n, group)
    # The chunk itself: causal, heads expanded to match the queries.
    heads = q.flatten(2, 3).transpose(1, 2)
    own_k = k[:, :, history : history + n].repeat_interleave(group, dim=1)
    own_v = v[:, :, history : history + n].repeat_interleave(group, dim=1)
    o_own, lse_own = flash(heads, own_k, own_v, is_causal=True)[:2]
    o_own = o_own.view(b, kv_heads, group, n, dim).transpose(2, 3)
    lse_own = lse_own.view(b, kv_heads, group, n).transpose(2, 3)
    lse = torch.logaddexp(lse_hist, lse_own)
    w_hist = (lse_hist - lse).exp().unsqueeze(-1).to(q.dtype)
    w_own = (lse_own - lse).exp().unsqueeze(-1).to(q.dtype)
    o = o_hist * w_hist + o_own * w_own  # [B, Hkv, n, G, D]
    return o.transpose(1, 2).reshape(b * n, -1)


class Decoder:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[Layer],
        final_norm: torch.Tensor,
        lm_head: Linear,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.inv_freq = rope_inv_freq(config).to(embed.device)
        self.dtype = embed.dtype
        self.device = embed.device

    @torch.inference_mode()
    def forward(
        self, batch: BatchInput, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Runs the batch, writes its K/V into kv_cache, returns float32 logits [R, vocab]."""
        cfg = self.config
        x = F.embedding(batch.token_ids, self.embed)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().repeat(1, 2)[:, None, :].to(self.dtype)
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(self.dtype)
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size = (heads + kv_heads) * head_dim
        for layer, window, (k_cache, v_cache) in zip(
            self.layers, cfg.layer_windows, kv_cache, strict=True
        ):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            # q and k heads side by side, so one rotation covers both.
            qk = qkv[:, :qk_size].view(-1, heads + kv_heads, head_dim)
            v = qkv[:, qk_size:].view(-1, kv_heads, head_dim)
            if layer.q_norm is not None:
                q = rms_norm(qk[:, :heads], layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(qk[:, heads:], layer.k_norm, cfg.rms_norm_eps)
                qk = torch.cat((q, k), dim=1)
            qk = apply_rope(qk, cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            k_cache.flatten(0, 1).index_copy_(0, batch.write_slots, k)
            v_cache.flatten(0, 1).index_copy_(0, batch.write_slots, v)
            attn = self._attention(q, k_cache, v_cache, batch.groups, window)
            x = x + layer.o(attn)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + layer.down(layer.up.times(h, layer.gate.silu(h)))
        x = rms_norm(x[batch.logit_rows], self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(x).float()

    def _attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        groups: list[AttentionGroup],
        window: int | None,
    ) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        out = None
        for g in groups:
            b, n = g.num_seqs, g.num_queries
            # Queries against [B, Hkv, L, D] keys gathered from the paged cache.
            # index_select copies whole blocks ~3x faster than advanced indexing does.
            flat_blocks = g.key_blocks.flatten()
            gk = k_cache.index_select(0, flat_blocks).view(b, -1, kv_heads, dim).transpose(1, 2)
            gv = v_cache.index_select(0, flat_blocks).view(b, -1, kv_heads, dim).transpose(1, 2)
            mask = g.masks[window]
            gq = q[g.rows].view(b, n, kv_heads, group, dim)
            if g.split_at is not None:
                o = split_attention(gq, gk, gv, g.split_at)
            elif g.fold_heads:  # [B, Hkv, n * group, D], rows query-major
                gq = gq.transpose(1, 2).reshape(b, kv_heads, n * group, dim)
                o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask)
                o = o.view(b, kv_heads, n, group, dim).transpose(1, 2).reshape(b * n, -1)
            else:  # [B, H, n, D]
                gq = gq.flatten(2, 3).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    gq, gk, gv, attn_mask=mask, is_causal=mask is None, enable_gqa=True
                )
                o = o.transpose(1, 2).reshape(b * n, -1)
            if len(groups) == 1:
                return o
            if out is None:
                out = q.new_empty(q.shape[0], heads * dim)
            out[g.rows] = o
        return out
