"""The chat templates of the newer families render through gapless's sandbox as
transformers' apply_chat_template renders them: the same text and ids for the same messages,
tools, template variables and add_generation_prompt.

The templates are data, kept verbatim in tests/chat_templates/:
- openai-gpt-oss-120b.jinja: gpt-oss's harmony template, from the openai/gpt-oss-120b
  repository on Hugging Face, as llama.cpp keeps it in models/templates/ (fetched there by its
  scripts/get_chat_template.py);
- microsoft-Phi-3.5-mini-instruct.jinja: Phi-3's, from microsoft/Phi-3.5-mini-instruct, the
  same way;
- microsoft-Phi-4-mini-instruct.jinja: the `chat_template` of microsoft/Phi-4-mini-instruct's
  tokenizer_config.json on Hugging Face (offered tools go in the system message's `tools`
  field, as a JSON string).
- google-gemma-3-it.jinja: the `chat_template` of the Gemma 3 instruction-tuned
  checkpoints' tokenizer_config.json on Hugging Face (google/gemma-3-270m-it and its
  siblings), as the Berkeley Function Calling Leaderboard's Gemma handler quotes it.
The real Gemma 3 270M GGUF file is the base model and carries no template; Gemma 3's is
rendered with that file's vocabulary and special tokens in tests/test_gemma3_270m.py, which
reads the file once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_tokenizer import _both, _variant

from gapless.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "default": 1},
                "hours": {"type": "array", "items": {"type": "number"}},
            },
            "required": ["city"],
        },
    },
}
# A tool loop as the server hands it to a template (protocol.template_message): the call's
# arguments an object, the reasoning under vLLM's `reasoning_content`, which transformers
# also shows as gpt-oss's `thinking`.
TOOL_LOOP = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "18 degrees"},
    {"role": "assistant", "content": "It is 18 degrees."},
    {"role": "user", "content": "Thanks! And <b>Rome</b> — 中文?"},
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
PHI4_TOOLS = [
    {**CHAT[0], "tools": json.dumps([WEATHER["function"]])},
    {"role": "user", "content": "Weather in Paris?"},
]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def assert_same(ours: Tokenizer, hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> None:
    for gen in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
        hf_text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, **kwargs
        )
        assert text == hf_text
        hf_ids = hf.apply_chat_template(
            messages, return_dict=False, add_generation_prompt=gen, **kwargs
        )
        assert ours.encode_chat(messages, gen, **kwargs) == hf_ids


@pytest.mark.parametrize(
    ("name", "conversations"),
    [
        (
            "openai-gpt-oss-120b.jinja",
            [
                (TOOL_LOOP, {"tools": [WEATHER], "reasoning_effort": "high"}),
                (TOOL_LOOP[:3], {"tools": [WEATHER]}),
                (CHAT, {"model_identity": "You are a test.", "builtin_tools": ["python"]}),
                (CHAT, {}),
            ],
        ),
        ("microsoft-Phi-4-mini-instruct.jinja", [(PHI4_TOOLS, {}), (CHAT, {})]),
        ("microsoft-Phi-3.5-mini-instruct.jinja", [(CHAT, {}), (CHAT[1:], {})]),
    ],
)
def test_template_renders_as_transformers(
    test_tokenizer_dir: Path, tmp_path: Path, name: str, conversations
) -> None:
    ours, hf = _both(_variant(test_tokenizer_dir, tmp_path, chat_template=template(name)))
    for messages, kwargs in conversations:
        assert_same(ours, hf, messages, **kwargs)


def test_gpt_oss_renders_harmony(test_tokenizer_dir: Path, tmp_path: Path) -> None:
    """What the comparison above is comparing: the call, its result and the effort."""
    path = _variant(
        test_tokenizer_dir, tmp_path, chat_template=template("openai-gpt-oss-120b.jinja")
    )
    text = Tokenizer.from_pretrained(path).apply_chat_template(
        TOOL_LOOP[:4], tools=[WEATHER], reasoning_effort="low"
    )
    assert "Reasoning: low\n" in text
    assert "type get_weather = (_: {\n// The city's name\ncity: string,\n" in text
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I should look it up.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"18 degrees"<|end|><|start|>assistant'
    ) in text
