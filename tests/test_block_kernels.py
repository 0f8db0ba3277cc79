"""Our GGUF block kernels (kernels/blocks.py) on every type they have: the 32-element types
and the K-quant types (256 values a block). Dequantize equals the `gguf` package's to the
bit; the decode product (gemv, against activations quantized as ggml does for the type's
block size: Q8_0 per 32, Q8_K per 256) equals F.linear on those activations up to float32
rounding; the prompt-chunk product (mm) equals F.linear on the dequantized weight. Rows
interleaved by 16 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) give the same products as the file's layout. The
step's small ops in the same build (RMSNorm, rope, the KV-cache write) equal the torch ops
they replace. Each case runs on every build the install compiled (extensions.py: portable,
AVX2, AVX-512, AVX-512 VNNI) that this CPU can run; a build that is missing fails."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import require_our_kernels

from gapless.bench.gguf_files import F16_FIELDS, random_blocks
from gapless.kernels import AMX_GEMV_ROWS, blocks, probe, step_ops
from gapless.kernels.extensions import GGUF_BLOCKS
from gapless.kernels.linear import BlockLinear
from gapless.kernels.machine import machine
from gapless.kernels.quant import BlockQuant

# The GGUF types the kernels have, as their portable build (any x86-64 runs it) says: a type
# added in csrc/ gets every test here without a line of its own. None where it did not build:
# the tests of each build then fail (require_our_kernels), so a green run still means they ran.
PORTABLE = blocks.extension("portable")
TYPES = {int(t): t.name for t in gguf.GGMLQuantizationType if PORTABLE and PORTABLE.has_type(t)}


def block_elems(qtype: int) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][0]


KQUANTS = {t: name for t, name in TYPES.items() if block_elems(t) == 256}

# Shapes per block size: columns (K) are multiples of the block.
COLS = {32: 96, 256: 768}  # dequantize, mm
# Up to the most rows a linear sends to gemv (kernels.AMX_GEMV_ROWS, with AMX).
GEMV_M = {32: [1, 2, 3, 5, 16, AMX_GEMV_ROWS], 256: [1, 3, 16, AMX_GEMV_ROWS]}
GEMV_K = {32: [96, 1056], 256: [512, 768]}
# gemv against F.linear on the same 8-bit activations: float32 rounding only (see the test).
GEMV_REL = {32: 1e-5, 256: 1e-6}

GEMV_CASES = [
    pytest.param(t, m, k, id=f"{name}-m{m}-k{k}")
    for t, name in TYPES.items()
    for m in GEMV_M[block_elems(t)]
    for k in GEMV_K[block_elems(t)]
]


@pytest.fixture(scope="module", params=list(GGUF_BLOCKS.builds().values()))
def ext(request):
    """Each distinct build, by the lowest level that runs it."""
    level = request.param
    if missing := set(GGUF_BLOCKS.isa(level)) - set(machine().cpu_isa):
        pytest.skip(
            f"this CPU lacks {sorted(missing)} (the build is checked in test_kernel_builds)"
        )
    built = blocks.extension(level)
    require_our_kernels(built is not None, f"the {level} build of our block kernels")
    return built


def test_every_build_has_the_types_of_the_portable_one(ext):
    """TYPES is the portable build's; every build runs the same types, and the bench's random
    blocks (F16_FIELDS, which the tests draw weights from) know each one's scale fields."""
    assert TYPES
    assert {t for t in gguf.GGMLQuantizationType if ext.has_type(t)} == set(TYPES)
    assert set(TYPES) <= set(F16_FIELDS)


def weight(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random codes and sub-block scales, the f16 fields finite, of a real model's magnitude
    and either sign."""
    gen = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks((rows, cols), qtype, gen, signed=True))


def reference(b: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values).view(-1, cols)


def act_q8(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it in gemv for the 32-element types: 8 bits per 32 values
    (ggml's Q8_0), dequantized."""
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d == 0, 0, 1 / d))  # to nearest even, as the kernels
    return (q * d).view_as(x)


