"""Open WebUI's requests, replayed over HTTP as it sends them, and what it reads back.

The shapes are Open WebUI's (github.com/open-webui/open-webui), read from its source:
- its Ollama connection, backend/open_webui/routers/ollama.py at 598282cf: the connection
  check GET /api/version (the lowest version wins, parsed as dotted integers), GET /api/tags
  (a model's id is its `model`) and GET /api/ps (`expires_at` through
  datetime.fromisoformat), POST /api/show, /api/embed, /api/embeddings, /api/generate
  (unloading is `{"keep_alive": 0, "prompt": ""}`) and /api/chat, whose model names gain
  `:latest`; it forwards to Ollama's /v1/chat/completions too, with that name;
- the payload it builds, backend/open_webui/utils/payload.py at 227ce3f6: chat `options`
  holding every Ollama option a user can set in its Advanced Params (num_ctx, mirostat, ...,
  use_mlock), `format`, `keep_alive` and `think` at the top level, assistant `tool_calls` as
  `{"index", "id", "function": {"name", "arguments": {...}}}` with content "", images as
  base64 strings in `images`;
- its OpenAI connection, backend/open_webui/routers/openai.py at 671f5772 and its chat
  middleware: GET {url}/models and POST {url}/chat/completions and {url}/embeddings under
  `Authorization: Bearer <key>` and the `X-OpenWebUI-User-*` headers, `max_tokens` (it turns
  `max_completion_tokens` back into that for servers other than OpenAI's), `stream_options:
  {include_usage: true}` (the model's "usage" capability), `reasoning_effort`, `logit_bias`,
  any custom parameter a user adds, and `user` (an object, for its pipelines).
Title, tag and follow-up generation are the same chat requests, not streamed.

The server runs a tiny checkpoint behind an API key, as Open WebUI is configured with one,
under a Llama 3 style template that also reads `enable_thinking` and `reasoning_effort`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from server_fixture import MODEL, RunningServer, SSEReader, running_server
from test_tools_api import LLAMA3_TEMPLATE, with_template

from gapless.server.settings import ServerSettings

KEY = "sk-open-webui"
OLLAMA_NAME = f"{MODEL}:latest"
# What Open WebUI's requests carry, with ENABLE_FORWARD_USER_INFO_HEADERS on.
HEADERS = {
    "Authorization": f"Bearer {KEY}",
    "X-OpenWebUI-User-Name": "Ada Lovelace",
    "X-OpenWebUI-User-Id": "3f1c2a9e-0000-4000-8000-000000000001",
    "X-OpenWebUI-User-Email": "ada@example.com",
    "X-OpenWebUI-User-Role": "admin",
    "X-OpenWebUI-Chat-Id": "8c7e5b1a-0000-4000-8000-000000000002",
}
TEMPLATE = (
    "{%- if enable_thinking is defined and not enable_thinking %}<|system|>/no_think<|end|>"
    "{%- endif %}{%- if reasoning_effort is defined %}<|system|>Reasoning: "
    "{{ reasoning_effort }}<|end|>{%- endif %}" + LLAMA3_TEMPLATE
)
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
# Every option of Open WebUI's Ollama mapping, at values a user might set; mirostat and
# typical_p at their off values (switched on, they are refused: see test_refusals).
OPTIONS = {
    "temperature": 0.8,
    "top_p": 0.9,
    "seed": 42,
    "mirostat": 0,
    "mirostat_eta": 0.1,
    "mirostat_tau": 5.0,
    "num_ctx": 4096,
    "num_batch": 512,
    "num_keep": 24,
    "num_predict": 12,
    "repeat_last_n": 64,
    "top_k": 40,
    "min_p": 0.05,
    "typical_p": 1.0,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "penalize_newline": True,
    "stop": ["<|end|>"],
    "numa": False,
    "num_gpu": 0,
    "main_gpu": 0,
    "low_vram": False,
    "vocab_only": False,
    "use_mmap": True,
    "use_mlock": False,
    "num_thread": 2,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory) -> Iterator[RunningServer]:
    model_dir = with_template(checkpoint("llama"), tmp_path_factory.mktemp("w") / "m", TEMPLATE)
    with running_server(model_dir, ServerSettings(MODEL, api_key=KEY)) as running:
        yield running


@pytest.fixture
def webui(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client(headers=HEADERS) as c:
        yield c


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_connection_checks(webui: httpx.Client, server: RunningServer) -> None:
    version = webui.get("/api/version").json()["version"]
    # Open WebUI keeps the lowest version of its Ollama servers, compared as integers.
    assert all(part.isdigit() for part in re.sub(r"^v|-.*", "", version).split("."))
    [tag] = webui.get("/api/tags").json()["models"]
    assert tag["model"] == tag["name"] == OLLAMA_NAME
    assert tag["details"]["parameter_size"] and tag["details"]["quantization_level"]
    [loaded] = webui.get("/api/ps").json()["models"]
    assert loaded["model"] == OLLAMA_NAME
    assert int(datetime.fromisoformat(loaded["expires_at"]).timestamp()) > 0
    # The OpenAI connection's check; without the key, an error it can show.
    assert [m["id"] for m in webui.get("/v1/models").json()["data"]] == [MODEL]
    refused = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["message"]


def test_show(webui: httpx.Client, server: RunningServer) -> None:
    shown = webui.post("/api/show", json={"model": OLLAMA_NAME}).json()
    assert shown["capabilities"] == ["completion", "tools", "embedding"]
    assert shown["template"] == TEMPLATE
    assert shown["model_info"]["general.architecture"] == "llama"
    assert shown["details"]["family"] == "llama"


def test_ollama_chat_with_every_option(webui: httpx.Client) -> None:
    body = {
        "model": OLLAMA_NAME,
        "messages": ASK,
        "stream": True,
        "options": OPTIONS,
        "keep_alive": "5m",
        "think": True,
    }
    lines = ndjson(webui.post("/api/chat", json=body))
    *parts, last = lines
    assert all(p["model"] == OLLAMA_NAME and p["done"] is False for p in parts)
    assert all(p["message"]["role"] == "assistant" for p in lines)
    assert last["done"] is True and last["done_reason"] in ("stop", "length")
    assert 1 <= last["eval_count"] <= OPTIONS["num_predict"]
    assert last["prompt_eval_count"] > 0
    # Open WebUI's token rates divide the counts by these.
    assert last["eval_duration"] > 0 and last["prompt_eval_duration"] >= 0
    assert last["total_duration"] >= last["eval_duration"]
    # The seed is honoured: unstreamed, the same text.
    whole = webui.post("/api/chat", json={**body, "stream": False}).json()
    assert whole["message"]["content"] == "".join(p["message"]["content"] for p in lines)
    assert whole["eval_count"] == last["eval_count"]


def test_think_and_reasoning_effort_reach_the_template(
    webui: httpx.Client, server: RunningServer
) -> None:
    def ollama_prompt(think: Any) -> int:
        body = {"model": OLLAMA_NAME, "messages": ASK, "stream": False}
        body |= {"options": {"num_predict": 1}} | ({} if think is None else {"think": think})
        return webui.post("/api/chat", json=body).json()["prompt_eval_count"]

    def openai_prompt(effort: str | None) -> int:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 1}
        if effort is not None:
            body["reasoning_effort"] = effort
        return webui.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]

    tokenizer = server.engine.tokenizer

    def expected(**kwargs: Any) -> int:
        return len(tokenizer.encode_chat(ASK, **kwargs))

    assert ollama_prompt(None) == ollama_prompt(True) == expected()
    assert ollama_prompt(False) == expected(enable_thinking=False) > expected()
    assert ollama_prompt("high") == expected(reasoning_effort="high")
    assert openai_prompt(None) == expected()
    assert openai_prompt("low") == expected(reasoning_effort="low") > expected()


def test_tool_conversation_as_open_webui_converts_it(
    webui: httpx.Client, server: RunningServer
) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    ollama_messages = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"index": 0, "id": "call_1", "function": call}],
        },
        {"role": "tool", "content": "18 degrees"},
    ]
    body = {"model": OLLAMA_NAME, "messages": ollama_messages, "tools": TOOLS, "stream": False}
    reply = webui.post("/api/chat", json={**body, "options": {"num_predict": 1}}).json()
    template_messages = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
        {"role": "tool", "content": "18 degrees"},
    ]
    expected = server.engine.tokenizer.encode_chat(template_messages, tools=TOOLS)
    assert reply["prompt_eval_count"] == len(expected)
    # The same conversation in OpenAI's shape: arguments as a JSON string, a tool_call_id.
    openai_messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {**call, "arguments": json.dumps(call["arguments"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    body = {"model": MODEL, "messages": openai_messages, "tools": TOOLS, "max_tokens": 1}
    usage = webui.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(expected)


def test_num_predict_past_the_context_ends_there(
    webui: httpx.Client, server: RunningServer
) -> None:
    """Open WebUI sends one num_predict for every model; Ollama stops at the context's end.
    OpenAI's max_tokens past the context stays a 400, as OpenAI's is."""
    room = 3
    tokenizer, context = server.engine.tokenizer, server.engine.max_model_len
    overhead = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    words = context - overhead - room
    messages = [{"role": "user", "content": " a" * words}]
    assert len(tokenizer.encode_chat(messages)) == context - room
    options = {"num_predict": 100_000, "temperature": 0}
    body = {"model": OLLAMA_NAME, "messages": messages, "options": options, "stream": False}
    reply = webui.post("/api/chat", json=body).json()
    assert reply["prompt_eval_count"] == context - room
    assert reply["eval_count"] <= room
    body = {"model": MODEL, "messages": messages, "max_tokens": 100_000}
    refused = webui.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_openai_chat_stream_as_open_webui_sends_it(webui: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.8,
        "top_p": 0.9,
        "max_tokens": 8,
        "seed": 7,
        "stop": ["\n\n"],
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "min_p": 0.05,
        "logit_bias": {},
        # A user's custom parameters, passed through as they are.
        "num_ctx": 4096,
        "my_custom_param": {"nested": [1, 2]},
        # Open WebUI's pipelines get the user as an object.
        "user": {"name": "Ada Lovelace", "id": "u1", "email": "ada@example.com", "role": "admin"},
    }
    with webui.stream("POST", "/v1/chat/completions", json=body) as response:
        sse = SSEReader(response).read_all()
    assert sse.done
    *chunks, usage = sse.data
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert all(isinstance(c["choices"][0]["delta"].get("content", ""), str) for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] <= 8 and usage["usage"]["prompt_tokens"] > 0
    # Through Open WebUI's Ollama connection, the model is named with its tag.
    named = webui.post("/v1/chat/completions", json={**body, "model": OLLAMA_NAME, "stream": False})
    assert named.status_code == 200, named.text
    assert named.json()["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"].get("content", "") for c in chunks
    )


def test_title_generation(webui: httpx.Client) -> None:
    """Title, tag and follow-up generation: one user message with the task's prompt, not
    streamed; Open WebUI reads the reply's text (and parses the JSON it asked for itself)."""
    task = [{"role": "user", "content": "### Task:\nGenerate a concise title.\n### Chat:\nhi"}]
    ollama = {"model": OLLAMA_NAME, "messages": task, "stream": False}
    reply = webui.post("/api/chat", json={**ollama, "options": {"num_predict": 50}}).json()
    assert isinstance(reply["message"]["content"], str) and reply["done"] is True
    openai = {"model": MODEL, "messages": task, "stream": False, "max_tokens": 50}
    reply = webui.post("/v1/chat/completions", json=openai).json()
    assert isinstance(reply["choices"][0]["message"]["content"], str)


