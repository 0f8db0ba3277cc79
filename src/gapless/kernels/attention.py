"""Attention over the paged KV cache, for one part of a ragged batch (its plan: plans.py).

Two implementations:
- gathered (public ops): the group's KV blocks are copied out of the cache with one
  index_select, then one F.scaled_dot_product_attention call with the group's mask;
- in place (the CPU flash op, which returns log-sum-exps): a single full-attention
  sequence attends its history straight from the cache, one unmasked call per run of
  consecutive cache slots, and its own new tokens causally (or under a mask); the parts are
  merged by their log-sum-exps (as in flash attention's own blocked loop). No copy of the
  history, which grows with every step of a long conversation.

Both compute in q's dtype over a cache stored in any of kv_format.KV_CACHE_DTYPES: what they
read of it is converted first (`values`), per gathered batch of blocks or per run; a cache
in q's dtype is read as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gapless.kernels.kv_format import dequantize_q8, is_int8_rows


def values(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values read from the cache, [..., row] in its storage type, as [..., D] in
    dtype: int8 rows dequantized (kv_format), floats converted; no copy where already."""
    if is_int8_rows(cached.dtype):
        return dequantize_q8(cached, dtype)
    return cached if cached.dtype == dtype else cached.to(dtype)


def gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_blocks: torch.Tensor,
    n: int,
    mask: torch.Tensor | None,
    fold_heads: bool,
) -> torch.Tensor:
    """B sequences' n new queries each, q [B * n, H, D], attend the KV blocks key_blocks
    [B, nb] under mask (None: causal), heads folded or not (see plans.GatheredPlan).
    Returns [B * n, H * D]."""
    b, dim = key_blocks.shape[0], q.shape[-1]
    kv_heads = k_cache.shape[2]
    group = q.shape[1] // kv_heads
    keys, vals = gather_blocks(k_cache, v_cache, key_blocks, q.dtype)
    k, v = keys.transpose(1, 2), vals.transpose(1, 2)  # [B, Hkv, L, D]
    q = q.view(b, n, kv_heads, group, dim)
    if fold_heads:  # [B, Hkv, n * group, D], rows query-major
        q = q.transpose(1, 2).reshape(b, kv_heads, n * group, dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.view(b, kv_heads, n, group, dim).transpose(1, 2).reshape(b * n, -1)
    q = q.flatten(2, 3).transpose(1, 2)  # [B, H, n, D]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return o.transpose(1, 2).reshape(b * n, -1)


def in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: list[tuple[int, int]],
    own_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's n new queries q [n, H, D] see every key in `runs` (first slot, length)
    of the flat cache, and, when n > 1, their own keys and values k, v [n, Hkv, D]
    causally, or under own_mask [n, n] (additive, q's dtype) where given (a single query's
    own key is in its runs). Returns [n, H * D]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # Unmasked, so GQA heads fold into rows (query-major), [1, Hkv, n * group, D]: one call
    # per KV head covers all its query heads.
    folded = q.view(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    outs, lses = [], []
    for first, length in runs:
        # A view, [1, Hkv, L, D], where the cache is in q's dtype; else the run converted.
        run_k = values(flat_k[first : first + length], q.dtype).transpose(0, 1)[None]
        run_v = values(flat_v[first : first + length], q.dtype).transpose(0, 1)[None]
        o, lse = flash(folded, run_k, run_v)[:2]
        outs.append(o.view(kv_heads, n, group, dim))
        lses.append(lse.view(kv_heads, n, group))
    if n > 1:  # heads expanded to match the queries
        own_q = q.transpose(0, 1)[None]
        own_k = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        own_v = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        o, lse = flash(own_q, own_k, own_v, is_causal=own_mask is None, attn_mask=own_mask)[:2]
        outs.append(o.view(kv_heads, group, n, dim).transpose(1, 2))
        lses.append(lse.view(kv_heads, group, n).transpose(1, 2))
    if len(outs) == 1:
        out = outs[0]
    else:  # each part weighted by its share of the softmax's total
        total = torch.stack(lses).logsumexp(0).unsqueeze(-1)
        out = sum(
            o * (lse.unsqueeze(-1) - total).exp().to(q.dtype)
            for o, lse in zip(outs, lses, strict=True)
        )
    return out.transpose(0, 1).reshape(n, -1)  # [Hkv, n, G, D] -> [n, H * D]


def explicit(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with its scores computed explicitly, for what SDPA, the CPU flash op and our
    paged kernel do not take: scores soft-capped before the softmax, cap * tanh(scores / cap)
    (Gemma 2), and sinks, a logit per query head [H] that joins each softmax's denominator
    and is then dropped (gpt-oss: a head's weights may sum to less than 1).
    B sequences' n queries each, q [B * n, H, D], over their keys and values [B, L, Hkv, D],
    each query seeing the keys where allowed [B, n, L] is True. Returns [B * n, H * D]."""
    b, _, kv_heads, dim = keys.shape
    n, heads = q.shape[0] // b, q.shape[1]
    group = heads // kv_heads
    q = q.view(b, n, kv_heads, group, dim)
    scores = torch.einsum("bnkgd,blkd->bkgnl", q, keys) * dim**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is None:
        weights = scores.softmax(-1, dtype=torch.float32)
    else:
        sink = sinks.view(1, kv_heads, group, 1, 1).to(scores.dtype).expand(b, -1, -1, n, 1)
        weights = torch.cat((scores, sink), dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    out = torch.einsum("bkgnl,blkd->bnkgd", weights.to(values.dtype), values)
    return out.reshape(b * n, heads * dim)


def gather_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key_blocks: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of KV blocks key_blocks [B, nb], each [B, nb * block_size, Hkv, D]
    in dtype."""
    b = key_blocks.shape[0]
    # index_select copies whole blocks ~3x faster than advanced indexing.
    flat_blocks = key_blocks.flatten()
    k, v = (values(c.index_select(0, flat_blocks), dtype) for c in (k_cache, v_cache))
    return k.view(b, -1, *k.shape[2:]), v.view(b, -1, *v.shape[2:])
