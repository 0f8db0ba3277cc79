"""The Anthropic and Ollama dialects, vLLM's /tokenize, and tool-call round trips, each through
its real client against a real server on a loopback port."""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers import gate_forwards
from server_fixture import MODEL, RunningServer, running_server

from gapless.server.settings import ServerSettings

MAX_MODEL_LEN = 2048
KEY = "sk-dialects"

# SmolLM2's way of writing a turn (plain concatenation, which fails on a missing `content`),
# plus tools and tool calls rendered as Hermes-style templates do.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>"
    "{% endfor %}"
    "{% if message.tool_call_id %} (for {{ message.tool_call_id }}){% endif %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(
    checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    model_dir = tmp_path_factory.mktemp("tool-template") / "llama"
    shutil.copytree(checkpoint("llama"), model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    with running_server(
        model_dir,
        ServerSettings(MODEL),
        prefill_chunk=16,
        idle_prefill_chunk=16,
        kv_cache_tokens=16_000,
        max_num_seqs=8,
    ) as running:
        yield running


def _prompt_text(client: httpx.Client, body: dict[str, Any]) -> str:
    tokens = client.post("/tokenize", json=body).json()["tokens"]
    return client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


# -- tool-call round trip and /tokenize -----------------------------------------------------

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    # As the openai client sends a turn that only called a tool: content null, arguments a
    # JSON string.
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_openai_tool_round_trip_with_null_content(
    server: RunningServer, client: httpx.Client
) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(model=MODEL, messages=TOOL_CONVERSATION, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    # The template saw content "" and the arguments as an object, as transformers gives them.
    assert _prompt_text(client, {"messages": TOOL_CONVERSATION}) == (
        "<|bos|><|user|>Weather in Paris?<|end|>"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|end|><|tool|>sunny (for call_1)<|end|><|assistant|>"
    )
    bad = [*TOOL_CONVERSATION[:1], {**TOOL_CONVERSATION[1], "tool_calls": [{"function": {}}]}]
    r = client.post("/v1/chat/completions", json={"messages": bad})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0]"


def test_tokenize_and_detokenize(client: httpx.Client, server: RunningServer) -> None:
    tokenizer = server.engine.tokenizer
    r = client.post("/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("def f(x):")
    assert r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == [tokenizer.token_text(t) for t in r["tokens"]]
    bare = client.post("/tokenize", json={"prompt": "def f(x):", "add_special_tokens": False})
    tokens = bare.json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "def f(x):"}

    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    assert chat["token_strs"] is None
    plain = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert plain.json()["tokens"] == tokenizer.encode_chat(messages, add_generation_prompt=False)

    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body)
        assert r.json()["error"]["param"] == param


# -- Anthropic ------------------------------------------------------------------------------


