"""A decode step's layers in one native call (kernels/decode_layers.py) compute what the ops
compute: the same logits and the same K/V in the cache, bit for bit, on each family it covers
and each GGUF layout (interleaved rows, stacked parts of two types, biases, q/k norms, a
window), on every KV-cache type; on every build this CPU runs. Steps it does not cover
(prompt chunks, mixed steps, the fallback switch) run on the ops, and a family it does not
cover says why."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import require_our_kernels
from test_gguf import GGUF_ARCHS, Q4_K_M_MIX
from test_model import ModelRunner, Seq, prompt

from gapless.bench.gguf_files import write_gguf
from gapless.engine.plan import ScheduledChunk
from gapless.engine.sampling_params import SamplingParams
from gapless.kernels import blocks, paged
from gapless.kernels.decode_layers import DecodeLayers
from gapless.kernels.extensions import GGUF_BLOCKS, LEVELS, PAGED_ATTENTION
from gapless.kernels.machine import machine
from gapless.model.gguf import load_gguf

# The families the call covers, with a config that gives each its quirks: qwen2's biases,
# qwen3's q/k norms, mistral's window (shorter than the sequences below), gemma3's four
# norms, GELU, two ropes, and local layers in a KV group of their own.
ARCHS = {
    "llama": GGUF_ARCHS["llama"],
    "qwen2": {},
    "qwen3": {"head_dim": 64},  # whole K-quant blocks in o's rows too
    "mistral": {"sliding_window": 24},
    "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64},
}
LAYOUTS = {
    "q4_0-interleaved": (QType.Q4_0, None),
    "q4_k_m-stacked": (QType.Q4_K, Q4_K_M_MIX),  # q and k Q4_K beside a Q6_K v
}
SIZES = {"hidden_size": 256, "intermediate_size": 512}  # whole K-quant blocks


def builds_here() -> list[str]:
    """The lowest level of each distinct pair of builds (block kernels, paged kernel) that
    this CPU runs."""
    have = set(machine().cpu_isa)
    pairs = {}
    for level, isa in LEVELS.items():
        if set(isa) <= have:
            pairs.setdefault((GGUF_BLOCKS.module(level), PAGED_ATTENTION.module(level)), level)
    return list(pairs.values())


def exp_is_torchs(level: str) -> bool:
    """Whether the build's silu takes the exp torch's float32 silu takes here (SLEEF's at
    torch's CPU capability): then the call is bit-exact, else within the exp's rounding."""
    width = (
        "AVX512" if "avx512" in LEVELS[level] else "AVX2" if "avx2" in LEVELS[level] else "DEFAULT"
    )
    return torch.backends.cpu.get_cpu_capability() == width


@pytest.fixture(scope="module")
def gguf_path(checkpoint, tmp_path_factory):
    built = {}

    def get(arch: str, layout: str):
        if (arch, layout) not in built:
            qtype, mix = LAYOUTS[layout]
            ckpt = checkpoint(arch, **SIZES, **ARCHS[arch])
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{layout}.gguf"
            built[arch, layout] = write_gguf(ckpt, out, qtype, mix=mix)
        return built[arch, layout]

    return get


def decode_steps(runner: ModelRunner, steps: int = 6) -> tuple[list[torch.Tensor], list]:
    """Three sequences of different lengths prefilled, then decoded together one token a step
    (the ids fed back are fixed, so both paths see the same input): each step's logits, and
    the caches after."""
    seqs = [Seq(prompt(n, seed=n), 8 * i) for i, n in enumerate((37, 20, 29))]
    for i, seq in enumerate(seqs):  # blocks for the decoded tokens too
        seq.req.kv.tables = [list(range(8 * i, 8 * i + 4))]
    for seq in seqs:  # prefill all but the last prompt token
        n = len(seq.req.prompt_ids) - 1
        runner.execute([seq.chunk(n)], {0})
        seq.req.num_computed += n
    logits = []
    for step in range(steps):
        for seq in seqs:
            if step:  # the next token, as if sampled
                seq.req.output_ids.append(int(seq.req.prompt_ids[step]))
        out = runner.execute([ScheduledChunk(s.req, 1) for s in seqs], {0, 1, 2})
        logits.append(torch.stack([rows[-1] for rows in out]))
        for seq in seqs:
            seq.req.num_computed += 1
    return logits, [tuple(c.clone() for c in layer) for layer in runner.kv_cache]


def both_paths(path, kv_cache_dtype: torch.dtype | None = None):
    """decode_steps through the call, then through the ops, on fresh caches each."""
    decoder, _ = load_gguf(path)
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    fused = decoder.decode_layers
    assert fused is not None, "the family's layers were not taken by the native call"
    calls = []
    run = fused.run

    def counted(x, *args):
        calls.append(x.shape[0])
        return run(x, *args)

    fused.run = counted  # type: ignore[method-assign]
    got = decode_steps(ModelRunner(decoder, 32, 16, kv_cache_dtype=kv_cache_dtype))
    assert calls == [3] * 6, "every decode step, and nothing else, takes the call"
    decoder.decode_layers = None
    want = decode_steps(ModelRunner(decoder, 32, 16, kv_cache_dtype=kv_cache_dtype))
    return got, want


def assert_same(got, want, exact: bool = True) -> None:
    (got_logits, got_cache), (want_logits, want_cache) = got, want
    if exact:
        assert all(torch.equal(g, w) for g, w in zip(got_logits, want_logits, strict=True))
        for g, w in zip(got_cache, want_cache, strict=True):
            assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
        return
    # Another exp than torch's moves a value before `down` by a unit in its last place, which
    # can move its 8-bit code: logits by ~1e-2 on these random layers.
    for g, w in zip(got_logits, want_logits, strict=True):
        assert (g.log_softmax(-1) - w.log_softmax(-1)).exp().sub(1).abs().max() < 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_call_equals_the_ops_on_each_family_and_layout(gguf_path, arch, layout):
    assert_same(*both_paths(gguf_path(arch, layout)), exact=exp_is_torchs(builds_here()[-1]))


@pytest.mark.parametrize("cache", [torch.float32, torch.float16, torch.uint8], ids=str)
def test_the_call_equals_the_ops_on_every_kv_cache_type(gguf_path, cache):
    # (the default, bf16 or float16 by the CPU, ran above; uint8: int8 rows)
    got, want = both_paths(gguf_path("qwen3", "q4_0-interleaved"), cache)
    assert_same(got, want, exact=exp_is_torchs(builds_here()[-1]))


@pytest.mark.parametrize("level", builds_here())
def test_the_call_equals_the_ops_on_every_build(gguf_path, level, monkeypatch):
    ours, attention = blocks.extension(level), paged.extension(level)
    require_our_kernels(ours is not None and attention is not None, f"the {level} builds")
    # Both paths on this build: the block products, step ops and decodes' attention alike;
    # the prompts' attention on this CPU's (a lower build may not take prompt chunks).
    prompts = paged.extension()

    def attend(q, *args):
        return (attention if args[4] == 1 else prompts).paged_attention(q, *args)

    build = SimpleNamespace(
        paged_attention=attend, paged_attention_entry=attention.paged_attention_entry
    )
    monkeypatch.setattr(blocks, "extension", lambda level=None: ours)
    monkeypatch.setattr(paged, "extension", lambda level=None: build)
    got, want = both_paths(gguf_path("qwen2", "q4_k_m-stacked"))
    assert_same(got, want, exact=exp_is_torchs(level))


def test_prompt_chunks_and_the_fallback_switch_run_on_the_ops(gguf_path, monkeypatch):
    decoder, _ = load_gguf(gguf_path("llama", "q4_0-interleaved"))
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    calls = []
    monkeypatch.setattr(decoder.decode_layers, "run", lambda x, *a: calls.append(x) or x)
    runner = ModelRunner(decoder, 32, 16)
    seqs = [Seq(prompt(20, seed=1), 0), Seq(prompt(30, seed=2), 8)]
    runner.execute([seqs[0].chunk(19)], {0})  # a prompt chunk
    seqs[0].req.num_computed += 19
    runner.execute([seqs[0].chunk(1), seqs[1].chunk(9)], {0, 1})  # a decode beside a chunk
    assert calls == []
    for switch in ("auto", "fallback"):  # a decode alone, then with the switch off
        monkeypatch.setenv("GAPLESS_KERNELS", switch)
        seqs[0].req.num_computed += 1
        seqs[0].req.output_ids.append(5)
        runner.execute([seqs[0].chunk(1)], {0})
    assert [x.shape[0] for x in calls] == [1]


def test_a_family_the_call_does_not_cover_says_why(gguf_path, checkpoint, tmp_path, caplog):
    path = write_gguf(checkpoint("gemma2", **GGUF_ARCHS["gemma2"]), tmp_path / "g.gguf", QType.Q8_0)
    with caplog.at_level(logging.INFO, logger="gapless.kernels"):
        decoder, _ = load_gguf(path)
        assert decoder.decode_layers is None
        load_gguf(gguf_path("llama", "q4_0-interleaved"))
    lines = [r.getMessage() for r in caplog.records if "decode steps' layers" in r.getMessage()]
    assert lines == [
        "kernels: decode steps' layers on torch ops (attention soft-capping (Gemma 2))",
        "kernels: decode steps' layers in one native call",
    ]


def test_a_float32_safetensors_run_keeps_the_ops(checkpoint):
    from gapless.model.loader import load_decoder

    decoder = load_decoder(checkpoint("llama"), "float32")
    assert decoder.decode_layers is None  # its linears are dense, not GGUF blocks
    specs = [layer.decode_spec() for layer in decoder.layers]
    assert DecodeLayers.build(specs, decoder.kernels) == "PackedLinear is not on GGUF blocks"


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_an_engine_decodes_the_same_tokens_and_logprobs_on_the_call(gguf_path, arch):
    # The engine's runner keeps the local layers' K/V in a KV group of their own (gemma3's
    # sliding layers; mistral's window is every layer's, one group).
    from gapless.engine.config import EngineConfig
    from gapless.engine.engine import Engine
    from gapless.engine.events import TokenEvent

    engine = Engine.from_pretrained(
        gguf_path(arch, "q4_k_m-stacked"), EngineConfig.of(speculate="none")
    )
    require_our_kernels(engine.decoder.kernels.gguf_blocks, "our GGUF block kernels")
    assert bool(engine.runner.window_blocks) == (arch == "gemma3")
    fused = engine.decoder.decode_layers
    assert fused is not None
    calls = []
    run_layers = fused.run
    fused.run = lambda x, *args: calls.append(x.shape[0]) or run_layers(x, *args)  # type: ignore[method-assign]

    def run() -> dict[str, list]:
        for i, n in enumerate((40, 23, 31)):
            engine.add_request(
                prompt(n, seed=n),
                SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
                str(i),
            )
        out: dict[str, list] = {str(i): [] for i in range(3)}
        while engine.has_work:
            for event in engine.step():
                if isinstance(event, TokenEvent):
                    out[event.request_id] += event.logprobs or []
        return out

    got = run()
    assert calls.count(3) >= 10, "the decode steps took the call"
    engine.decoder.decode_layers = None
    assert run() == got
    assert all(len(v) == 12 for v in got.values())
