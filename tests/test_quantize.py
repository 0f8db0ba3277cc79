"""Weight-only int8/int4 linears: the kernels against their dequantize-then-matmul fallback,
round-to-nearest quantization at load, and GGUF Q4_0/Q4_1 weights run on the int4 kernel."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from helpers import require_our_kernels
from test_model import ModelRunner, Seq, run_chunks

import gapless.engine.scheduler
from gapless import LLM, SamplingParams
from gapless.engine.config import EngineConfig
from gapless.kernels.linear import BlockLinear, Int4Linear, Int8Linear
from gapless.kernels.probe import int4_mm_works, int8_mm_works
from gapless.model.gguf import unpack
from gapless.model.loader import load_decoder
from gapless.model.quantize import quantize_int4, quantize_int8

CPU_KERNEL_DTYPES = [dt for dt in (torch.bfloat16, torch.float32) if int8_mm_works("cpu", dt)]


def weight(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.rand(rows, 1, generator=gen) + 0.1
    return torch.randn(rows, cols, generator=gen) * row_scale


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def check_kernel_against_fallback(make, kernel_dtype: torch.dtype) -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    other = torch.randn(5, 64)
    fast, fallback = make(kernel_dtype, 16), make(None, 0)
    assert fast.kernel_max_rows == 16 and fallback.kernel_max_rows == 0
    # bf16 activations round each input to 8 significant bits: ~1% here, float32 ~1e-6.
    bound = 2e-2 if kernel_dtype == torch.bfloat16 else 1e-5
    for got, want in [
        (fast(x), fallback(x)),
        (fast(x[:1]), fallback(x[:1])),
        (fast.silu(x), fallback.silu(x)),
        (fast.times(x, other), fallback.times(x, other)),
    ]:
        assert got.dtype == want.dtype == torch.float32
        assert rel_err(got, want) < bound
    # The fallback is the float matmul of the dequantized weight, bias added.
    w = fallback.weight.dequantize()
    assert torch.allclose(fallback(x), F.linear(x, w, fallback.bias), atol=1e-5)


@pytest.mark.parametrize("kernel_dtype", CPU_KERNEL_DTYPES)
def test_int8_kernel_matches_its_fallback(kernel_dtype):
    q, bias = quantize_int8(weight()), torch.randn(64)
    check_kernel_against_fallback(lambda dt, rows: Int8Linear(q, bias, dt, rows), kernel_dtype)


@pytest.mark.skipif(not int4_mm_works("cpu", torch.bfloat16), reason="no CPU int4 kernel")
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("kernel_dtype", [torch.bfloat16, torch.float32])
def test_int4_kernel_matches_its_fallback(group_size, kernel_dtype):
    if not int4_mm_works("cpu", kernel_dtype):
        pytest.skip(f"the int4 kernel does not take {kernel_dtype}")
    q, bias = quantize_int4(weight(), group_size), torch.randn(64)
    check_kernel_against_fallback(lambda dt, rows: Int4Linear(q, bias, dt, rows), kernel_dtype)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_gguf_q4_blocks_run_exactly_on_the_int4_kernel(qtype):
    # Checks the kernel's convention, (code - 8) * scale + zero, against the reference.
    if not int4_mm_works("cpu", torch.float32):
        pytest.skip("the int4 kernel does not take float32 activations")
    w = weight().numpy()
    blocks = gguf.quants.quantize(w, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    x = torch.randn(3, 256)
    got = Int4Linear(unpack(torch.from_numpy(blocks), qtype), None, torch.float32, 16)(x)
    assert rel_err(got, x @ reference.T) < 1e-5


def test_round_to_nearest_is_within_half_a_step():
    w = weight()
    w[2] = 0.0  # a zero row (int8) and zero groups (int4) get scale 0, not NaN
    q8 = quantize_int8(w)
    assert q8.codes.dtype == torch.int8 and q8.scale.shape == (64, 1)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-6).all()
    for group_size in (32, 64, 128):
        q4 = quantize_int4(w, group_size)
        assert int(q4.codes.max()) == 15 and q4.scale.shape == (64, 256 // group_size)
        error = (q4.dequantize() - w).abs().view(64, -1, group_size)
        assert (error <= q4.scale[..., None] / 2 + 1e-6).all()


def mean_kl(want: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(want) || softmax(got)), in nats."""
    log_p, log_q = want.log_softmax(-1), got.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def demo_text_ids(demo_checkpoint) -> list[int]:
    from gapless.model.tokenizer import Tokenizer

    text = Path(gapless.engine.scheduler.__file__).read_text()
    return Tokenizer.from_pretrained(demo_checkpoint).encode(text)[:48]


# The targets for real models; the trained demo model meets them too (int8 ~2e-4,
# int4 ~0.02 here).
@pytest.mark.parametrize("method,max_kl", [("int8", 0.005), ("int4", 0.05)])
def test_quantize_at_load_stays_close_to_float(demo_checkpoint, demo_text_ids, method, max_kl):
    ids = demo_text_ids
    exact = run_chunks(
        ModelRunner(load_decoder(demo_checkpoint, "float32"), 8, 16), Seq(ids, 0), [48]
    )
    decoder = load_decoder(demo_checkpoint, "float32", quantize=method)
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    # Into GGUF blocks (Q8_0, Q4_1) on our kernels.
    assert isinstance(decoder.layers[0].qkv, BlockLinear)
    assert isinstance(decoder.lm_head.narrow, BlockLinear)
    assert decoder.embed.dtype == torch.float32  # tied: the embeddings stay float
    # One chunk runs the dense path (dequantized tiles), chunks of 16 the decode kernels.
    for sizes in ([48], [16, 16, 16]):
        got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), sizes)
        assert mean_kl(exact, got) < max_kl


def test_untied_lm_head_is_quantized_too(checkpoint):
    decoder = load_decoder(checkpoint("qwen3"), "float32", quantize="int4", group_size=64)
    assert isinstance(decoder.lm_head, Int4Linear) and decoder.lm_head.weight.group_size == 64


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_chunk_size_does_not_change_quantized_tokens(demo_checkpoint, demo_text_ids, method):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = [
        LLM(demo_checkpoint, dtype="float32", quantize=method, prefill_chunk=chunk)
        .generate([demo_text_ids], params)[0]
        .token_ids
        for chunk in (1, 7, 64)
    ]
    assert outputs[0] == outputs[1] == outputs[2]


def test_unknown_quantization_is_a_clear_error(demo_checkpoint):
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose int8 or int4"):
        EngineConfig.of(quantize="int3")
    with pytest.raises(ValueError, match=r"int4 group size must be one of \(32, 64, 128\)"):
        LLM(demo_checkpoint, quantize="int4", quantize_group_size=48)