def test_anthropic_message_matches_openai_chat(
    claude: anthropic.Anthropic, client: httpx.Client, server: RunningServer
) -> None:
    # This client version has no sampling arguments; older ones and other tools send them.
    greedy = {"temperature": 0, "top_k": 0, "top_p": 1.0}
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "extra_body": greedy}
    message = claude.messages.create(
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
        metadata={"user_id": "ignored"},
        **kwargs,
    )
    openai_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    same = client.post(
        "/v1/chat/completions", json={"messages": openai_messages, "max_tokens": 12, **greedy}
    )
    prompt = server.engine.tokenizer.encode_chat(openai_messages)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text"
    assert block.text == same.json()["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens"
    assert message.stop_sequence is None
    assert message.usage.output_tokens == 12
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)

    # A stop sequence inside that text ends the message there and is named.
    stop = block.text[5:7]
    assert stop.strip()
    cut = claude.messages.create(
        messages=[{"role": "user", "content": "Hi!"}],
        system=[{"type": "text", "text": "Be brief."}],
        stop_sequences=[stop],
        **kwargs,
    )
    assert cut.content[0].text == block.text[: block.text.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_anthropic_stream_events_in_order(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    events = list(claude.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 10
    assert text == claude.messages.create(**kwargs).content[0].text

    # The SDK's own stream helper assembles the same message.
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason == "max_tokens"


def test_anthropic_tools_reach_the_template(
    claude: anthropic.Anthropic, server: RunningServer
) -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER_TOOL["parameters"],
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    message = claude.messages.create(model=MODEL, max_tokens=2, tools=[tool], messages=messages)
    expected = server.engine.tokenizer.encode_chat(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "Thanks!"},
        ],
        tools=[{"type": "function", "function": WEATHER_TOOL}],
    )
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(expected)
    counted = claude.messages.count_tokens(model=MODEL, tools=[tool], messages=messages)
    assert counted.input_tokens == len(expected)


def test_anthropic_forced_tool_use(claude: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 60,
        "tools": [{"name": "get_weather", "input_schema": schema}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    # Generated under the schema's grammar: always a valid call, whatever the weights.
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    valid = ({"city": "Paris"}, {"city": "Rome"})
    assert call.input in valid

    events = list(claude.messages.create(stream=True, **kwargs))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"]
    assert starts[1].name == "get_weather"
    [json_delta] = [e.delta for e in events if e.type == "content_block_delta" and e.index == 1]
    assert json.loads(json_delta.partial_json) in valid
    assert events[-2].delta.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"][0] in valid


@pytest.mark.parametrize(
    "body,param_text",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5}, "messages"),
        ({"max_tokens": 5, "messages": "hi"}, "messages"),
        ({"max_tokens": "5", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "content"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "image",
        ),
        (
            {
                "max_tokens": 5,
                "system": [{"type": "image"}],
                "messages": [{"role": "user", "content": "x"}],
            },
            "system: ",
        ),
        (
            {"max_tokens": 5, "temperature": "hot", "messages": [{"role": "user", "content": "x"}]},
            "temperature",
        ),
        (
            {
                "max_tokens": 5,
                "tools": [{"name": 1}],
                "messages": [{"role": "user", "content": "x"}],
            },
            "tool",
        ),
        (
            {"max_tokens": 10**6, "messages": [{"role": "user", "content": "hi"}]},
            "context length",
        ),
        (
            {
                "max_tokens": 5,
                "service_class": "vip",
                "messages": [{"role": "user", "content": "x"}],
            },
            "service_class must be one of",
        ),
    ],
)
def test_anthropic_bad_requests(
    claude: anthropic.Anthropic, body: dict[str, Any], param_text: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        # The client's plain POST sends the body as it is and maps the error as always.
        claude.post("/v1/messages", body={"model": MODEL, **body}, cast_to=object)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error"
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert param_text in error["message"]


def test_anthropic_auth_and_error_shapes(
    claude: anthropic.Anthropic, client: httpx.Client, server: RunningServer
) -> None:
    hello = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    settings = server.server.state.settings
    settings.api_key = KEY
    try:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            claude.messages.create(model=MODEL, **hello)
        assert caught.value.body["error"]["type"] == "authentication_error"
        ok = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
        assert ok.messages.create(model=MODEL, **hello).usage.output_tokens == 1
        bearer = client.post("/v1/messages", json=hello, headers={"authorization": f"Bearer {KEY}"})
        assert bearer.status_code == 200
    finally:
        settings.api_key = None
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-9", **hello)
    assert missing.value.body["error"]["type"] == "not_found_error"
    for raw, headers, status in [
        (b"{", {"content-type": "application/json"}, 400),
        (b"[1]", {"content-type": "application/json"}, 400),
        (b"{}", {"content-type": "text/plain"}, 415),
    ]:
        r = client.post("/v1/messages", content=raw, headers=headers)
        assert r.status_code == status
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.get("/v1/messages")
    assert r.status_code == 405
    assert r.json()["type"] == "error"


# -- Ollama ---------------------------------------------------------------------------------


def test_ollama_chat_both_ways(llama: ollama.Client, server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    options = {"temperature": 0, "num_predict": 8, "top_k": 40, "repeat_penalty": 1.0}
    whole = llama.chat(model=MODEL, messages=messages, options=options, stream=False)
    assert whole.done and whole.done_reason == "length"
    assert whole.message.role == "assistant"
    assert whole.model == MODEL
    assert whole.prompt_eval_count == len(server.engine.tokenizer.encode_chat(messages))
    assert whole.eval_count == 8
    assert whole.total_duration >= whole.eval_duration > 0

    parts = list(
        llama.chat(model=f"{MODEL}:latest", messages=messages, options=options, stream=True)
    )
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 8
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_ollama_generate_options_and_stop(llama: ollama.Client, server: RunningServer) -> None:
    options = {"temperature": 0, "num_predict": 12, "seed": 3, "unknown_option": 1}
    whole = llama.generate(model=MODEL, prompt="def add(a, b):", options=options, stream=False)
    assert whole.eval_count == 12 and whole.done_reason == "length"
    prompt = server.engine.tokenizer.encode_chat([{"role": "user", "content": "def add(a, b):"}])
    assert whole.prompt_eval_count == len(prompt)
    raw = llama.generate(model=MODEL, prompt="def add(a, b):", raw=True, options=options)
    assert raw.prompt_eval_count == len(server.engine.tokenizer.encode("def add(a, b):"))

    stop = whole.response[4:6]
    assert stop.strip()
    parts = list(
        llama.generate(
            model=MODEL, prompt="def add(a, b):", options={**options, "stop": [stop]}, stream=True
        )
    )
    assert "".join(p.response for p in parts) == whole.response[: whole.response.index(stop)]
    assert parts[-1].done_reason == "stop"
    assert llama.generate(model=MODEL, prompt="").done_reason == "load"


def test_ollama_tags_show_version(
    llama: ollama.Client, client: httpx.Client, server: RunningServer
) -> None:
    [model] = llama.list().models
    assert model.model == f"{MODEL}:latest"
    shown = llama.show(MODEL)
    assert shown.template == server.engine.tokenizer.chat_template
    assert shown.modelinfo["llama.context_length"] == MAX_MODEL_LEN
    assert shown.details.family == "llama"
    version = client.get("/api/version").json()["version"]
    assert version and isinstance(version, str)
    with pytest.raises(ollama.ResponseError) as caught:
        llama.show("llama3")
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/api/chat", b"{", 400, "JSON"),
        ("/api/chat", {"model": MODEL}, 400, "messages"),
        ("/api/chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
        # Ollama's errors have no `param`: the message leads with the field.
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": ["x"]}]},
            400,
            "messages[0].content: ",
        ),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "images",
        ),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x"}], "options": 5},
            400,
            "options",
        ),
        ("/api/generate", {"prompt": "x", "options": {"temperature": "hot"}}, 400, "temperature"),
        ("/api/generate", {"prompt": "x", "options": {"top_p": 7}}, 400, "top_p"),
        ("/api/generate", {"prompt": "x", "options": {"num_predict": "all"}}, 400, "num_predict"),
        (
            "/api/generate",
            {"prompt": "x", "options": {"repeat_penalty": -1}},
            400,
            "repeat_penalty",
        ),
        ("/api/generate", {"prompt": 5}, 400, "prompt"),
        ("/api/generate", {"prompt": "x", "service_class": "vip"}, 400, "service_class must"),
        ("/api/generate", {"model": "llama3", "prompt": "x"}, 404, "llama3"),
        ("/api/show", {"model": "llama3"}, 404, "llama3"),
    ],
)
def test_ollama_bad_requests(
    client: httpx.Client, path: str, body: Any, status: int, needle: str
) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}
    assert needle in r.json()["error"]


