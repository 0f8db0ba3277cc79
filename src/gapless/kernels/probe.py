"""What this machine can run fast, found once per process by trying it on tiny tensors."""

from __future__ import annotations

import functools

import torch

from gapless.kernels.kv_format import dequantize_q8, is_int8_rows, quantize_q8


def _works(fn: object) -> bool:
    try:
        fn()  # type: ignore[operator]
    except RuntimeError:  # the op or this dtype is not built or not supported on this CPU
        return False
    return True


@functools.cache
def packed_linear_works(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear with its fused epilogues, on the CPU, in this dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    x, w = torch.ones(2, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype)

    def run() -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
        torch.ops.mkldnn._linear_pointwise.binary(x, x, packed, None, "mul")

    return _works(run)


@functools.cache
def cpu_flash_works(dtype: torch.dtype) -> bool:
    """The CPU flash-attention op, which also returns each row's log-sum-exp."""
    q = torch.ones(1, 1, 2, 16, dtype=dtype)
    return _works(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q))


@functools.cache
def int8_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """The int8 weight-only matmul (per-row scales) on this device, with activations in dtype."""
    x, w = torch.ones(2, 32, dtype=dtype, device=device_type), torch.ones(16, 32, dtype=torch.int8)
    scale = torch.ones(16, dtype=dtype, device=device_type)
    return _works(lambda: torch.ops.aten._weight_int8pack_mm(x, w.to(device_type), scale))


@functools.cache
def int4_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """The int4 weight-only matmul (group 32) and its packing op, on this device, in dtype."""
    x = torch.ones(2, 64, dtype=dtype, device=device_type)
    codes = torch.ones(16, 64, dtype=torch.int32, device=device_type)
    scales_and_zeros = torch.ones(2, 16, 2, dtype=dtype, device=device_type)

    def run() -> None:
        if device_type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(codes[:, ::2].to(torch.uint8), 8)
            torch.ops.aten._weight_int4pack_mm(x, packed, 32, scales_and_zeros)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)

    return _works(run)


@functools.cache
def paged_decode_works(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Our paged attention kernel builds here and its decodes, with queries in query_dtype
    over a KV cache stored in cache_dtype (kv_format.KV_CACHE_DTYPES), agree with plain
    attention."""
    return _paged_kernel_agrees(query_dtype, cache_dtype, 1)


@functools.cache
def paged_prefill_works(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Its prompt chunks do too: built only for bf16 on CPUs with AVX512-BF16 (elsewhere the
    CPU flash op is as fast; csrc/paged_attention.cpp)."""
    return _paged_kernel_agrees(query_dtype, cache_dtype, 3)


def _paged_kernel_agrees(query_dtype: torch.dtype, cache_dtype: torch.dtype, n: int) -> bool:
    """n queries of each of two sequences, the last n of their keys, attend causally."""
    from gapless.kernels import paged

    if not paged.supports(query_dtype, cache_dtype, n > 1) or paged.extension() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2 * n, 2, 64, generator=gen).to(query_dtype)
    k_cache, v_cache = (torch.randn(3, 4, 1, 64, generator=gen) for _ in range(2))
    if is_int8_rows(cache_dtype):
        k_cache, v_cache = quantize_q8(k_cache), quantize_q8(v_cache)
        values = dequantize_q8(k_cache), dequantize_q8(v_cache)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        values = k_cache.float(), v_cache.float()
    tables, num_keys = torch.tensor([[2, 0], [1, 0]]), torch.tensor([6, 3])
    try:
        got = paged.paged_attention(q, k_cache, v_cache, tables, num_keys, None)
    except RuntimeError:
        return False
    got = got.view(2, n, 2, 64)
    for b in range(2):
        slots = tables[b, :, None] * 4 + torch.arange(4)
        keys = slots.flatten()[: num_keys[b]]
        k, v = (c.flatten(0, 1)[keys, 0] for c in values)
        scores = torch.einsum("nhd,ld->nhl", q[b * n : (b + 1) * n].float(), k) / 8
        causal = torch.arange(len(keys)) <= torch.arange(len(keys) - n, len(keys))[:, None, None]
        want = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        if not torch.allclose(got[b].float(), want, atol=2e-2, rtol=2e-2):
            return False
    return True


@functools.cache
def gguf_blocks_work() -> bool:
    """Our GGUF block kernels build here, and a Q8_0 weight's products on them, decode rows
    and a chunk's, agree with the float ones."""
    import gguf

    from gapless.kernels import blocks

    if blocks.extension() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=gen), torch.randn(20, 64, generator=gen)
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0))
    qtype = int(gguf.GGMLQuantizationType.Q8_0)
    want = x @ blocks.dequantize(raw, qtype, 64).T
    try:
        decode, chunk = blocks.gemv(x[:3], raw, qtype), blocks.mm(x, raw, qtype)
    except RuntimeError:
        return False
    # 8-bit activations: each input off by up to 1/254 of its block's largest.
    return torch.allclose(decode, want[:3], atol=0.1, rtol=0.02) and torch.allclose(
        chunk, want, atol=1e-4, rtol=1e-4
    )


@functools.cache
def step_ops_work() -> bool:
    """Our step ops (csrc/step_ops.cpp, in the block kernels' build) build here and agree
    with torch's on a tiny batch: RMSNorm, rope over q and k heads, the KV-cache write."""
    from gapless.kernels import blocks

    ext = blocks.extension()
    if ext is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 64, generator=gen), torch.randn(64, generator=gen)
    angles = torch.randn(3, 1, 32, generator=gen)
    cos, signed_sin = angles.cos().repeat(1, 1, 2), torch.cat((-angles.sin(), angles.sin()), -1)
    k_cache, v_cache = torch.zeros(2, 4, 4, 64), torch.zeros(2, 4, 4, 64)
    slots = torch.tensor([5, 0, 2])
    try:
        normed = ext.rms_norm(x, w, 1e-6)
        rotated = ext.rope(x, cos, signed_sin)
        ext.write_kv(x, -x, k_cache, v_cache, slots)
    except RuntimeError:
        return False
    swapped = torch.cat((x[..., 32:], x[..., :32]), dim=-1)
    written = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    return (
        torch.allclose(normed, torch.nn.functional.rms_norm(x, w.shape, w, 1e-6), atol=1e-5)
        and torch.allclose(rotated, x * cos + swapped * signed_sin, atol=1e-5)
        and torch.equal(written[0], x)
        and torch.equal(written[1], -x)
    )
