"""The KV cache's storage types (--kv-cache-dtype): what auto picks, what a type costs in
bytes and so in tokens per --kv-memory, every attention path reading every type, and on the
real models the accuracy each type keeps against the float32 cache
(`gapless bench kv-accuracy`, bench/kv_accuracy.py, measures it; its figures are in
docs/server.md)."""

from __future__ import annotations

import contextlib
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import require_our_kernels
from test_model import hf_model, prompt

from gapless import LLM, Engine, EngineConfig, SamplingParams
from gapless import kernels as kernels_module
from gapless.bench import kv_accuracy
from gapless.engine import builder
from gapless.engine.runner import ModelRunner
from gapless.kernels import (
    KV_CACHE_DTYPES,
    AttentionLayout,
    Kernels,
    Span,
    attention,
    blocks,
    build,
    kv_cache_name,
    kv_cache_row,
    paged,
)
from gapless.kernels.decode_layers import DecodeLayers
from gapless.kernels.extensions import GGUF_BLOCKS, LEVELS, PACKAGE, PAGED_ATTENTION
from gapless.kernels.kv_format import INT8_ROWS, dequantize_q8, quantize_q8
from gapless.kernels.machine import Machine, machine
from gapless.kernels.plans import GatheredPlan, InPlacePlan, PagedPlan
from gapless.kernels.step_ops import write_kv
from gapless.model.loader import load_decoder

CPU = torch.device("cpu")
TYPES = list(KV_CACHE_DTYPES)


def test_auto_is_float16_where_the_cpu_converts_it_else_the_attention_dtype(monkeypatch):
    zen2 = Machine("Zen 2", ("f16c", "avx2"), "AVX2", None)
    monkeypatch.setattr(kernels_module, "machine", lambda: zen2)
    plain = Kernels(CPU, torch.float32, False, False)
    assert plain.kv_cache_dtype("auto", 64) == torch.float16
    # Where attention runs in bf16 (a bf16 run, or a quantized float32 one whose prompt chunks
    # our bf16 kernel attends) the cache was bf16 already.
    assert Kernels(CPU, torch.bfloat16, False, False).kv_cache_dtype("auto", 64) == torch.bfloat16
    reduced = Kernels(
        CPU, torch.float32, False, False, paged_prefill=True, reduced_dtype=torch.bfloat16
    )
    assert reduced.kv_cache_dtype("auto", 64) == torch.bfloat16
    cuda = Kernels(torch.device("cuda"), torch.bfloat16, False, False)
    assert cuda.kv_cache_dtype("auto", 64) == torch.bfloat16
    monkeypatch.setattr(kernels_module, "machine", lambda: Machine("old", (), "DEFAULT", None))
    assert plain.kv_cache_dtype("auto", 64) == torch.float32
    assert plain.kv_cache_dtype("int8", 64) == INT8_ROWS
    assert plain.kv_cache_dtype("bfloat16", 64) == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 32; this model's is 48"):
        plain.kv_cache_dtype("int8", 48)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig.of(kv_cache_dtype="int4")


def test_auto_keeps_a_checkpoints_own_dtype_and_caches_in_it(monkeypatch):
    # A CPU with fast bf16: the fast pick for GGUF files and --quantize, not for checkpoints.
    monkeypatch.setattr(kernels_module, "_fast_cpu_half", lambda dtype: True)
    assert kernels_module.resolve_dtype("auto", CPU) == torch.bfloat16
    assert kernels_module.resolve_dtype("auto", CPU, stored=torch.float32) == torch.float32
    assert kernels_module.resolve_dtype("auto", CPU, stored=torch.bfloat16) == torch.bfloat16
    assert kernels_module.resolve_dtype("auto", CPU, stored=torch.float16) == torch.float32
    cuda = torch.device("cuda")
    assert kernels_module.resolve_dtype("auto", cuda, stored=torch.float16) == torch.float16
    # and one without: a bf16 checkpoint's exact upcast
    monkeypatch.setattr(kernels_module, "_fast_cpu_half", lambda dtype: False)
    assert kernels_module.resolve_dtype("auto", CPU, stored=torch.bfloat16) == torch.float32
    zen2 = Machine("Zen 2", ("f16c", "avx2"), "AVX2", None)
    monkeypatch.setattr(kernels_module, "machine", lambda: zen2)
    exact = Kernels(CPU, torch.float32, False, False, exact_kv=True)
    assert exact.kv_cache_dtype("auto", 64) == torch.float32  # not F16C's float16