# -- cancellation ---------------------------------------------------------------------------


def _cancelled(server: RunningServer) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(
        r'^gapless_requests_finished_total\{finish_reason="cancelled"\} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/messages", {"max_tokens": 100, "stream": True}),
        ("/api/chat", {"options": {"num_predict": 100}}),
    ],
    ids=["anthropic", "ollama"],
)
def test_disconnect_cancels_and_frees_kv(
    server: RunningServer, path: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    before, cancelled = server.metrics(), _cancelled(server)
    # One forward pass, then the engine waits: the client surely hangs up mid-prefill.
    gate = gate_forwards(server.engine, monkeypatch)
    content = "the quick brown fox jumps over the lazy dog " * 30  # many prefill chunks
    payload = json.dumps({**body, "messages": [{"role": "user", "content": content}]})
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    try:
        # A raw socket: an Ollama stream sends no headers before its first token.
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + payload.encode())
            server.wait_for_metric("gapless_requests_prefilling", 1)
    finally:
        monkeypatch.undo()
        gate.release()  # the engine may be waiting in gated_forward
    server.wait_for_metric("gapless_requests_running", 0)
    server.wait_for_metric("gapless_kv_blocks_used", before["gapless_kv_blocks_used"])
    assert _cancelled(server) == cancelled + 1
    # The next request still runs.
    # Greedy: a sampled token may be EOS and end it after one.
    after = {"prompt": "x", "stream": False, "options": {"num_predict": 2, "temperature": 0}}
    assert json.loads(server.client().post("/api/generate", json=after).text)["eval_count"] == 2


def test_failure_inside_a_request_in_each_dialect(
    claude: anthropic.Anthropic,
    llama: ollama.Client,
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(server.engine.runner, "execute", broken_forward)
    hello = [{"role": "user", "content": "fail me"}]
    with pytest.raises(anthropic.InternalServerError) as caught:
        claude.messages.create(model=MODEL, max_tokens=3, messages=hello)
    assert caught.value.body["error"]["type"] == "api_error"
    # Once the stream has begun, an `error` event ends it; the client raises it.
    with pytest.raises(anthropic.APIStatusError, match="injected"):
        list(claude.messages.create(model=MODEL, max_tokens=3, messages=hello, stream=True))
    with pytest.raises(ollama.ResponseError) as failed:
        llama.chat(model=MODEL, messages=hello, stream=False)
    assert failed.value.status_code == 500
    with pytest.raises(ollama.ResponseError, match="injected"):
        list(llama.chat(model=MODEL, messages=hello, stream=True))
    monkeypatch.undo()
    assert llama.chat(model=MODEL, messages=hello, options={"num_predict": 2}).eval_count == 2
