"""Our GGUF block kernels (kernels/blocks.py) on the K-quant types (256 values a block):
dequantize equals the `gguf` package's to the bit, the decode product (gemv, against
activations quantized as ggml's Q8_K) equals F.linear on those activations up to float32
rounding, and the prompt-chunk product (mm) equals F.linear on the dequantized weight. Each
case runs on every build this CPU can run: native (AVX-512 VNNI here), AVX2 only, and the
portable one with no ISA flags."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gapless.kernels import blocks
from gapless.kernels.probe import machine

KQUANTS = {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 23: "IQ4_XS"}
# Byte offsets of each type's f16 fields: d, and dmin where the type has minimums.
F16_FIELDS = {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,), 23: (0,)}
BUILDS = {"native": None, "avx2": ("avx2",), "portable": ()}


@pytest.fixture(scope="module", params=list(BUILDS))
def ext(request):
    isa = BUILDS[request.param]
    if isa and not set(isa) <= set(machine().cpu_isa):
        pytest.skip(f"this CPU lacks {isa}")
    built = blocks.extension(isa)
    if built is None:
        pytest.skip(f"the {request.param} build of our block kernels cannot be built here")
    return built


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random bytes (any byte is a valid code or sub-block scale) with the f16 fields set
    to finite values of a real model's magnitude, either sign."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    gen = np.random.default_rng(seed)
    data = gen.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    n = len(data)
    for at in F16_FIELDS[qtype]:
        value = gen.uniform(0.01, 0.05, n) * gen.choice([-1, 1], n)
        data[:, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(data.reshape(rows, -1))


def reference(b: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values).view(-1, cols)


def act_q8k(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it in gemv, dequantized: ggml's Q8_K, 8 bits per 256 values.
    The value of largest magnitude (the first of equals) maps to -127 and fixes the scale's
    sign; the others round to nearest even, at most 127."""
    b = x.view(x.shape[0], -1, 256)
    top = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(top == 0, 0, -127.0 / top)
    q = torch.round(b * iscale).clamp(max=127)
    return (q * torch.where(top == 0, 0, 1 / iscale)).view_as(x)


def assert_close_to_sums(got, want, x, w, rel):
    """|got - want| within rel of sum |x| |w| per output: rounding of sums that cancel."""
    bound = x.abs().double() @ w.abs().double().T
    err = (got.double() - want.double()).abs()
    assert (err <= rel * bound + 1e-30).all(), (err / bound).max().item()


@pytest.mark.parametrize("qtype", KQUANTS, ids=KQUANTS.values())
def test_dequantize_equals_the_gguf_package(ext, qtype):
    b = random_blocks(qtype, 7, 768)
    want = reference(b, qtype, 768)
    got = ext.dequantize(b, qtype, 768, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(ext.dequantize(b, qtype, 768, torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize("qtype", KQUANTS, ids=KQUANTS.values())
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [512, 768])
def test_gemv_equals_linear_on_8_bit_activations(ext, qtype, m, k):
    b = random_blocks(qtype, 200, k, seed=m)
    w = reference(b, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[-1, 256:512] = 0  # a block of zeros: scale 0, not a division by it
    got = ext.gemv(x, b, qtype)
    # On the same 8-bit activations the kernel's sums are exact integers within a block;
    # only float32 rounding differs (a product and an add per block, against float64 here),
    # 2-4e-8 of sum |x| |w| measured; one activation a step off would be ~1e-4.
    assert_close_to_sums(got, F.linear(act_q8k(x).double(), w.double()), x, w, 1e-6)
    # Against float x the 8-bit activations themselves cost up to half a step of
    # max |x| / 127 a value, per 256: for Gaussian x up to ~1.5% of sum |x| |w| were every
    # rounding the same way, ~0.2% measured. What a decode step gives up.
    assert_close_to_sums(got, F.linear(x, w), x, w, 1e-2)


@pytest.mark.parametrize("qtype", KQUANTS, ids=KQUANTS.values())
@pytest.mark.parametrize("m", [5, 6, 7])
def test_gemv_rows_together_equal_rows_alone(ext, qtype, m):
    # A batch's rows share each unpacked weight block (4 at a time, then 3, 2 or 1): every
    # row's integer sums and float steps are those of the row alone, to the bit.
    b = random_blocks(qtype, 40, 512)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    alone = torch.cat([ext.gemv(x[i : i + 1], b, qtype) for i in range(len(x))])
    assert torch.equal(ext.gemv(x, b, qtype), alone)


@pytest.mark.parametrize("qtype", KQUANTS, ids=KQUANTS.values())
@pytest.mark.parametrize("m", [17, 64])
def test_mm_equals_linear_on_the_dequantized_weight(ext, qtype, m):
    b = random_blocks(qtype, 200, 768, seed=m)
    w = reference(b, qtype, 768)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
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


def test_the_types_are_listed(ext):
    assert all(ext.has_type(t) for t in KQUANTS)
    with pytest.raises(RuntimeError, match="Q4_K rows of 512 values take 288 bytes, not 144"):
        ext.gemv(torch.ones(1, 512), torch.zeros(2, 144, dtype=torch.uint8), 12)
