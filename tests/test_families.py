"""Every model family beyond Llama's computes what transformers computes: on a tiny random
checkpoint built with transformers' own classes (tests/checkpoints.py), prompt logprobs within
1e-4 in float32 and the same greedy tokens; however the batch is cut (chunks that cut
sliding windows, ragged batches); over two tensor-parallel ranks; and from GGUF where llama.cpp
names the family's tensors.

A new family adds its checkpoint to checkpoints.py (ARCH_SPECS), which these tests read.
"""

from __future__ import annotations

import checkpoints
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from test_model import (
    Seq,
    check_chunked_prefill_equals_one_call,
    check_ragged_batch_equals_each_sequence_alone,
    hf_model,
    prompt,
    run_chunks,
)
from test_tensor_parallel import sharded_runner, tp2  # noqa: F401 - a fixture

from gapless import LLM, SamplingParams
from gapless.bench.gguf_files import write_gguf
from gapless.engine.runner import ModelRunner
from gapless.model import families
from gapless.model.gguf import load_gguf
from gapless.model.loader import load_decoder

# The dense checkpoints of families other than Llama's module (test_model's tests run those).
FAMILIES = [
    arch
    for arch in checkpoints.ARCHS
    if families.family_of(checkpoints.ARCH_SPECS[arch][0]) is not families.llama
]
# Checkpoints whose every setting a GGUF file says as llama.cpp and transformers' GGUF loader
# both read it. gemma3 files have no key for query_pre_attn_scalar: llama.cpp takes head_dim,
# transformers 256 (Gemma 3's head_dim but for the 27B, which llama.cpp knows by its layers),
# and transformers reads no rope scaling. For phi3 it reads no window, LongRoPE or partial
# rotary either. gemma2 files do say their soft-caps, but transformers reads its defaults.
# (transformers reads no smollm3 files: test_gguf.py checks those against the checkpoint.)
GGUF_READY = {
    "gemma3": {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
    "gemma2": {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "phi3": {
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}


@pytest.mark.parametrize("style", ["hf4", "hf5"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(checkpoint, arch, style):
    path = checkpoint(arch, config_style=style)
    ids = prompt(60, seed=5)  # longer than the sliding windows
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        greedy = hf.generate(
            torch.tensor([ids[:30]]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, 30:].tolist()
    # Float32 throughout, the KV cache too (auto stores it in float16 on most CPUs).
    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    diff = max(
        abs(out.prompt_logprobs[pos][1] - ref[pos - 1, ids[pos]].item())
        for pos in range(1, len(ids))
    )
    assert diff < 1e-4
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert llm.generate([ids[:30]], params)[0].token_ids == greedy


@pytest.mark.parametrize("arch", FAMILIES)
def test_chunks_that_cut_windows_equal_one_call(checkpoint, arch, kernels_choice):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_chunked_prefill_equals_one_call(ModelRunner(decoder, 32, 16))


@pytest.mark.parametrize("arch", FAMILIES)
def test_ragged_batch_equals_each_sequence_alone(checkpoint, arch):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_ragged_batch_equals_each_sequence_alone(ModelRunner(decoder, 64, 16))


# kv1: one KV head (as Gemma 3 270M has), which each rank keeps a replica of.
@pytest.mark.parametrize("arch", [*FAMILIES, *(f"{name}-kv1" for name in FAMILIES)])
def test_two_ranks_give_one_ranks_logits(checkpoint, tp2, arch):  # noqa: F811
    name, _, kv1 = arch.partition("-")
    path = checkpoint(name, num_key_value_heads=1) if kv1 else checkpoint(name)
    ids = prompt(80)
    one = run_chunks(ModelRunner(load_decoder(path, "float32"), 16, 16), Seq(ids, 0), [80])
    two = run_chunks(sharded_runner(tp2, path, 16), Seq(ids, 0), [16, 64])
    assert (one - two).abs().max().item() < 1e-4


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q4_0])
@pytest.mark.parametrize("arch", GGUF_READY)
def test_gguf_file_runs_as_transformers_gguf_loader(checkpoint, tmp_path, monkeypatch, arch, qtype):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")  # Q4_0 dequantized, in float32
    ckpt = checkpoint(arch, **GGUF_READY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.gguf", qtype)
    ids = prompt(40)
    decoder, _ = load_gguf(path, "float32")
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [40])
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() < 1e-4
    if qtype == QType.F32:  # and as the checkpoint it was written from
        want = run_chunks(ModelRunner(load_decoder(ckpt, "float32"), 8, 16), Seq(ids, 0), [40])
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("architecture", "gguf"),
    [
        ("LlamaForCausalLM", "llama"),
        ("MistralForCausalLM", "llama"),  # llama.cpp writes Mistral and Mixtral as llama files
        ("MixtralForCausalLM", "llama"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3MoeForCausalLM", "qwen3moe"),
        ("GptOssForCausalLM", "gpt-oss"),
        ("Gemma3ForCausalLM", "gemma3"),
        ("Phi3ForCausalLM", "phi3"),
    ],
)
def test_a_models_family_is_llama_cpps_architecture_name(architecture, gguf):
    """What Ollama's /api/show and /api/tags call the family (model/describe.py)."""
    assert families.gguf_architecture(architecture) == gguf


def test_every_gguf_architecture_a_family_reads_names_it_back():
    for family in families.FAMILIES:
        for gguf, architecture in family.GGUF_ARCHITECTURES.items():
            assert families.gguf_architecture(architecture) == gguf


def test_every_architecture_the_registry_reads_has_a_checkpoint_under_parity_test():
    """A family listed in families.FAMILIES without a tiny checkpoint (tests/checkpoints.py)
    fails here: every checkpoint runs the parity tests against transformers (test_model's
    for ARCHS, test_moe's for MOE_ARCHS)."""
    registered = {name for family in families.FAMILIES for name in family.ARCHITECTURES}
    assert {spec[0] for spec in checkpoints.ARCH_SPECS.values()} == registered
