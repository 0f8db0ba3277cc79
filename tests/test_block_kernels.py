"""Our GGUF block kernels (kernels/blocks.py) on the 32-element types: dequantize equals the
`gguf` package's to the bit, and the decode and prompt-chunk products equal F.linear with
the dequantized weight. Each case runs on every build this CPU can run: the native one
(AVX-512 VNNI here), AVX2 only, and the portable one with no ISA flags."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gapless.kernels import blocks
from gapless.kernels.probe import machine

Q32 = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL"}
WITH_MIN = {3, 7}  # an f16 minimum after the f16 scale
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
    """Random codes, with scales of sensible magnitude (finite f16) where the scales go."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    gen = np.random.default_rng(seed)
    data = gen.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    n = len(data)
    scale = gen.uniform(1e-3, 2e-2, n) * gen.choice([-1, 1], n)
    data[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype in WITH_MIN:
        data[:, 2:4] = gen.uniform(-0.1, 0.1, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(data.reshape(rows, -1))


def reference(b: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values).view(-1, cols)


def act_q8(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it in gemv: 8 bits per 32 values (ggml's Q8_0), dequantized."""
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d == 0, 0, 1 / d))  # to nearest even, as the kernels
    return (q * d).view_as(x)


def assert_close_to_sums(got, want, x, w, rel):
    """|got - want| within rel of sum |x| |w| per output: rounding of sums that cancel."""
    bound = x.abs().double() @ w.abs().double().T
    err = (got.double() - want.double()).abs()
    assert (err <= rel * bound + 1e-30).all(), (err / bound).max().item()


@pytest.mark.parametrize("qtype", Q32, ids=Q32.values())
def test_dequantize_equals_the_gguf_package(ext, qtype):
    b = random_blocks(qtype, 7, 96)
    want = reference(b, qtype, 96)
    got = ext.dequantize(b, qtype, 96, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(ext.dequantize(b, qtype, 96, torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize("qtype", Q32, ids=Q32.values())
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k", [96, 1056])
def test_gemv_equals_linear_on_8_bit_activations(ext, qtype, m, k):
    b = random_blocks(qtype, 200, k, seed=m)
    w = reference(b, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    xq = act_q8(x)
    got = ext.gemv(x, b, qtype)
    # Against F.linear on the same 8-bit activations only float32 rounding differs (sums in
    # another order, and the centre folded out through each block's sum). Against float x
    # the 8-bit activations themselves add up to ~0.4% of sum |x| |w| (half a step of
    # max |x| / 127 a value), which is what a decode step gives up.
    assert_close_to_sums(got, F.linear(xq.double(), w.double()), x, w, 1e-5)
    assert_close_to_sums(got, F.linear(x, w), x, w, 1e-2)


@pytest.mark.parametrize("qtype", Q32, ids=Q32.values())
@pytest.mark.parametrize("m", [17, 64])
def test_mm_equals_linear_on_the_dequantized_weight(ext, qtype, m):
    b = random_blocks(qtype, 200, 96, seed=m)
    w = reference(b, qtype, 96)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    got = ext.mm(x, b, qtype)
    assert got.dtype == torch.float32
    assert_close_to_sums(got, F.linear(x.double(), w.double()), x, w, 1e-5)
    # bf16: the weight and x rounded to bf16 as F.linear in bf16 has them, the output once.
    got = ext.mm(x.bfloat16(), b, qtype)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.bfloat16().double(), w.bfloat16().double())
    assert_close_to_sums(got, want, x, w, 1e-2)


def test_mm_runs_in_inference_mode(ext):
    """The decoder's forward runs in inference mode, which mm's worker threads must share
    to write its output."""
    b = random_blocks(2, 200, 96)
    x = torch.randn(64, 96)
    with torch.inference_mode():
        got = ext.mm(x, b, 2)
    assert_close_to_sums(got, F.linear(x, reference(b, 2, 96)), x, reference(b, 2, 96), 1e-5)


def test_unsupported_types_and_shapes_say_so(ext):
    with pytest.raises(RuntimeError, match="GGUF block type 1 has no kernel"):
        ext.gemv(torch.ones(1, 32), torch.zeros(2, 64, dtype=torch.uint8), 1)
    with pytest.raises(RuntimeError, match="Q4_0 rows of 64 values take 36 bytes, not 34"):
        ext.gemv(torch.ones(1, 64), torch.zeros(2, 34, dtype=torch.uint8), 2)
    assert all(ext.has_type(t) for t in Q32) and not ext.has_type(1)


def test_the_wrappers_run_the_native_build():
    if blocks.extension() is None:
        pytest.skip("our block kernels cannot be built here (no compiler or Python headers)")
    b = random_blocks(2, 64, 64)
    x = torch.randn(2, 64)
    w = reference(b, 2, 64)
    assert blocks.supported(2) and not blocks.supported(1)
    assert torch.equal(blocks.dequantize(b, 2, 64), w)
    assert_close_to_sums(blocks.gemv(x, b, 2), F.linear(act_q8(x), w), x, w, 1e-5)
    assert_close_to_sums(blocks.mm(x, b, 2), F.linear(x, w), x, w, 1e-5)
