"""The kernels seam: the probe's choices, their fallbacks, and attention straight from the
paged cache, each matching the public-op path on the tiny checkpoints."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import require_our_kernels
from test_model import Seq, hf_model, prompt, run_chunks
from test_quantize import rel_err

import gapless.kernels as kernels
from gapless import LLM, SamplingParams
from gapless.engine.runner import ModelRunner
from gapless.kernels import kv_format, step_ops
from gapless.kernels.extensions import LEVELS, PAGED_ATTENTION
from gapless.kernels.linear import Int4Linear, NarrowLinear, PackedLinear, PlainLinear
from gapless.kernels.machine import Machine
from gapless.kernels.plans import (
    AttentionLayout,
    GatheredPlan,
    InPlacePlan,
    PagedPlan,
    Planner,
    Span,
)
from gapless.kernels.probe import packed_linear_works
from gapless.model.loader import load_decoder
from gapless.model.quantize import quantize_int4

CPU = torch.device("cpu")


def test_startup_names_the_kernels_in_one_line(caplog, monkeypatch):
    kernels.select(CPU, torch.float32)  # the one-off build of our kernel logs a line of its own
    caplog.clear()
    with caplog.at_level(logging.INFO, "gapless.kernels"):
        chosen = kernels.select(CPU, torch.float32)
    assert [r.message for r in caplog.records] == [chosen.describe()]
    assert chosen.describe().startswith("kernels: cpu ")
    assert chosen.packed_linear == packed_linear_works(torch.float32)

    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    forced = kernels.select(CPU, torch.float32)
    assert not forced.packed_linear and not forced.in_place_attention
    assert isinstance(forced.linear(torch.ones(4, 4)), PlainLinear)
    assert "F.linear linear, gathered sdpa attention" in forced.describe()
    monkeypatch.setenv("GAPLESS_KERNELS", "fast")
    with pytest.raises(ValueError, match="choose auto, fallback or a level"):
        kernels.select(CPU, torch.float32)


def test_quantized_weights_run_float32_with_bf16_compute_where_bf16_is_fast(monkeypatch):
    isa = ("avx2", "avx512", "avx512-bf16")
    monkeypatch.setattr(kernels, "machine", lambda: Machine("Zen 4", isa, "AVX512_CORE", None))
    monkeypatch.setattr(kernels, "packed_linear_works", lambda dtype: True)
    monkeypatch.setattr(
        kernels, "paged_prefill_works", lambda q, cache: q == cache == torch.bfloat16
    )
    assert kernels.resolve_dtype("auto", CPU) == torch.bfloat16
    assert kernels.resolve_dtype("auto", CPU, quantized=True) == torch.float32
    assert kernels.resolve_dtype("auto", torch.device("cuda"), quantized=True) == torch.bfloat16
    chosen = kernels.select(CPU, torch.float32, quantized=True)
    assert chosen.attention_dtype == torch.bfloat16
    assert "bfloat16 attention" in chosen.describe()
    assert chosen.gguf_gemv_max_rows == kernels.DECODE_ROWS  # no AMX
    q = quantize_int4(torch.randn(32, 64), 32)
    linear = chosen.linear(q)
    assert linear.dense_dtype == torch.bfloat16
    x = torch.randn(40, 64)  # more rows than the int kernel takes: the dense path
    want = F.linear(x.bfloat16(), q.dequantize(torch.bfloat16)).float()
    assert torch.equal(linear(x), want)
    # Where our kernel does not attend prompt chunks (no compiler) and the CPU has no AMX,
    # attention stays float32: the flash op computes bf16 at the float32 rate there.
    monkeypatch.setattr(kernels, "paged_prefill_works", lambda q, cache: False)
    flash = kernels.select(CPU, torch.float32, quantized=True)
    assert flash.reduced_dtype == torch.bfloat16 and flash.attention_dtype == torch.float32
    assert "bfloat16 attention" not in flash.describe()
    # Float weights stay float32 throughout; so does the fallback.
    assert kernels.select(CPU, torch.float32).attention_dtype == torch.float32
    assert kernels.select(CPU, torch.bfloat16, quantized=True).linear(q).dense_dtype is None
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    forced = kernels.select(CPU, torch.float32, quantized=True)
    assert forced.linear(q).dense_dtype is None and forced.attention_dtype == torch.float32


def test_a_narrow_lm_head_keeps_its_best_logits_exact():
    """A reduced-dtype run reads a dense lm_head in bf16, whose logits round to steps of 0.125
    near 24: two tokens 0.03 apart would tie. The best 16 per row are recomputed in float32."""
    chosen = kernels.Kernels(CPU, torch.float32, False, False, reduced_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    weight[3] = 24.0 * x[0] / x[0].dot(x[0])  # logit 24.0 in row 0
    weight[7] = 24.03 * x[0] / x[0].dot(x[0])  # the best by 0.03: bf16 rounds both to 24.0
    head = chosen.lm_head(weight)
    assert isinstance(head, NarrowLinear) and head.narrow.weight.dtype == torch.bfloat16
    want = F.linear(x, weight)
    got = head(x)
    top = want.topk(8).indices  # in bf16's top 16 too; its 16th may be another token
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=0, atol=1e-4)
    narrow = F.linear(x.bfloat16(), weight.bfloat16())
    assert narrow[0, 7] == narrow[0, 3] == 24.0 and narrow[0].argmax() == 3  # the tie's pick
    assert got[0].argmax() == 7
    assert (got - want).abs().max() < 0.25  # the rest: bf16's rounding
    # Quantized heads, and runs without a reduced dtype, are left as they are.
    assert isinstance(chosen.lm_head(quantize_int4(weight, 32)), Int4Linear)
    assert isinstance(
        kernels.Kernels(CPU, torch.float32, False, False).lm_head(weight), PlainLinear
    )


@pytest.mark.parametrize("built", [True, False])
def test_amx_attends_prompt_chunks_in_bf16_on_the_tiles(monkeypatch, built):
    """On our kernel's AMX build; where it is not built, on the flash op, whose bf16 products
    run on the tiles too."""
    isa = ("avx2", "avx512", "avx512-bf16", "amx")
    monkeypatch.setattr(kernels, "machine", lambda: Machine("SPR", isa, "AVX512_CORE_AMX", None))
    monkeypatch.setattr(kernels, "packed_linear_works", lambda dtype: True)
    monkeypatch.setattr(kernels, "paged_prefill_works", lambda query, cache: built)
    assert kernels.select(CPU, torch.bfloat16).paged_prefill == built
    quantized = kernels.select(CPU, torch.float32, quantized=True)
    assert quantized.paged_prefill == built and quantized.attention_dtype == torch.bfloat16
    assert quantized.kv_cache_dtype("auto", 64) == torch.bfloat16
    # GGUF linears keep up to AMX_GEMV_ROWS rows on the block kernels, not DECODE_ROWS.
    assert quantized.gguf_gemv_max_rows == kernels.AMX_GEMV_ROWS > kernels.DECODE_ROWS


def test_cuda_gets_public_ops():
    chosen = kernels.Kernels(torch.device("cuda"), torch.bfloat16, False, False)
    assert isinstance(chosen.linear(torch.ones(4, 4)), PlainLinear)
    assert kernels.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_bf16_without_fast_support_runs_on_the_fallback_and_warns(checkpoint, caplog, monkeypatch):
    # What an AVX2-only CPU reports: no bf16 ISA, and oneDNN refuses to pack bf16.
    monkeypatch.setattr(kernels, "machine", lambda: Machine("AVX2 CPU", ("avx2",), "AVX2", None))
    monkeypatch.setattr(kernels, "packed_linear_works", lambda dtype: dtype == torch.float32)
    assert kernels.resolve_dtype("auto", CPU) == torch.float32
    with caplog.at_level(logging.INFO, "gapless.kernels"):
        llm = LLM(checkpoint("qwen2"), dtype="bfloat16", prefill_chunk=16)
    assert "kernels: cpu avx2, bfloat16 F.linear linear" in caplog.text
    assert "bfloat16 is slow on this CPU" in caplog.text and "float32" in caplog.text
    out = llm.generate([prompt(40)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_bf16_warns_when_onednn_is_capped_below_the_cpu(caplog, monkeypatch):
    # A CPU with AVX512-BF16 under ONEDNN_MAX_CPU_ISA=AVX2: the flags say fast, oneDNN refuses.
    isa = ("avx2", "avx512", "avx512-bf16")
    monkeypatch.setattr(kernels, "machine", lambda: Machine("Zen 4", isa, "AVX2", None))
    monkeypatch.setattr(kernels, "packed_linear_works", lambda dtype: dtype == torch.float32)
    assert kernels.resolve_dtype("auto", CPU) == torch.float32
    with caplog.at_level(logging.INFO, "gapless.kernels"):
        chosen = kernels.select(CPU, torch.bfloat16)
    assert not chosen.packed_linear
    assert "bfloat16 is slow on this CPU" in caplog.text


@pytest.mark.skipif(
    not packed_linear_works(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU"
)
def test_packed_bf16_matches_the_fallback(checkpoint, monkeypatch):
    path, ids = checkpoint("llama"), prompt(60)
    packed = load_decoder(path, "bfloat16")
    assert isinstance(packed.layers[0].qkv, PackedLinear)
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    plain = load_decoder(path, "bfloat16")
    a = run_chunks(ModelRunner(packed, 8, 16), Seq(ids, 0), [60])
    b = run_chunks(ModelRunner(plain, 8, 16), Seq(ids, 0), [60])
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    # bf16 rounding alone moves these logits (up to ~6) by ~0.25 on either path.
    bound = 0.1 * ref.abs().max().item()
    assert (a - ref).abs().max().item() < bound and (b - ref).abs().max().item() < bound


def scattered(seq: Seq, table: list[int]) -> Seq:
    seq.req.kv.tables = [table]
    return seq


@pytest.mark.skipif(
    not kernels.cpu_flash_works(torch.float32),
    reason="the CPU flash op is not built here",
)
@pytest.mark.parametrize("max_runs", [8, 2])
def test_history_in_scattered_blocks_is_attended_in_place(checkpoint, max_runs, monkeypatch):
    """A history in three runs of cache blocks: attended run by run (merged by log-sum-exp)
    when the kernels allow that many runs, else gathered; either way the same logits."""
    decoder = load_decoder(checkpoint("qwen3"), "float32")
    runner = ModelRunner(decoder, 32, 16)
    monkeypatch.setattr(
        runner, "kernels", kernels.Kernels(CPU, torch.float32, True, True, 128, max_runs)
    )
    ids = prompt(100)
    whole = run_chunks(runner, Seq(ids, 0), [100])
    seq = scattered(Seq(ids, 0), [20, 21, 9, 10, 11, 25, 26])
    run_chunks(runner, seq, [84])
    batch = runner._build([runner._input(seq.chunk(12), True)])
    plan = batch.attention[0]
    runs = plan.runs if isinstance(plan, InPlacePlan) else None
    assert runs == ([(320, 32), (144, 48), (400, 4)] if max_runs == 8 else None)
    pieces = run_chunks(runner, seq, [12, 1, 1, 1, 1])  # a chunk, then lone decodes
    assert (whole[84:] - pieces).abs().max().item() < 1e-4


def cache_of(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] float32 as a KV cache of cache_dtype (kv_format's storage types)."""
    if kv_format.is_int8_rows(cache_dtype):
        return kv_format.quantize_q8(values)
    return values.to(cache_dtype)


