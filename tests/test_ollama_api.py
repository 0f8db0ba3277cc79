"""The rest of Ollama's API through the `ollama` client: /api/ps, /api/show, `format` on the
grammar path, structured `tool_calls`, `suffix` and `keep_alive`.

The server's template is a Llama 3 style one, whose calls (`{"name", "parameters"}`, first
thing in the output) the llama3_json parser reads. Random weights never call a tool by
themselves, so a `format` schema of exactly that shape makes the model write one: the parser
must then turn it into `message.tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from server_fixture import MODEL, RunningServer, running_server
from test_responses_api import PERSON, WEATHER
from test_tools_api import LLAMA3_TEMPLATE, with_template

from gapless.server.ollama import takes_tools

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 80}
CITY = WEATHER["parameters"]
# In the order (and without the keys) the ollama client's Tool model sends.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
            },
        },
    }
]
# What a Llama 3 model writes to call get_weather.
CALL_SHAPE = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": CITY},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory) -> Iterator[RunningServer]:
    model_dir = with_template(
        checkpoint("llama"), tmp_path_factory.mktemp("o") / "m", LLAMA3_TEMPLATE
    )
    with running_server(model_dir) as running:
        yield running


def test_ps_lists_the_loaded_model(llama: ollama.Client, server: RunningServer) -> None:
    [model] = llama.ps().models
    assert model.name == model.model == f"{MODEL}:latest"
    assert model.size_vram == 0
    assert model.expires_at.year == 9999  # never unloaded
    assert model.context_length == server.engine.max_model_len
    # The tiny llama's float32 weights, its parameters at 4 bytes each, and small buffers.
    weights = 4 * llama.show(MODEL).modelinfo["general.parameter_count"]
    assert weights <= model.size < 1.01 * weights
    assert model.details.family == "llama"
    assert model.details.quantization_level == "F32"
    [listed] = llama.list().models
    assert listed.size == model.size


def test_show_gives_template_parameters_model_info_capabilities(
    llama: ollama.Client, server: RunningServer
) -> None:
    shown = llama.show(f"{MODEL}:latest")
    config = server.engine.decoder.config
    assert shown.template == LLAMA3_TEMPLATE
    assert shown.capabilities == ["completion", "tools", "embedding"]
    info = shown.modelinfo
    assert info["general.architecture"] == "llama"
    assert info["llama.context_length"] == server.engine.max_model_len
    assert info["llama.embedding_length"] == config.hidden_size == 64
    assert info["llama.block_count"] == 2
    assert info["llama.attention.head_count"] == 4
    assert info["llama.attention.head_count_kv"] == 2
    assert info["llama.vocab_size"] == config.vocab_size
    # 2 layers of (2 norms, q, k, v, o, gate, up, down), the embedding, the head, the norm.
    h, kv, inter, vocab = 64, 2 * 16, 128, config.vocab_size
    layer = 2 * h + h * h + 2 * kv * h + h * h + 3 * inter * h
    assert info["general.parameter_count"] == 2 * layer + 2 * vocab * h + h
    assert shown.details.parameter_size == "140K"
    lines = shown.parameters.splitlines()
    assert lines[0].split() == ["num_ctx", str(server.engine.max_model_len)]
    assert sorted(line.split()[1] for line in lines[1:]) == ['"<|end|>"', '"<|eos|>"']


def test_takes_tools() -> None:
    assert takes_tools(LLAMA3_TEMPLATE)
    assert not takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not takes_tools(None) and not takes_tools("{% broken")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_format_schema_gives_json_matching_it(llama: ollama.Client, chat: bool) -> None:
    if chat:
        reply = llama.chat(model=MODEL, messages=ASK, format=PERSON, options=GREEDY)
        text = reply.message.content
    else:
        reply = llama.generate(model=MODEL, prompt="A person:", format=PERSON, options=GREEDY)
        text = reply.response
    assert reply.done_reason == "stop"  # the grammar ended it: the JSON is complete
    jsonschema.validate(json.loads(text), PERSON)
    # Streamed, the same greedy tokens.
    if chat:
        parts = list(
            llama.chat(model=MODEL, messages=ASK, format=PERSON, options=GREEDY, stream=True)
        )
        assert "".join(p.message.content for p in parts) == text


def test_format_json_gives_an_object(llama: ollama.Client) -> None:
    messages = [{"role": "user", "content": "An object please"}]
    reply = llama.chat(model=MODEL, messages=messages, format="json", options=GREEDY)
    assert reply.done_reason == "stop"
    assert isinstance(json.loads(reply.message.content), dict)


def test_tools_come_back_as_structured_calls(llama: ollama.Client, server: RunningServer) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "options": GREEDY}
    reply = llama.chat(format=CALL_SHAPE, **kwargs)
    assert reply.message.content == ""  # the call's text is not content
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments in ({"city": "Paris"}, {"city": "Rome"})
    # Streamed: the calls in a line of their own, before the last.
    parts = list(llama.chat(format=CALL_SHAPE, stream=True, **kwargs))
    assert [p.done for p in parts] == [False, True]
    assert parts[0].message.tool_calls == reply.message.tool_calls
    assert parts[0].message.content == "" and parts[1].message.content == ""

    # The call and its result go back into the template as transformers documents them.
    followup = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"},
    ]
    after = llama.chat(model=MODEL, messages=followup, tools=TOOLS, options={"num_predict": 1})
    template_messages = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": call.function.arguments}}
            ],
        },
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"},
    ]
    expected = server.engine.tokenizer.encode_chat(template_messages, tools=TOOLS)
    assert after.prompt_eval_count == len(expected)


def test_text_that_is_no_call_stays_content(
    llama: ollama.Client, client: httpx.Client, server: RunningServer
) -> None:
    reply = llama.chat(
        model=MODEL, messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 8}
    )
    assert not reply.message.tool_calls
    assert reply.eval_count == 8
    # All of the model's greedy text for that prompt (special tokens kept, as with tools).
    ids = server.engine.tokenizer.encode_chat(ASK, tools=TOOLS)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "skip_special_tokens": False}
    model_text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert model_text and reply.message.content == model_text


def test_suffix_is_a_clear_error(llama: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        llama.generate(model=MODEL, prompt="def add(a, b):", suffix="    return c")
    assert caught.value.status_code == 400
    assert "suffix" in caught.value.error and "fill-in-the-middle" in caught.value.error
    with pytest.raises(ollama.ResponseError):
        llama.generate(model=MODEL, prompt="", suffix="x")  # not mistaken for a load request
    # An empty suffix is no suffix.
    assert llama.generate(model=MODEL, prompt="x", suffix="", options={"num_predict": 1}).done


def test_keep_alive_is_accepted(llama: ollama.Client, client: httpx.Client) -> None:
    for keep_alive in ("5m", 0, -1, 3600):
        reply = llama.generate(
            model=MODEL,
            prompt="hi",
            keep_alive=keep_alive,
            options={"num_predict": 2, "temperature": 0},
        )
        assert reply.eval_count == 2
    assert llama.generate(model=MODEL, prompt="", keep_alive=0).done_reason == "load"
    assert len(llama.ps().models) == 1  # still loaded


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/api/chat", {"messages": ASK, "format": "yaml"}, "format"),
        ("/api/chat", {"messages": ASK, "format": 5}, "format"),
        ("/api/generate", {"prompt": "x", "format": {"type": "objectz"}}, "format"),
        ("/api/chat", {"messages": ASK, "tools": [{"type": "function"}]}, "tools[0]"),
        ("/api/chat", {"messages": ASK, "tools": "x"}, "tools"),
    ],
)
def test_bad_requests(client: httpx.Client, path: str, body: dict[str, Any], needle: str) -> None:
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    assert r.json()["error"].startswith(needle)
