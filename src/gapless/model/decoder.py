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

from gapless.kernels import AttentionPlan, Kernels, Linear
from gapless.model.config import ModelConfig
from gapless.model.parallel import TensorParallel


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
class BatchInput:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] KV-cache slot of each new token
    attention: list[AttentionPlan]  # how each part of the batch attends (kernels/plans.py)
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


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


class Decoder:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[Layer],
        final_norm: torch.Tensor,
        lm_head: Linear,
        kernels: Kernels,
        parallel: TensorParallel | None = None,
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.inv_freq = rope_inv_freq(config).to(embed.device)
        self.dtype = embed.dtype
        self.device = embed.device
        self.parallel = parallel
        # Tensor parallel: sums the ranks' partial outputs of o and down; gathers the ranks'
        # vocabulary slices of the logits.
        self.all_reduce = parallel.all_reduce if parallel else _unchanged
        self.gather_vocab = parallel.gather_vocab if parallel else _unchanged

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
            q, k, v = qk[:, :heads], qk[:, heads:].to(k_cache.dtype), v.to(v_cache.dtype)
            k_cache.flatten(0, 1).index_copy_(0, batch.write_slots, k)
            v_cache.flatten(0, 1).index_copy_(0, batch.write_slots, v)
            attn = self.kernels.attention(q, k, v, (k_cache, v_cache), batch.attention, window)
            x = x + self.all_reduce(layer.o(attn))
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + self.all_reduce(layer.down(layer.up.times(h, layer.gate.silu(h))))
        x = rms_norm(x[batch.logit_rows], self.final_norm, cfg.rms_norm_eps)
        return self.gather_vocab(self.lm_head(x))[:, : cfg.vocab_size].float()
