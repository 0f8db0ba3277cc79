"""Our GGUF block kernels (kernels/blocks.py) on every type they have: the 32-element types
and the K-quant types (256 values a block). Dequantize equals the `gguf` package's to the
bit; the decode product (gemv, against activations quantized as ggml does for the type's
block size: Q8_0 per 32, Q8_K per 256) equals F.linear on those activations up to float32
rounding; the prompt-chunk product (mm) equals F.linear on the dequantized weight. Each
case runs on every build this CPU can run: native (AVX-512 VNNI here), AVX2 only, and the
portable one with no ISA flags."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks

from gapless.kernels import blocks
from gapless.kernels.probe import machine

TYPES = {
    2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 23: "IQ4_XS",
}  # fmt: skip
BUILDS = {"native": None, "avx2": ("avx2",), "portable": ()}


def block_elems(qtype: int) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][0]


KQUANTS = {t: name for t, name in TYPES.items() if block_elems(t) == 256}

# Shapes per block size: columns (K) are multiples of the block.
COLS = {32: 96, 256: 768}  # dequantize, mm
GEMV_M = {32: [1, 2, 3, 5, 16], 256: [1, 3, 16]}
GEMV_K = {32: [96, 1056], 256: [512, 768]}
# gemv against F.linear on the same 8-bit activations: float32 rounding only (see the test).
GEMV_REL = {32: 1e-5, 256: 1e-6}

GEMV_CASES = [
    pytest.param(t, m, k, id=f"{name}-m{m}-k{k}")
    for t, name in TYPES.items()
    for m in GEMV_M[block_elems(t)]
    for k in GEMV_K[block_elems(t)]
]


@pytest.fixture(scope="module", params=list(BUILDS))
def ext(request):
    isa = BUILDS[request.param]
    if isa and not set(isa) <= set(machine().cpu_isa):
        pytest.skip(f"this CPU lacks {isa}")
    built = blocks.extension(isa)
    if built is None:
        pytest.skip(f"the {request.param} build of our block kernels cannot be built here")
    return built


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
    if blocks.extension() is None:
        pytest.skip("our block kernels cannot be built here (no compiler or Python headers)")
    cols = 2 * block_elems(qtype)
    b = weight(qtype, 64, cols)
    x = torch.randn(2, cols)
    w = reference(b, qtype, cols)
    assert blocks.supported(qtype) and not blocks.supported(1)
    assert torch.equal(blocks.dequantize(b, qtype, cols), w)
    want = F.linear(act_quantized(x, qtype), w)
    assert_close_to_sums(blocks.gemv(x, b, qtype), want, x, w, 1e-5)
    assert_close_to_sums(blocks.mm(x, b, qtype), F.linear(x, w), x, w, 1e-5)