def act_q8k(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it in gemv for the K-quant types, dequantized: ggml's Q8_K, 8
    bits per 256 values. The value of largest magnitude (the first of equals) maps to -127
    and fixes the scale's sign; the others round to nearest even, at most 127."""
    b = x.view(x.shape[0], -1, 256)
    top = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(top == 0, 0, -127.0 / top)
    q = torch.round(b * iscale).clamp(max=127)
    return (q * torch.where(top == 0, 0, 1 / iscale)).view_as(x)


def act_quantized(x: torch.Tensor, qtype: int) -> torch.Tensor:
    return act_q8(x) if block_elems(qtype) == 32 else act_q8k(x)


def assert_close_to_sums(got, want, x, w, rel):
    """|got - want| within rel of sum |x| |w| per output: rounding of sums that cancel."""
    bound = x.abs().double() @ w.abs().double().T
    err = (got.double() - want.double()).abs()
    assert (err <= rel * bound + 1e-30).all(), (err / bound).max().item()


@pytest.mark.parametrize("qtype", TYPES, ids=TYPES.values())
def test_dequantize_equals_the_gguf_package(ext, qtype):
    cols = COLS[block_elems(qtype)]
    b = weight(qtype, 7, cols)
    want = reference(b, qtype, cols)
    got = ext.dequantize(b, qtype, cols, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(ext.dequantize(b, qtype, cols, torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize(("qtype", "m", "k"), GEMV_CASES)
def test_gemv_equals_linear_on_8_bit_activations(ext, qtype, m, k):
    n = block_elems(qtype)
    b = weight(qtype, 200, k, seed=m)
    w = reference(b, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[-1, n : 2 * n] = 0  # a block of zeros: scale 0, not a division by it
    got = ext.gemv(x, b, qtype)
    # On the same 8-bit activations only float32 rounding differs. Per 32: sums in another
    # order, and the centre folded out through each block's sum. Per 256 the kernel's sums
    # are exact integers within a block, then a product and an add per block, against
    # float64 here: 2-4e-8 of sum |x| |w| measured; one activation a step off would be ~1e-4.
    want = F.linear(act_quantized(x, qtype).double(), w.double())
    assert_close_to_sums(got, want, x, w, GEMV_REL[n])
    # Against float x the 8-bit activations themselves cost up to half a step of
    # max |x| / 127 a value: per 32, ~0.4% of sum |x| |w|; per 256, for Gaussian x up to
    # ~1.5% were every rounding the same way, ~0.2% measured. What a decode step gives up.
    assert_close_to_sums(got, F.linear(x, w), x, w, 1e-2)


@pytest.mark.parametrize("qtype", KQUANTS, ids=KQUANTS.values())
@pytest.mark.parametrize("m", [5, 6, 7])
def test_gemv_rows_together_equal_rows_alone(ext, qtype, m):
    # A batch's rows share each unpacked weight block (4 at a time, then 3, 2 or 1): every
    # row's integer sums and float steps are those of the row alone, to the bit. (Not so for
    # the 32-element types, whose one-row dot keeps two chains of float accumulators.)
    b = weight(qtype, 40, 512)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    alone = torch.cat([ext.gemv(x[i : i + 1], b, qtype) for i in range(len(x))])
    assert torch.equal(ext.gemv(x, b, qtype), alone)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPES.values())
@pytest.mark.parametrize("m", [17, 64])
def test_mm_equals_linear_on_the_dequantized_weight(ext, qtype, m):
    cols = COLS[block_elems(qtype)]
    b = weight(qtype, 200, cols, seed=m)
    w = reference(b, qtype, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    got = ext.mm(x, b, qtype)
    assert got.dtype == torch.float32
    # The exact weight, in a float32 GEMM: its rounding only.
    assert_close_to_sums(got, F.linear(x.double(), w.double()), x, w, 1e-5)
    # bf16: the weight and x rounded to bf16 as F.linear in bf16 has them, the output once
    # (2^-9 relative), sums in float32.
    got = ext.mm(x.bfloat16(), b, qtype)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.bfloat16().double(), w.bfloat16().double())
    assert_close_to_sums(got, want, x, w, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_epilogues_equal_the_ops_after_the_product(ext, dtype):
    """silu and times are applied to each tile's columns inside mm (the MLP's gate and up);
    on a weight of several tiles per thread they equal the ops run on the whole product, up
    to the last bit (a strided tile and the whole product vectorize differently)."""
    qtype, rows, cols = 2, 700, 96
    b = weight(qtype, rows, cols)
    x = torch.randn(40, cols).to(dtype)
    other = torch.randn(40, rows).to(dtype)
    product = ext.mm(x, b, qtype)
    torch.testing.assert_close(ext.mm(x, b, qtype, silu=True), F.silu(product))
    torch.testing.assert_close(ext.mm(x, b, qtype, times=other), product * other)
    with pytest.raises(RuntimeError, match=r"times must be \[M, N\]"):
        ext.mm(x, b, qtype, times=other[:, :-1])


def test_mm_runs_in_inference_mode(ext):
    """The decoder's forward runs in inference mode, which mm's worker threads must share
    to write its output."""
    b = weight(2, 200, 96)
    w = reference(b, 2, 96)
    x = torch.randn(64, 96)
    with torch.inference_mode():
        got = ext.mm(x, b, 2)
    assert_close_to_sums(got, F.linear(x, w), x, w, 1e-5)


def test_types_unsupported_types_and_shapes_say_so(ext):
    assert all(ext.has_type(t) for t in TYPES) and not ext.has_type(1)
    with pytest.raises(RuntimeError, match="GGUF block type 1 has no kernel"):
        ext.gemv(torch.ones(1, 32), torch.zeros(2, 64, dtype=torch.uint8), 1)
    with pytest.raises(RuntimeError, match="Q4_0 rows of 64 values take 36 bytes, not 34"):
        ext.gemv(torch.ones(1, 64), torch.zeros(2, 34, dtype=torch.uint8), 2)
    with pytest.raises(RuntimeError, match="Q4_K rows of 512 values take 288 bytes, not 144"):
        ext.gemv(torch.ones(1, 512), torch.zeros(2, 144, dtype=torch.uint8), 12)


@pytest.mark.parametrize("qtype", [2, 12], ids=["Q4_0", "Q4_K"])
def test_the_wrappers_run_the_native_build(qtype):
    require_our_kernels(blocks.extension() is not None, "our block kernels")
    cols = 2 * block_elems(qtype)
    b = weight(qtype, 64, cols)
    x = torch.randn(2, cols)
    w = reference(b, qtype, cols)
    assert blocks.supported(qtype) and not blocks.supported(1)
    assert torch.equal(blocks.dequantize(b, qtype, cols), w)
    want = F.linear(act_quantized(x, qtype), w)
    assert_close_to_sums(blocks.gemv(x, b, qtype), want, x, w, 1e-5)
    assert_close_to_sums(blocks.mm(x, b, qtype), F.linear(x, w), x, w, 1e-5)


INTERLEAVED = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=INTERLEAVED.values())
def test_interleaved_rows_hold_the_same_weight(ext, qtype):
    # Rows interleaved by 16 (csrc/gguf_blocks.h): the same bytes permuted, which every
    # product and dequantize reads as the weight they were.
    b = weight(qtype, 48, 1056)
    w = reference(b, qtype, 1056)
    inter = ext.interleave(b, qtype, 1056)
    assert inter.shape == b.shape and not torch.equal(inter, b)
    assert torch.equal(inter.flatten().sort().values, b.flatten().sort().values)
    assert torch.equal(ext.dequantize(inter, qtype, 1056, torch.float32, True), w)
    assert torch.equal(ext.dequantize(inter, qtype, 1056, torch.bfloat16, True), w.bfloat16())
    x = torch.randn(40, 1056, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ext.mm(x, inter, qtype, True), ext.mm(x, b, qtype))


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=INTERLEAVED.values())
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, AMX_GEMV_ROWS])
@pytest.mark.parametrize("k", [96, 1056])
def test_gemv_on_interleaved_rows_equals_linear_on_8_bit_activations(ext, qtype, m, k):
    b = weight(qtype, 208, k, seed=m)
    w = reference(b, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[-1, 32:64] = 0  # a block of zeros
    got = ext.gemv(x, ext.interleave(b, qtype, k), qtype, True)
    # The same integer sums as the file's layout, each block's scaled in one float step per
    # row (sums in another order than the per-row dot): float32 rounding, as there.
    want = F.linear(act_q8(x).double(), w.double())
    assert_close_to_sums(got, want, x, w, GEMV_REL[32])


def test_only_whole_groups_of_the_interleaved_types_interleave(ext):
    assert [t for t in TYPES if ext.can_interleave(t)] == list(INTERLEAVED)
    with pytest.raises(RuntimeError, match="Q4_0 blocks cannot be interleaved"):
        ext.interleave(weight(2, 40, 64), 2, 64)  # 40 rows: not whole groups of 16
    with pytest.raises(RuntimeError, match="IQ4_NL blocks cannot be interleaved"):
        ext.interleave(weight(20, 32, 64), 20, 64)


def test_an_interleaved_weight_multiplies_and_gathers_rows_only():
    require_our_kernels(blocks.extension() is not None, "our block kernels")
    w = BlockQuant(weight(3, 32, 64), 3, 64)
    linear = BlockLinear(w)
    assert linear.weight.interleaved and torch.equal(linear.weight.dequantize(), w.dequantize())
    assert not BlockLinear(w, interleave=False).weight.interleaved
    assert not BlockLinear(BlockQuant(weight(3, 40, 64), 3, 64)).weight.interleaved
    x = torch.randn(3, 64)
    assert_close_to_sums(linear(x), blocks.gemv(x, w.blocks, 3), x, w.dequantize(), 1e-5)
    index = torch.tensor([[17, 0], [31, 17]])  # rows of the second group and the first
    assert torch.equal(linear.weight.rows(index), w.rows(index))
    for use in (
        lambda q: q.column_slice(slice(0, 32)),
        lambda q: BlockQuant.cat([q, q]),
    ):
        with pytest.raises(ValueError, match="read by our decode kernels only"):
            use(linear.weight)


# The step's small ops (kernels/step_ops.py) against the torch ops they replace.
STEP_DTYPES = {torch.float32: 1e-6, torch.bfloat16: 2**-7}  # relative: float32 sums; 1 bf16 ulp


def assert_within(got, want, rel):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    assert (err <= rel * want.double().abs() + 1e-6).all(), err.max().item()


# Rows of a decode step, and of a prompt chunk, which the ops split over the threads.
STEP_ROWS = {"decode": 5, "chunk": 700}


@pytest.mark.parametrize("rows", STEP_ROWS.values(), ids=STEP_ROWS)
@pytest.mark.parametrize("dtype", STEP_DTYPES, ids=str)
def test_rms_norm_equals_torchs(ext, dtype, rows, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(rows, 200, generator=gen).to(dtype)  # 200: not a multiple of 16
    heads = torch.randn(rows, 7, 64, generator=gen).to(dtype)[:, 2:6]  # q heads of a qkv row
    w200, w64 = (torch.randn(n, generator=gen).to(dtype) for n in (200, 64))
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")  # the torch path of the wrapper
    for x, w in ((flat, w200), (heads, w64)):
        assert_within(ext.rms_norm(x, w, 1e-5), step_ops.rms_norm(x, w, 1e-5), STEP_DTYPES[dtype])


@pytest.mark.parametrize("rows", STEP_ROWS.values(), ids=STEP_ROWS)
@pytest.mark.parametrize("dtype", STEP_DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [64, 32], ids=["full", "partial"])
def test_rope_equals_the_torch_ops(ext, dtype, rotary, rows, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, 9 * 64, generator=gen).to(dtype)
    qk = qkv[:, : 6 * 64].view(rows, 6, 64)  # a view into the fused projection, as the layers have
    angles = torch.randn(rows, 1, rotary // 2, generator=gen)
    cos = angles.cos().repeat(1, 1, 2).to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")  # the torch path of the wrapper
    want = step_ops.apply_rope(qk, cos, signed_sin)
    assert_within(ext.rope(qk, cos, signed_sin), want, STEP_DTYPES[dtype])


@pytest.mark.parametrize("rows", STEP_ROWS.values(), ids=STEP_ROWS)
@pytest.mark.parametrize("cache_dtype", STEP_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", STEP_DTYPES, ids=str)
def test_write_kv_writes_the_slots_cast_to_the_caches_dtype(ext, dtype, cache_dtype, rows):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(rows, 4, 32, generator=gen).to(dtype)
    k, v = kv[:, :2], kv[:, 2:]  # views with a row stride, as the layers' k and v
    blocks = rows // 4 + 3
    k_cache, v_cache = (torch.zeros(blocks, 4, 2, 32, dtype=cache_dtype) for _ in range(2))
    slots = torch.randperm(blocks * 4, generator=gen)[:rows]  # scattered, each once
    got_k, got_v = ext.write_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.flatten(0, 1).index_copy_(0, slots, k.to(cache_dtype))
    want_v.flatten(0, 1).index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got_k, k.to(cache_dtype)) and torch.equal(got_v, v.to(cache_dtype))
    with pytest.raises(RuntimeError, match=f"slot {blocks * 4} is outside the cache"):
        ext.write_kv(k[:3], v[:3], k_cache, v_cache, torch.tensor([9, blocks * 4, 0]))


def test_step_ops_take_decode_rows_and_chunks_on_our_kernels(monkeypatch):
    require_our_kernels(probe.step_ops_work(), "our step ops")
    calls = []
    ext = blocks.extension()
    monkeypatch.setattr(blocks, "extension", lambda: SimpleNamespace(rms_norm=ours))

    def ours(*args):
        calls.append(args[0].shape[0])
        return ext.rms_norm(*args)

    w = torch.ones(64)
    for rows in (1, 16, 512):
        step_ops.rms_norm(torch.randn(rows, 64), w, 1e-6)
    step_ops.rms_norm(torch.randn(4, 64).double(), w.double(), 1e-6)  # a dtype it lacks
    transposed = torch.randn(64, 4).T  # its last dim strided (Gemma 3's pooled image rows)
    assert torch.allclose(
        step_ops.rms_norm(transposed, w, 1e-6), F.rms_norm(transposed, (64,), w, 1e-6)
    )
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    step_ops.rms_norm(torch.randn(4, 64), w, 1e-6)
    assert calls == [1, 16, 512]


@pytest.mark.parametrize("k", [1, 16, 40])
def test_top_k_finds_the_largest_as_torch_does(ext, k):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(k)) * 10
    logits[1, 7] = float("nan")  # never among the best (torch ranks it first: not a logit)
    got = ext.top_k(logits, k)
    assert got.shape == (3, k) and got.dtype == torch.int64
    clean = logits.nan_to_num(nan=float("-inf"))
    for row, want in zip(got, clean.topk(k, dim=-1).indices, strict=True):
        if k < 40:
            assert set(row.tolist()) == set(want.tolist())
        else:  # all of them, the NaN's place included
            assert sorted(row.tolist()) == list(range(40))