def test_unload_is_a_load_request(webui: httpx.Client) -> None:
    body = {"model": OLLAMA_NAME, "keep_alive": 0, "prompt": ""}
    reply = webui.post("/api/generate", json=body).json()
    assert reply["done"] is True and reply["done_reason"] == "load"
    assert len(webui.get("/api/ps").json()["models"]) == 1  # one model, always loaded


def test_embeddings_for_rag(webui: httpx.Client, server: RunningServer) -> None:
    texts = ["Paris is the capital of France.", "Rome is the capital of Italy."]
    width = server.engine.decoder.config.hidden_size
    body = {"model": MODEL, "input": texts, "truncate": True, "keep_alive": "5m", "options": {}}
    ollama = webui.post("/api/embed", json=body).json()["embeddings"]
    assert [len(v) for v in ollama] == [width, width]
    legacy = webui.post("/api/embeddings", json={"model": OLLAMA_NAME, "prompt": texts[0]})
    assert legacy.json()["embedding"] == pytest.approx(ollama[0], abs=1e-6)
    openai = webui.post("/v1/embeddings", json={"input": texts, "model": MODEL}).json()
    assert [d["index"] for d in openai["data"]] == [0, 1]
    for got, want in zip(openai["data"], ollama, strict=True):
        assert got["embedding"] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(
    "path,body,param",
    [
        # Images need a vision model: this one reads text only.
        (
            "/api/chat",
            {
                "messages": [
                    {"role": "user", "content": "What is this?", "images": ["iVBORw0KGgo="]}
                ]
            },
            "messages[0].images[0]",
        ),
        ("/api/chat", {"messages": ASK, "options": {"mirostat": 2}}, "options.mirostat"),
        ("/api/generate", {"prompt": "x", "options": {"typical_p": 0.7}}, "options.typical_p"),
        ("/api/chat", {"messages": ASK, "template": "{{ .Prompt }}"}, "template"),
        ("/api/chat", {"messages": ASK, "think": "hardest"}, "think"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,iVBO"},
                            },
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
        ),
        ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"42": -100}}, "logit_bias"),
    ],
)
def test_refusals(webui: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    """What this server cannot honour is a 400 naming the field, in the shape Open WebUI
    shows: Ollama's `error` string, OpenAI's `error.message`."""
    model = OLLAMA_NAME if path.startswith("/api/") else MODEL
    response = webui.post(path, json={"model": model, "stream": False, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path.startswith("/api/"):
        assert error.startswith(param), error
    else:
        assert error["param"] == param and error["message"]
