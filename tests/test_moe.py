"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) compute what transformers computes: on
tiny random checkpoints built with transformers' own classes (tests/checkpoints.py), prompt
logprobs within 1e-4 in float32 and the same greedy tokens, however the batch is cut, and over
two tensor-parallel ranks; their GGUF files (the experts as llama.cpp stacks them) as the
checkpoints, quantized experts in their blocks; and the experts of a step run grouped, each
once over all of its tokens.
"""

from __future__ import annotations

import json
import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
from checkpoints import MOE_ARCHS
from gguf import GGMLQuantizationType as QType
from helpers import require_our_kernels
from safetensors.numpy import load_file, save_file
from test_model import (
    Seq,
    check_chunked_prefill_equals_one_call,
    check_ragged_batch_equals_each_sequence_alone,
    hf_model,
    prompt,
    run_chunks,
)
from test_quantize import mean_kl
from test_tensor_parallel import sharded_runner, tp2  # noqa: F401 - a fixture

from gapless import LLM, SamplingParams
from gapless.bench.gguf_files import write_gguf
from gapless.engine.runner import ModelRunner
from gapless.kernels.linear import BlockLinear, PackedLinear, PlainLinear
from gapless.kernels.moe import Experts
from gapless.kernels.probe import packed_linear_works, step_ops_work
from gapless.kernels.quant import BlockQuant
from gapless.model import families
from gapless.model.config import ConfigError
from gapless.model.families.qwen3_moe import MoeLayer
from gapless.model.gguf import load_gguf
from gapless.model.loader import load_decoder

# qwen3_moe's checkpoint renormalizes the chosen weights and has a dense middle layer; its
# "sparse2" variant does neither, with a sparse layer every 2nd (decoder_sparse_step).
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-sparse2": (
        "qwen3_moe",
        {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2},
    ),
    "mixtral": ("mixtral", {}),
    "gpt_oss": ("gpt_oss", {}),
}
ARCHS = MOE_ARCHS


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = checkpoint(arch, **overrides)
    ids = prompt(60, seed=5)  # longer than mixtral's window
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        # No end token (ignore_eos below): min_new_tokens would forbid them instead.
        greedy = hf.generate(
            torch.tensor([ids[:30]]), max_new_tokens=40, do_sample=False, eos_token_id=None
        )[0, 30:].tolist()
    # Float32 throughout, the KV cache too (auto stores it in float16 on most CPUs).
    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert [isinstance(layer, MoeLayer) for layer in llm.engine.decoder.layers] == sparse
    check_logprobs_and_greedy(llm, ids, ref, greedy)


def check_logprobs_and_greedy(llm: LLM, ids: list[int], ref: torch.Tensor, greedy: list[int]):
    """Prompt logprobs within 1e-4 of transformers' (ref), and its greedy tokens from ids[:30]."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    diff = max(
        abs(out.prompt_logprobs[pos][1] - ref[pos - 1, ids[pos]].item())
        for pos in range(1, len(ids))
    )
    assert diff < 1e-4
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert llm.generate([ids[:30]], params)[0].token_ids == greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_that_cut_windows_equal_one_call(checkpoint, arch, kernels_choice):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_chunked_prefill_equals_one_call(ModelRunner(decoder, 32, 16))


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_equals_each_sequence_alone(checkpoint, arch):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_ragged_batch_equals_each_sequence_alone(ModelRunner(decoder, 64, 16))


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_one_ranks_logits(checkpoint, tp2, arch):  # noqa: F811
    # Each rank holds half of every expert's intermediate rows (and of the dense layer's).
    path = checkpoint(arch)
    ids = prompt(80)
    one = run_chunks(ModelRunner(load_decoder(path, "float32"), 16, 16), Seq(ids, 0), [80])
    two = run_chunks(sharded_runner(tp2, path, 16), Seq(ids, 0), [16, 64])
    assert (one - two).abs().max().item() < 1e-4