def values_of(cache: torch.Tensor) -> torch.Tensor:
    """What a KV cache holds, as float32."""
    return kv_format.dequantize_q8(cache) if kv_format.is_int8_rows(cache.dtype) else cache.float()


def check_paged_kernel(
    query_dtype,
    cache_dtype,
    heads,
    kv_heads,
    dim,
    window,
    n,
    block_size,
    extra=(0, 15, 16, 69),
    later_last_keys=False,
):
    """Sequences of different lengths, blocks scattered through the cache, GQA and a sliding
    window: each of a sequence's n new queries attends exactly its own keys, causally, or up
    to a later last key of its own (later_last_keys), in the cache as it holds them."""
    gen = torch.Generator().manual_seed(heads * n)
    lengths = [n + e for e in extra]
    batch, width = len(lengths), -(-max(lengths) // block_size)
    k_cache, v_cache = (
        cache_of(
            torch.randn(batch * width + 3, block_size, kv_heads, dim, generator=gen), cache_dtype
        )
        for _ in range(2)
    )
    q = torch.randn(batch * n, heads, dim, generator=gen).to(query_dtype)
    order = torch.randperm(batch * width + 3, generator=gen)
    tables = order[: batch * width].view(batch, width)
    last_keys = None
    if later_last_keys:  # each query's own key, or a random later one of its sequence
        own = torch.cat([torch.arange(length - n, length) for length in lengths])
        ends = torch.tensor(lengths).repeat_interleave(n)
        later = own + (torch.rand(len(own), generator=gen) * (ends - own)).long()
        last_keys = torch.where(torch.rand(len(own), generator=gen) < 0.5, own, later)
    got = kernels.paged.paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(lengths), window, last_keys
    )
    assert got.dtype == query_dtype
    for b, length in enumerate(lengths):
        slots = (tables[b, :, None] * block_size + torch.arange(block_size)).flatten()[:length]
        k, v = (
            values_of(c.flatten(0, 1)[slots]).repeat_interleave(heads // kv_heads, 1)
            for c in (k_cache, v_cache)
        )
        q_pos = torch.arange(length - n, length)[:, None]
        last = q_pos if last_keys is None else last_keys[b * n : (b + 1) * n, None]
        keys = torch.arange(length)[None]
        allowed = (keys <= last) & (q_pos - keys < (window or length))
        scores = torch.einsum("nhd,lhd->nhl", q[b * n : (b + 1) * n].float(), k) / dim**0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        want = torch.einsum("nhl,lhd->nhd", scores.softmax(-1), v).flatten(1)
        # bf16 anywhere: an output, or weights rounded for the bf16 dot-product instruction
        exact = torch.bfloat16 not in (query_dtype, cache_dtype) and n == 1
        tol = 1e-5 if exact else 2e-2
        assert (got[b * n : (b + 1) * n].float() - want).abs().max().item() < tol


def capped_attention(q, keys, values, allowed, cap):
    """The reference: q [n, H, D] over keys, values [L, Hkv, D] where allowed [n, L], scores
    cap * tanh(scores / cap) (None: uncapped), as transformers' eager Gemma 2 attention."""
    group = q.shape[1] // keys.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (keys, values))
    scores = torch.einsum("nhd,lhd->nhl", q, k) / q.shape[-1] ** 0.5
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", scores.softmax(-1), v).flatten(1)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("n", [1, 5, 32])
def test_every_plan_given_a_softcap_attends_with_capped_scores(window, n):
    """Soft-capped attention (Gemma 2) runs on no fused op: each plan type, given a cap,
    attends the same keys under the same mask with capped scores. Paged plans' scattered
    blocks (decodes, and chunks as where our kernel takes them), a fresh chunk's plain causal
    gathered plan, and an in-place plan's history runs plus a chunk's own keys."""
    gen = torch.Generator().manual_seed(n)
    heads, kv_heads, dim, bs, cap = 6, 2, 16, 16, 2.0
    cache = tuple(torch.randn(40, bs, kv_heads, dim, generator=gen) * 3 for _ in range(2))
    flat_k, flat_v = (c.flatten(0, 1) for c in cache)

    lengths = [n + extra for extra in (0, 15, 16, 69)]
    tables = torch.randperm(40, generator=gen)[:28].view(4, 7)
    q = torch.randn(4 * n, heads, dim, generator=gen) * 3
    paged = PagedPlan(slice(0, 4 * n), tables, torch.tensor(lengths))
    got = paged.attend(q, q, q, cache, window, cap)
    for b, length in enumerate(lengths):
        slots = (tables[b, :, None] * bs + torch.arange(bs)).flatten()[:length]
        delta = torch.arange(length - n, length)[:, None] - torch.arange(length)
        allowed = (delta >= 0) & (delta < (window or length))
        rows = slice(b * n, (b + 1) * n)
        want = capped_attention(q[rows], flat_k[slots], flat_v[slots], allowed, cap)
        assert (got[rows] - want).abs().max().item() < 1e-5

    if n % bs == 0:  # a fresh chunk of whole blocks, plain causal
        fresh = GatheredPlan(slice(0, n), n, tables[:1, : n // bs], {window: None})
        slots = (tables[0, : n // bs, None] * bs + torch.arange(bs)).flatten()
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        want = capped_attention(q[:n], flat_k[slots], flat_v[slots], causal, cap)
        assert (fresh.attend(q, q, q, cache, window, cap) - want).abs().max().item() < 1e-5

    if window is None:  # in place: full attention only
        runs = [(3 * bs, 20), (9 * bs + 4, 7)]
        history = torch.cat([torch.arange(first, first + length) for first, length in runs])
        own_k, own_v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
        in_place = InPlacePlan(slice(0, n), runs)
        got = in_place.attend(q[:n], own_k, own_v, cache, None, cap)
        keys, values, allowed = flat_k[history], flat_v[history], torch.ones(n, len(history))
        if n > 1:  # a chunk's own keys, causally; a decode's own key is in its runs
            keys, values = torch.cat((keys, own_k)), torch.cat((values, own_v))
            allowed = torch.cat((allowed, torch.ones(n, n).tril()), dim=1)
        want = capped_attention(q[:n], keys, values, allowed.bool(), cap)
        assert (got - want).abs().max().item() < 1e-5


# A chunk of n tokens from `start` with a bidirectional range (first, end): inside it; begun
# before it (a prefix-cache hit inside an image); across the kernel's 32-query and 32-key tiles.
BIDIRECTIONAL_CHUNKS = {"inside": (20, 37, (30, 50)), "from before": (20, 37, (12, 40))}
BIDIRECTIONAL_CHUNKS["across tiles"] = (20, 70, (25, 80))
# A plan type, and the Kernels fields that make the planner pick it (and, in place,
# in_place_attention).
CHUNK_PATHS = {
    "paged": (PagedPlan, {"paged_prefill": True}),
    "gathered": (GatheredPlan, {"fold_max_queries": 8}),
    "gathered, heads folded": (GatheredPlan, {}),
    "in place": (InPlacePlan, {}),
}


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("chunk", BIDIRECTIONAL_CHUNKS)
@pytest.mark.parametrize("path", CHUNK_PATHS)
def test_every_chunk_plan_lets_a_bidirectional_range_see_to_its_end(path, chunk, window, softcap):
    """Each query of an image's range in a chunk (Gemma 3) attends up to the range's last key,
    later ones included, and back no further than its window; the chunk's other queries
    causally. On every path a prompt chunk can take, capped or not."""
    plan_type, fields = CHUNK_PATHS[path]
    paged = path == "paged"
    if paged:
        require_paged_prefill()
    if path == "in place" and window is not None:
        pytest.skip("in place is full attention's path")
    start, n, (first, end) = BIDIRECTIONAL_CHUNKS[chunk]
    dtype = torch.bfloat16 if paged else torch.float32
    heads, kv_heads, dim, bs = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(n + first)
    cache = tuple(torch.randn(12, bs, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(12, generator=gen)[: -(-(start + n) // bs)].tolist()
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start + n)])
    flat_k, flat_v = (c.flatten(0, 1) for c in cache)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)

    chosen = kernels.Kernels(CPU, dtype, False, path == "in place", **fields)
    layout = AttentionLayout(bs, (window,), dim, heads // kv_heads, CPU, dtype)
    [plan] = Planner(chosen, layout).plan([Span(0, start, n, table, ((first, end),))])
    assert isinstance(plan, plan_type)
    own = slots[start:]
    got = plan.attend(q, flat_k[own], flat_v[own], cache, window, softcap)

    pos = torch.arange(start, start + n)
    last = torch.where((pos >= first) & (pos < end), end - 1, pos)
    keys = torch.arange(start + n)
    allowed = (keys <= last[:, None]) & (pos[:, None] - keys < (window or start + n))
    want = capped_attention(
        q.float(), flat_k[slots].float(), flat_v[slots].float(), allowed, softcap
    )
    assert (got.float() - want).abs().max().item() < (2e-2 if paged else 1e-5)


def test_a_bidirectional_range_cut_by_its_chunk_is_refused():
    """Its later keys are not in the cache yet: the scheduler never cuts such a range."""
    chosen = kernels.Kernels(CPU, torch.float32, False, False)
    planner = Planner(chosen, AttentionLayout(16, (None,), 32, 2, CPU, torch.float32))
    with pytest.raises(ValueError, match="does not end within the chunk"):
        planner.plan([Span(0, 0, 16, [0, 1], ((10, 20),))])


def use_paged_build(level: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The build of the paged kernel for `level` as the one paged.paged_attention calls, where
    this CPU runs it; else the test is skipped (the build is checked in test_kernel_builds)."""
    if missing := set(PAGED_ATTENTION.isa(level)) - set(kernels.machine().cpu_isa):
        pytest.skip(
            f"this CPU lacks {sorted(missing)} (the build is checked in test_kernel_builds)"
        )
    built = kernels.paged.extension(level)
    require_our_kernels(built is not None, f"the {level} build of our paged attention kernel")
    monkeypatch.setattr(kernels.paged, "extension", lambda: built)
    return level


@pytest.fixture(params=list(PAGED_ATTENTION.builds().values()))
def paged_build(request, monkeypatch):
    """Each distinct build of the paged kernel the install compiled (by the lowest level that
    runs it)."""
    return use_paged_build(request.param, monkeypatch)


# The builds that run prompt chunks: bf16 dot products (AVX512-BF16), and AMX's tiles.
PREFILL_LEVELS = [
    level for level in PAGED_ATTENTION.builds().values() if "avx512-bf16" in LEVELS[level]
]


@pytest.fixture(params=PREFILL_LEVELS)
def prefill_build(request, monkeypatch):
    """Each build of the paged kernel that runs prompt chunks, where this CPU runs it."""
    return use_paged_build(request.param, monkeypatch)


def require_paged_prefill(cache_dtype=torch.bfloat16) -> None:
    """Prompt chunks run on our kernel with bf16 queries on CPUs with AVX512-BF16
    (csrc/paged_attention.cpp), over a cache of any type."""
    if not kernels.paged.supports(torch.bfloat16, cache_dtype, prefill=True):
        pytest.skip("prompt chunks run on our kernel only on CPUs with AVX512-BF16")
    works = kernels.probe.paged_prefill_works(torch.bfloat16, cache_dtype)
    require_our_kernels(works, "our paged attention kernel's prompt chunks")


QUERY_DTYPES = [torch.float32, torch.bfloat16]
CACHE_DTYPES = kv_format.STORAGE_TYPES


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (14, 2, 128), (4, 1, 256)]
)
@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_kernel_matches_attention_over_gathered_keys(
    paged_build, query_dtype, cache_dtype, heads, kv_heads, dim, window
):
    if kv_format.is_int8_rows(cache_dtype) and dim % kv_format.Q8_GROUP:
        pytest.skip("an int8 cache needs a head size that is a multiple of 32")
    check_paged_kernel(query_dtype, cache_dtype, heads, kv_heads, dim, window, 1, 16)


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(torch.float32, c) for c in CACHE_DTYPES] + [(torch.bfloat16, torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("lengths", [(700,), (2051,), (2051, 3, 40)])
@pytest.mark.parametrize("window", [None, 600])
def test_paged_decode_kernel_splits_long_sequences_exactly(
    paged_build, query_dtype, cache_dtype, lengths, window
):
    """A sequence longer than a thread's share of the batch's keys is cut into parts, whose
    softmaxes the kernel merges: alone, and beside short ones."""
    check_paged_kernel(query_dtype, cache_dtype, 9, 3, 64, window, 1, 16, extra=lengths)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 32), (9, 3, 64), (14, 2, 128), (4, 1, 256)]
)
@pytest.mark.parametrize("window", [None, 20, 40])
@pytest.mark.parametrize(("n", "block_size"), [(5, 16), (37, 8), (70, 32)])
def test_paged_prefill_kernel_matches_attention_over_gathered_keys(
    prefill_build, cache_dtype, heads, kv_heads, dim, window, n, block_size
):
    require_paged_prefill(cache_dtype)
    check_paged_kernel(torch.bfloat16, cache_dtype, heads, kv_heads, dim, window, n, block_size)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
def test_paged_prefill_kernel_attends_each_query_to_its_last_key(
    prefill_build, cache_dtype, window
):
    """A prompt chunk's queries given later last keys (a bidirectional range) see up to them."""
    require_paged_prefill(cache_dtype)
    check_paged_kernel(
        torch.bfloat16, cache_dtype, 9, 3, 64, window, 37, 8, extra=(0, 9, 40), later_last_keys=True
    )


@pytest.mark.parametrize("query_dtype", [*QUERY_DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_paged_kernel_refuses_exactly_the_pairs_it_does_not_support(
    paged_build, query_dtype, cache_dtype, n
):
    """paged.supports, which the probe and kernel choice read, says what each build runs."""
    prefill = n > 1
    q = torch.randn(2 * n, 2, 64).to(query_dtype)
    k_cache = cache_of(torch.randn(3, 4, 1, 64), cache_dtype)
    args = (q, k_cache, k_cache, torch.tensor([[2, 0], [1, 0]]), torch.tensor([6, 3]), None)
    if kernels.paged.supports(query_dtype, cache_dtype, prefill, paged_build):
        assert kernels.paged.paged_attention(*args).dtype == query_dtype
    else:
        with pytest.raises(RuntimeError, match="paged_attention"):
            kernels.paged.paged_attention(*args)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_bf16_chunks_on_our_kernel_match_the_public_ops(checkpoint, arch, monkeypatch):
    """Prompt chunks against their history, and mistral's 24-token window, on the kernel
    (head size 32 is one it takes), against the whole prompt on the public ops."""
    require_paged_prefill()
    path, ids = checkpoint(arch, head_dim=32), prompt(120)
    runner = ModelRunner(load_decoder(path, "bfloat16"), 32, 16)
    batch = runner._build([runner._input(Seq(ids, 0).chunk(40), False)])
    assert isinstance(batch.attention[0], PagedPlan)
    got = run_chunks(runner, Seq(ids, 0), [40, 33, 47])
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    want = run_chunks(ModelRunner(load_decoder(path, "bfloat16"), 32, 16), Seq(ids, 0), [120])
    assert rel_err(got.float(), want.float()) < 0.03


@pytest.mark.parametrize("path", ["ours", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_write_kv_stores_new_keys_as_the_cache_holds_them(path, dtype, cache_dtype, monkeypatch):
    """Cast into a float cache, quantized into an int8 one with quantize_q8's very bytes
    (ties rounded to even, as torch rounds), on our step op and on the torch path; returned
    in the float cache's dtype, or read back from an int8 cache (as later steps read them)."""
    if path == "ours":
        require_our_kernels(kernels.probe.step_ops_work(), "our step ops")
    else:
        monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 4, 64, generator=gen) * torch.logspace(-3, 2, 3)[:, None, None]
    kv[0, 0, :32] = torch.arange(32) - 15.5  # halves: ties to round (max 15.5 / 127 is not)
    kv[0, 0, 0] = 127.0  # scale 1: codes are the values, .5 ties round to even
    kv[1, 1, 32:] = 0.0  # a group of zeros: scale 0, codes 0
    kv = kv.to(dtype)
    k, v = kv[:, :2], kv[:, 2:]  # views with a row stride, as the layers' k and v
    k_cache, v_cache = (cache_of(torch.zeros(3, 4, 2, 64), cache_dtype) for _ in range(2))
    slots = torch.tensor([9, 0, 4])
    got_k, got_v = step_ops.write_kv(k, v, k_cache, v_cache, slots)
    for x, cache, got in ((k, k_cache, got_k), (v, v_cache, got_v)):
        want = cache_of(torch.zeros(3, 4, 2, 64), cache_dtype)
        want.flatten(0, 1)[slots] = cache_of(x.float(), cache_dtype)
        assert torch.equal(cache, want)
        held = (
            kv_format.dequantize_q8(want.flatten(0, 1)[slots], x.dtype)
            if kv_format.is_int8_rows(cache_dtype)
            else None
        )
        assert torch.equal(got, x.to(cache_dtype) if held is None else held)