@pytest.fixture(params=["auto", "avx2"])
def kernels_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """This CPU as it is (bf16 where it has it), and as one with AVX2 only."""
    monkeypatch.setenv("GAPLESS_KERNELS", request.param)
    machine.cache_clear()
    yield request.param
    machine.cache_clear()


@pytest.mark.parametrize(
    "arch, split",
    [
        ("llama", {}),
        ("mistral", {}),
        ("qwen2", {}),
        ("llama", {"tensor_parallel_size": 2}),
        ("qwen2", {"pipeline_parallel_size": 2}),
    ],
)
def test_a_float32_checkpoint_under_default_flags_is_transformers_float32(
    checkpoint, kernels_level, arch, split
):
    path, ids = checkpoint(arch), prompt(60, seed=5)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].log_softmax(-1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    with LLM(path, **split) as llm:  # every flag at its default
        out = llm.generate([ids], params)[0]
    diff = max(
        abs(out.prompt_logprobs[pos][1] - ref[pos - 1, ids[pos]].item())
        for pos in range(1, len(ids))
    )
    assert diff < 1e-4  # the project's float32 bound (test_families.py)


def test_this_machine_reports_f16c():
    """Every x86-64 CPU since 2013 has it; auto's float16 depends on the flag being read."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("not an x86-64 CPU")
    assert "f16c" in machine().cpu_isa


def test_int8_on_a_head_size_it_cannot_hold_stops_the_start(checkpoint):
    with pytest.raises(ValueError, match="int8 needs a head size that is a multiple of 32"):
        Engine.from_pretrained(
            checkpoint("llama"), EngineConfig.of(dtype="float32", kv_cache_dtype="int8")
        )


@pytest.mark.parametrize(
    ("kv", "row_bytes"), [("float32", 128), ("bfloat16", 64), ("float16", 64), ("int8", 34)]
)
def test_kv_memory_holds_as_many_tokens_as_the_types_bytes_allow(checkpoint, kv, row_bytes):
    """qwen3's tiny checkpoint: 2 layers of 2 KV heads of 32 values; int8 stores a head in
    32 codes and 2 bytes of float16 scale (q8_0's 34 bytes per 32 values, as llama.cpp's)."""
    decoder = load_decoder(checkpoint("qwen3"), "float32")
    budget = 2**24
    config = EngineConfig.of(dtype="float32", kv_cache_dtype=kv, kv_memory_gib=budget / 2**30)
    runner = builder.kv_runner(decoder, config)
    per_token = 2 * 2 * 2 * row_bytes  # layers, K and V, heads
    assert ModelRunner.kv_bytes_per_token(decoder, runner.kv_cache_dtype) == per_token
    assert runner.num_blocks == budget // (per_token * 16)
    keys, values = runner.kv_cache[0]
    assert keys.dtype == runner.kv_cache_dtype == KV_CACHE_DTYPES[kv]
    assert keys.nbytes + values.nbytes == runner.num_blocks * 16 * per_token // 2


def test_write_kv_stores_int8_rows_as_kv_format_defines_them():
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, 64, generator=gen) for _ in range(2))
    k_cache, v_cache = (torch.zeros(4, 16, 2, 68, dtype=INT8_ROWS) for _ in range(2))
    slots = torch.tensor([5, 0, 33])
    got_k, got_v = write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1)[slots], quantize_q8(k))
    assert torch.equal(v_cache.flatten(0, 1)[slots], quantize_q8(v))
    assert k_cache.flatten(0, 1)[1:5].count_nonzero() == 0
    # What a later step reads back, in the keys' dtype: the chunk attends the same values.
    assert got_k.dtype == torch.float32 and torch.equal(got_k, dequantize_q8(quantize_q8(k)))
    assert torch.equal(got_v, dequantize_q8(quantize_q8(v)))


HEADS, KV_HEADS, DIM, BS, BLOCKS = 4, 2, 32, 16, 16

# Per path: the Kernels' switches, the batch's sequences (history, new tokens), decodes
# first, the layer's window and softcap, and the plan its last part gets (None: our paged
# kernel's where the probe says it takes the cache's type, else SDPA's).
PATHS = {
    "decodes": ({"paged_decode": True}, [(40, 1), (17, 1)], None, None, None),
    "lone decode in place": ({"in_place_attention": True}, [(40, 1)], None, None, InPlacePlan),
    "chunk in place": ({"in_place_attention": True}, [(35, 20)], None, None, InPlacePlan),
    "decode and chunk gathered, window": ({}, [(33, 1), (35, 20)], 24, None, GatheredPlan),
    "chunk in place, softcap": ({"in_place_attention": True}, [(35, 20)], None, 5.0, InPlacePlan),
    "decodes, softcap": ({"paged_decode": True}, [(40, 1), (17, 1)], None, 5.0, None),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", TYPES)
def test_every_path_attends_every_cache_type_as_its_values_read_back(path, kv):
    """Float32 attention over a cache written by write_kv in the type: each path (our paged
    kernel where the probe says it takes the pair, else SDPA or the flash op over what they
    read, converted) matches attention in float32 over the values the cache holds."""
    switches, seqs, window, softcap, plan_type = PATHS[path]
    cache_dtype = KV_CACHE_DTYPES[kv]
    kernels = Kernels(CPU, torch.float32, False, **{"in_place_attention": False, **switches})
    gen = torch.Generator().manual_seed(len(path))
    width = kv_cache_row(DIM, cache_dtype)
    cache = tuple(torch.zeros(BLOCKS, BS, KV_HEADS, width, dtype=cache_dtype) for _ in range(2))
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    spans, seq_slots, own_slots, row = [], [], [], 0
    for start, n in seqs:
        blocks = -(-(start + n) // BS)
        table, free = free[:blocks], free[blocks:]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start + n)])
        history = [torch.randn(start, KV_HEADS, DIM, generator=gen) for _ in range(2)]
        write_kv(*history, *cache, slots[:start])
        spans.append(Span(row, start, n, table))
        seq_slots.append(slots)
        own_slots.append(slots[start:])
        row += n
    # The batch's own keys and values, written as the decoder writes them, then attended.
    k, v = (torch.randn(row, KV_HEADS, DIM, generator=gen) for _ in range(2))
    k, v = write_kv(k, v, *cache, torch.cat(own_slots))
    q = torch.randn(k.shape[0], HEADS, DIM, generator=gen)

    layout = AttentionLayout(BS, (window,), DIM, HEADS // KV_HEADS, CPU, cache_dtype)
    plans = kernels.plan_attention(layout, spans)
    if plan_type is None:
        plan_type = PagedPlan if kernels.decodes_paged(DIM, cache_dtype) else GatheredPlan
    assert isinstance(plans[-1], plan_type)
    got = kernels.attention(q, k, v, cache, plans, window, softcap)

    flat = [attention.values(c.flatten(0, 1), torch.float32) for c in cache]
    for span, slots in zip(spans, seq_slots, strict=True):
        n, end = span.num_tokens, span.start + span.num_tokens
        keys, values = flat[0][slots], flat[1][slots]  # [L, Hkv, D]
        rows = q[span.row : span.row + n].view(n, KV_HEADS, -1, DIM)
        scores = torch.einsum("nkgd,lkd->nkgl", rows, keys) * DIM**-0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos, key_pos = torch.arange(span.start, end), torch.arange(end)
        allowed = key_pos <= pos[:, None]
        if window is not None:
            allowed &= pos[:, None] - key_pos < window
        weights = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(-1)
        want = torch.einsum("nkgl,lkd->nkgd", weights, values).reshape(n, -1)
        # Over a bf16 cache our kernel sums values on the bf16 dot-product instruction, with
        # the softmax weights rounded to bf16 (as flash attention does on GPUs).
        tolerance = 4e-3 if kv == "bfloat16" else 1e-4
        assert (got[span.row : span.row + n] - want).abs().max().item() < tolerance


ACCURACY = kv_accuracy
# Bounds on the mean |delta log-probability| of the next tokens against the float32 cache's
# run, over 512 tokens of prose (issue 38).
MEAN_BOUND = {"float16": 0.02, "bfloat16": 0.02, "int8": 0.05}
# Where an answer parts from the float32 cache's, the float32 run's log-probability of its own
# token there may exceed that of the token the other type chose by less than this: a near-tie.
# Half a nat is about the largest shift of one token's log-probability that a type was
# measured to cause over the prose (the drifts' max |delta|, on every run and model: int8 up
# to 0.52, float16 and bfloat16 up to 0.30; docs/server.md), and a type moves both tokens: a
# gap of twice that is one the types' rounding can close, through decode rows rounded to 8
# bits per block that turn the smallest change into a step. The partings measured were at
# margins of 0.29 and below, and one at 0.755 (int8, SmolLM2, AVX2 build, once prompt chunks
# ran on dense weight copies: listed in docs/server.md); a larger one is the type changing
# what the model prefers, and fails.
NEAR_TIE = 1.0
# Attention in float32, where a storage type's rounding is all that differs: our kernels, as
# a CPU without fast bf16 runs them (where auto picks float16), in this CPU's build and as
# an AVX2 CPU and one without AVX2 (the portable build) run them; and the torch fallback.
# Where attention runs in bf16 (quantized weights on AVX512-BF16), the float32 cache's run
# attends on other paths than the bf16 cache's (the flash op in bf16, until our kernel reads
# a float32 cache with bf16 queries) and the difference is mostly theirs; auto keeps bf16
# there, the cache those runs always had (docs/server.md has both runs' figures).
BUILDS = {"native": None, "avx2": "avx2", "portable": "portable"}  # run -> LEVELS' level
RUNS = (*BUILDS, "fallback")
# Seconds for a model's run, its measurement included: the fallback dequantizes a Q4 file's
# weights in every forward, minutes on 2 cores.
MODEL_TIMEOUT = 1200


@dataclass
class Measured:
    drifts: dict[str, Any]  # by type: kv_accuracy.Drift
    partings: dict[str, dict[int, Any]]  # by type: prompt -> kv_accuracy.Parting
    level: str | None  # the level of our kernels' builds the run meant to load; None: fallback
    modules: tuple[str, ...]  # the builds it loaded, of PAGED_ATTENTION and GGUF_BLOCKS
    calls: Counter[str]  # of our kernels by the decoder: paged attention by cache type, gemv, mm


@contextlib.contextmanager
def counting_our_kernels(calls: Counter[str]) -> Iterator[None]:
    """Counts the calls of our paged attention kernel (by the cache's type) and of our GGUF
    block products, where the decoder's plans and linears call them (and the probe, which
    must have run before), and the decode steps' native call, which runs both inside (by
    the cache's type too)."""
    attend, gemv, mm = paged.paged_attention, blocks.gemv, blocks.mm
    decode_layers = DecodeLayers.run

    def paged_attention(q, k_cache, *args, **kwargs):
        calls[f"paged attention over {kv_cache_name(k_cache.dtype)}"] += 1
        return attend(q, k_cache, *args, **kwargs)

    def decode_call(self, x, kv_cache, *args):
        calls[f"decode call over {kv_cache_name(kv_cache[0][0].dtype)}"] += 1
        return decode_layers(self, x, kv_cache, *args)

    def counted(name: str, product: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args, **kwargs):
            calls[name] += 1
            return product(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged, "paged_attention", paged_attention)
        patch.setattr(blocks, "gemv", counted("gemv", gemv))
        patch.setattr(blocks, "mm", counted("mm", mm))
        patch.setattr(DecodeLayers, "run", decode_call)
        yield


@pytest.fixture(
    scope="module", params=[(m, r) for m in ACCURACY.models() for r in RUNS], ids=" / ".join
)
def measured(request: pytest.FixtureRequest) -> Measured:
    """A model's drifts and answers on one run, from one load of it."""
    model, run = request.param
    level = build.cpu_level() if run == "native" else BUILDS.get(run)
    if level and (missing := set(LEVELS[level]) - set(machine().cpu_isa)):
        pytest.skip(f"this CPU lacks {sorted(missing)}, which the {level} build runs on")
    started, calls, modules = time.monotonic(), Counter[str](), ()
    with contextlib.ExitStack() as stack:
        if level is None:
            stack.enter_context(pytest.MonkeyPatch.context()).setenv("GAPLESS_KERNELS", "fallback")
        else:
            stack.enter_context(ACCURACY.our_kernels(BUILDS[run]))
            modules = tuple(m.__name__ for m in (paged.extension(), blocks.extension()) if m)
            require_our_kernels(len(modules) == 2, f"the {level} builds of our kernels")
        decoder, tokenizer = ACCURACY.load(ACCURACY.models()[model])
        kernels = decoder.kernels
        described = kernels.describe()  # the CPU the run was shown, in there only
        assert kernels.attention_dtype == torch.float32
        # The probe tries our paged kernel on each cache type the first time it is asked:
        # here, so that only the decoder's calls are counted.
        for cache_dtype in KV_CACHE_DTYPES.values():
            kernels.decodes_paged(decoder.config.head_dim, cache_dtype)
        stack.enter_context(counting_our_kernels(calls))
        drifts = ACCURACY.drifts(decoder, ACCURACY.prose_ids(tokenizer), tuple(MEAN_BOUND))
        reference = ACCURACY.reference_answers(decoder, tokenizer)
        partings = {
            kv: ACCURACY.partings(ACCURACY.answers(decoder, tokenizer, kv), reference)
            for kv in MEAN_BOUND
        }
    print(f"\n{model} / {run}: {time.monotonic() - started:.0f} s, {described}")
    for kv, drift in drifts.items():
        where = {i: f"token {p.position}, margin {p.margin:.3f}" for i, p in partings[kv].items()}
        print(f"  {kv} {drift}, answers parted from float32's: {where}")
    return Measured(drifts, partings, level, modules, calls)


@pytest.mark.timeout(MODEL_TIMEOUT)
def test_each_run_is_on_the_kernels_it_names(measured):
    """Our kernels' runs loaded the builds for their level and ran on them, the paged kernel
    over every cache type and the GGUF blocks in decodes and chunks: a build that failed to
    load would have sent the run to the torch paths without a word. The fallback ran none."""
    if measured.level is None:
        assert not measured.calls
        return
    # The install's build, or where its sources changed since, the one compiled on first use
    # (build.cache_directory names it so).
    for module, ext in zip(measured.modules, (PAGED_ATTENTION, GGUF_BLOCKS), strict=True):
        build_name = ext.module(measured.level)
        assert module in (
            f"{PACKAGE}.{build_name}",
            build.cache_directory(ext, measured.level).name,
        )
    for kv in TYPES:
        # decodes attend on the paged kernel inside the decode call, prompt chunks outside it
        ours = (
            measured.calls[f"paged attention over {kv}"] + measured.calls[f"decode call over {kv}"]
        )
        assert ours > 0, kv
    decode_calls = sum(n for name, n in measured.calls.items() if name.startswith("decode call"))
    assert decode_calls > 0  # these files' layers take it
    assert measured.calls["gemv"] > 0 and measured.calls["mm"] > 0


@pytest.mark.timeout(MODEL_TIMEOUT)
def test_each_type_keeps_the_next_token_probabilities_within_bounds(measured):
    for kv, drift in measured.drifts.items():
        assert drift.mean_abs <= MEAN_BOUND[kv], kv


@pytest.mark.timeout(MODEL_TIMEOUT)
def test_each_type_keeps_the_answer_to_what_is_the_capital_of_france(measured):
    """The first prompt's greedy answer is the float32 cache's on every type and run."""
    assert ACCURACY.PROMPTS[0] == "What is the capital of France?"
    for kv, parted in measured.partings.items():
        assert 0 not in parted, kv


@pytest.mark.timeout(MODEL_TIMEOUT)
def test_each_type_keeps_the_float32_caches_answers_but_at_near_ties(measured):
    """Each prompt's greedy answer is the float32 cache's, token for token, or parts from it
    where the float32 run nearly tied: its own token's log-probability less than NEAR_TIE
    above that of the token the other type chose. On these quantized files a decode step's
    activations are rounded to 8 bits per block, which turns the smallest difference into a
    step. Past the parting nothing is compared: each answer then goes on from its own text,
    so its later tokens differ from float32's whatever the cache type does."""
    for kv, parted in measured.partings.items():
        for name, parting in parted.items():
            assert parting.margin < NEAR_TIE, (kv, ACCURACY.PROMPTS[name], parting)
