"""The small ops of every layer (RMSNorm, the rotary embedding, the KV-cache write) and the
lm_head's top-k: on our C++ kernels (csrc/step_ops.cpp, built with the block kernels) on the
CPU, else on torch's ops.

Why: a decode step of a small model is mostly fixed costs. Torch spends a few microseconds
dispatching each op, however few values it touches, and RMSNorm alone was ~10 ops, rope 3-4,
the cache write 4 and its casts: ~3,400 dispatches a SmolLM2 step. Ours are one call each.
A prompt chunk's rows are split over the threads, where torch's ops took a pass each over
them (RMSNorm ~6, rope 3, the cache write a cast and a scatter). CUDA, other dtypes and
GAPLESS_KERNELS=fallback take torch's.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from gapless.kernels import blocks
from gapless.kernels.kv_format import STORAGE_TYPES, dequantize_q8, is_int8_rows, quantize_q8
from gapless.kernels.machine import kernels_setting
from gapless.kernels.probe import step_ops_work

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what our ops take; the cache: any type


def switched_on() -> bool:
    """Our step-op build works here and GAPLESS_KERNELS=fallback is not set (checked per
    call: the switch may change)."""
    return kernels_setting() != "fallback" and step_ops_work()


def _ours(x: torch.Tensor) -> ModuleType | None:
    """Our kernels, where they take x."""
    if x.device.type == "cpu" and x.dtype in ACTIVATION_DTYPES and switched_on():
        return blocks.extension()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] or [T, H, D] normalized over its last dim, times weight; accumulates in
    float32 and rounds the normalized x to its dtype before the weight multiplies it, as
    transformers' Llama norm does (torch's F.rms_norm with the weight rounds once: in bf16 a
    quarter of its values then differ by a unit in the last place from ours)."""
    ext = _ours(x)
    if ext is not None and x.dim() in (2, 3) and x.stride(-1) == 1 and weight.dtype == x.dtype:
        return ext.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, None, eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (i, i + R/2) of the first R = cos.shape[-1] dims of x [T, H, D] (all of
    them but in a partial rotary embedding). signed_sin is sin with its first half negated,
    so the rotation is x * cos + swap_halves(x) * signed_sin: three ops instead of six."""
    ext = _ours(x)
    if ext is not None and x.dim() == 3 and cos.dtype == x.dtype:
        return ext.rope(x, cos, signed_sin)
    if (rotary := cos.shape[-1]) < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new keys and values k, v [T, Hkv, D] into the caches [blocks, block_size,
    Hkv, D] at slots [T] (block * block_size + offset): cast to a float cache's dtype, or
    quantized into an int8 cache (kv_format.py's rows). Returns k, v as the cache now
    holds them: in a float cache's dtype, or read back from an int8 cache into k's dtype (a
    chunk attends its own keys as later steps will read them)."""
    ext = _ours(k)
    int8_rows = is_int8_rows(k_cache.dtype)
    if ext is not None and k_cache.dtype in STORAGE_TYPES and slots.dtype == torch.int64:
        written = ext.write_kv(k, v, k_cache, v_cache, slots)
        if not int8_rows:
            return written
    elif int8_rows:
        k_cache.flatten(0, 1).index_copy_(0, slots, quantize_q8(k))
        v_cache.flatten(0, 1).index_copy_(0, slots, quantize_q8(v))
    if int8_rows:
        rows = (c.flatten(0, 1).index_select(0, slots) for c in (k_cache, v_cache))
        return tuple(dequantize_q8(r, k.dtype) for r in rows)  # type: ignore[return-value]
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.flatten(0, 1).index_copy_(0, slots, k)
    v_cache.flatten(0, 1).index_copy_(0, slots, v)
    return k, v


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest logits of each row of x [R, V], in no particular order
    (ties at the k-th: any of them). torch's topk sorts a copy of every row: ~0.3-0.8 ms a
    step on a 49,152-token vocabulary here, several times our one pass."""
    ext = _ours(x)
    if ext is not None and x.dtype == torch.float32 and x.dim() == 2:
        return ext.top_k(x, k)
    return x.topk(k, dim=-1).indices