class Counted:
    """A linear that counts the rows of each call."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.linear = PlainLinear(weight)
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.linear(x)


def test_experts_run_once_each_over_all_their_tokens():
    gen = torch.Generator().manual_seed(0)
    n, hidden, inter, tokens, k = 6, 16, 8, 40, 2
    gate, up = torch.randn(2, n, inter, hidden, generator=gen)
    down = torch.randn(n, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    # k different experts per token, never the last one
    chosen = torch.stack([torch.randperm(n - 1, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    gate_up = [Counted(torch.cat((gate[e], up[e]))) for e in range(n)]
    downs = [Counted(down[e]) for e in range(n)]
    got = Experts(gate_up, downs)(x, chosen, weights)  # type: ignore[arg-type]
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = chosen[t, j]
            h = torch.nn.functional.silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)
            want[t] += weights[t, j] * (h @ down[e].T)
    assert (got - want).abs().max().item() < 1e-4
    for e in range(n):
        count = int((chosen == e).sum())
        for kind in (gate_up, downs):  # one call per chosen expert, over all of its tokens
            assert kind[e].rows == ([count] if count else [])
    lone = Experts(gate_up, downs)(x[:1], chosen[:1], weights[:1])  # a lone decode's path
    assert (lone - want[:1]).abs().max().item() < 1e-4


@pytest.mark.skipif(not packed_linear_works(torch.float32), reason="torch has no oneDNN here")
@pytest.mark.parametrize("tokens", [1, 40])
def test_packed_experts_in_one_parallel_region_equal_them_one_by_one(monkeypatch, tokens):
    """kernels/csrc/expert_ops.cpp runs oneDNN-packed experts each on one thread of one
    parallel region: the same outputs as calling them one after another (float32, where the
    two differ only by summation order), on every CPU where float32 weights are packed."""
    require_our_kernels(step_ops_work(), "our expert ops")
    gen = torch.Generator().manual_seed(1)
    n, hidden, inter, k = 6, 64, 32, 2
    gate_up = [PackedLinear(torch.randn(2 * inter, hidden, generator=gen)) for _ in range(n)]
    downs = [PackedLinear(torch.randn(hidden, inter, generator=gen)) for _ in range(n)]
    x = torch.randn(tokens, hidden, generator=gen)
    chosen = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    with torch.inference_mode():
        grouped = Experts(gate_up, downs)(x, chosen, weights)
        monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
        one_by_one = Experts(gate_up, downs)(x, chosen, weights)
    scale = one_by_one.abs().max().item()
    assert (grouped - one_by_one).abs().max().item() < 1e-5 * scale


def moe_layers(decoder) -> list[MoeLayer]:
    return [layer for layer in decoder.layers if isinstance(layer, MoeLayer)]


# What the files can say: llama.cpp's qwen3moe makes every layer sparse, and a `llama` file
# (Mixtral's) carries no window (Mixtral 8x7B has none).
GGUF_READY = {"qwen3_moe": {"mlp_only_layers": []}, "mixtral": {"sliding_window": None}}


@pytest.mark.parametrize("arch", GGUF_READY)
def test_f32_gguf_runs_as_the_checkpoint(checkpoint, tmp_path, arch):
    ckpt = checkpoint(arch, **GGUF_READY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.gguf")
    decoder, _ = load_gguf(path, "float32")
    assert decoder.config.architecture == load_decoder(ckpt, "float32").config.architecture
    assert len(moe_layers(decoder)) == decoder.config.num_layers
    ids = prompt(40)
    want = run_chunks(ModelRunner(load_decoder(ckpt, "float32"), 8, 16), Seq(ids, 0), [40])
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [40])
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", GGUF_READY)
def test_quantized_experts_run_in_their_blocks_as_dequantized(
    checkpoint, tmp_path, monkeypatch, arch
):
    # A Q8_0 file, its router float32 as llama.cpp's quantizer leaves it: the experts' 3-D
    # tensors run in the file's own blocks.
    ckpt = checkpoint(arch, **GGUF_READY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.gguf", QType.Q8_0, mix={"ffn_gate_inp": QType.F32})
    decoder, _ = load_gguf(path, "float32")
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    size = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    for i, layer in enumerate(decoder.layers):
        experts = layer.moe.experts
        file_bytes = {
            "gate_up": size[f"blk.{i}.ffn_gate_exps.weight"] + size[f"blk.{i}.ffn_up_exps.weight"],
            "down": size[f"blk.{i}.ffn_down_exps.weight"],
        }
        for name, linears in (("gate_up", experts.gate_up), ("down", experts.down)):
            assert all(isinstance(lin, BlockLinear) for lin in linears)
            held = [lin.weight for lin in linears]
            assert all(isinstance(w, BlockQuant) and w.type_name == "Q8_0" for w in held)
            # The experts hold the file's blocks of their 3-D tensors and nothing more: no
            # float copy.
            storages = {w.blocks.untyped_storage().data_ptr(): w.blocks for w in held}
            held_bytes = sum(b.untyped_storage().nbytes() for b in storages.values())
            assert held_bytes == file_bytes[name]
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")  # dequantized float32 weights
    dequantized, _ = load_gguf(path, "float32")
    # A chunk, whose experts get more and fewer rows each than the block kernels' integer
    # path takes (gguf_gemv_max_rows: 16, or 32 with AMX), then decodes: activations
    # in 8 bits per block of 32 against the blocks (bf16 tiles for the experts with more
    # rows, where the CPU multiplies bf16 fast), as test_gguf's dense files run. That moved
    # a typical row's logits by 1-2% of its largest here; and where a router's choice is a
    # near-tie, the rounding can flip it: one token of 32 moved by 20% (a layout or routing
    # mistake moves every row by about as much as the logits are large).
    chunk = 2 * decoder.kernels.gguf_gemv_max_rows - 4  # mixtral: top-2 of 4, ~half each
    ids = prompt(chunk + 4)
    want = run_chunks(ModelRunner(dequantized, 8, 16), Seq(ids, 0), [chunk + 4])
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [chunk, 1, 1, 1, 1])
    row_err = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert row_err.median().item() < 0.05 and mean_kl(want, got) < 5e-3


def test_mxfp4_gpt_oss_is_refused_saying_how_to_dequantize(checkpoint):
    raw = json.loads((checkpoint("gpt_oss") / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}  # as OpenAI's checkpoints have it
    with pytest.raises(ConfigError, match=r"MXFP4 .*Mxfp4Config\(dequantize=True\)"):
        families.model_config(raw)


def on_mxfp4_grid(ckpt, out):
    """A copy of a gpt-oss checkpoint whose experts' weights MXFP4 holds exactly (rounded
    through its blocks along each linear's input), so that a file of MXFP4 experts and the
    checkpoint compute the same."""
    shutil.copytree(ckpt, out)
    tensors = load_file(out / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out]
            rows = np.ascontiguousarray(w.transpose(0, 2, 1))
            blocks = gguf.quants.quantize(rows, QType.MXFP4)
            grid = gguf.quants.dequantize(blocks, QType.MXFP4).reshape(rows.shape)
            tensors[name] = np.ascontiguousarray(grid.transpose(0, 2, 1)).astype(w.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("experts_type", [QType.F32, QType.MXFP4])
def test_gpt_oss_gguf_matches_transformers(checkpoint, tmp_path, caplog, monkeypatch, experts_type):
    # llama.cpp's gpt-oss file: experts split into gate and up, sinks, router and expert
    # biases, YaRN; its experts float or MXFP4 blocks (dequantized at load, with a warning).
    # A file with quantized tensors runs its float linears in bf16 tiles on our default
    # kernels; the fallback ones keep the float32 that 1e-4 asks for.
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    # llama.cpp's gpt-oss has no key for the SwiGLU clamp: OpenAI's 7, where the tiny
    # checkpoint's own is 2 (so that its random activations reach it).
    ckpt = checkpoint("gpt_oss", swiglu_limit=7.0)
    if experts_type == QType.MXFP4:
        ckpt = on_mxfp4_grid(ckpt, tmp_path / "grid")
    path = write_gguf(ckpt, tmp_path / "gpt-oss.gguf", mix={"_exps.weight": experts_type})
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == experts_type
    assert types["blk.0.attn_sinks.weight"] == QType.F32
    ids = prompt(60, seed=5)
    hf = hf_model(ckpt)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        greedy = hf.generate(
            torch.tensor([ids[:30]]), max_new_tokens=40, do_sample=False, eos_token_id=None
        )[0, 30:].tolist()
    with caplog.at_level(logging.WARNING, "gapless.model"):
        llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    assert llm.engine.decoder.config.architecture == "GptOssForCausalLM"
    warned = "GGUF MXFP4 weights have no kernel here: dequantized at load" in caplog.text
    assert warned == (experts_type == QType.MXFP4)
    check_logprobs_and_greedy(llm, ids, ref, greedy)
