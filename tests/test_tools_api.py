"""Tools, structured output and n > 1 over HTTP, through the `openai` client.

Random weights never call a tool by themselves: these tests force calls with tool_choice
(generated under a grammar) and check the round trip of a conversation through tool-aware
chat templates written here in the Hermes and Llama 3 styles.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from server_fixture import MODEL, running_server

from gapless.server.images import ImageReader
from gapless.server.openai_chat import parse_chat

HERMES_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|system|>You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}<|assistant|>
{%- for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}<|end|>
{%- elif message.role == "tool" %}<|user|><tool_response>{{ message.content }}</tool_response><|end|>
{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

LLAMA3_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|user|>Respond with a JSON {"name": function name, "parameters": dictionary of argument name and its value}. Functions: {{ tools | tojson }}<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.tool_calls is defined %}<|assistant|><|python_tag|>{{ {"name": message.tool_calls[0].function.name, "parameters": message.tool_calls[0].function.arguments} | tojson }}<|end|>
{%- elif message.role == "tool" %}<|ipython|>{{ message.content }}<|end|>
{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}},
                "required": ["zone"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def hermes_dir(checkpoint, tmp_path_factory) -> Path:
    return with_template(checkpoint("llama"), tmp_path_factory.mktemp("h") / "m", HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def server(hermes_dir):
    # Small chunks and no prefix cache: prompts prefill over several steps, and any KV
    # sharing seen on /metrics comes from forking n choices.
    with running_server(hermes_dir, prefill_chunk=16, enable_prefix_cache=False) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_tool_choice_required_always_returns_valid_calls(client, sampling):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, **sampling
    )
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_named_tool_choice_streams_one_call_and_no_content(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == ""  # the call's text is never sent as content
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].function.name == "get_weather"
    check_calls(deltas, {"get_weather"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_auto_answer_with_text(client):
    def answer(**tool_fields: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, temperature=0, **tool_fields
        )

    plain = answer()
    # none: the template is not shown the tools, and all the output is text: as without tools.
    none = answer(tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # auto: the template shows the tools; random weights write no call, so it is all text.
    auto = answer(tools=TOOLS, tool_choice="auto")
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason in ("stop", "length")
    assert auto.choices[0].message.content


def test_a_tool_conversation_reaches_the_template_in_transformers_shape(server):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    engine = server.engine
    body = {"messages": messages, "tools": TOOLS}
    parsed = parse_chat(body, engine.admission, engine.grammars, ImageReader())
    text = engine.tokenizer.decode(parsed.prompt_ids, skip_special_tokens=False)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        in text
    )
    assert "<tool_response>18 degrees</tool_response>" in text
    assert '"description": "Current weather in a city"' in text  # the tools themselves


def test_json_schema_output_validates_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=RESPONSE_FORMAT, max_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    assert chat.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=60,
        temperature=1.0,
        seed=5,
        stream=True,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = "".join(c.choices[0].text for c in stream)
    assert isinstance(json.loads(text), dict)


def test_guided_choice_and_regex(client):
    choice = client.completions.create(
        model=MODEL, prompt="Yes or no?", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")


def test_n_choices_have_their_own_index_finish_and_usage(client):
    one = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, n=3, temperature=1.0, seed=1, logprobs=True
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) > 0 for c in response.choices)
    assert response.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in response.choices
    )
    assert len({c.message.content for c in response.choices}) > 1


def test_n_choices_stream_interleaved_and_share_the_prompt_kv(server, client, monkeypatch):
    # The engine steps only as the client reads, so it cannot finish (and free the blocks)
    # before the KV use is sampled.
    steps = threading.Semaphore(2)
    execute = server.engine.runner.execute

    def paced(*args: Any, **kwargs: Any) -> Any:
        steps.acquire(timeout=30)
        return execute(*args, **kwargs)

    monkeypatch.setattr(server.engine.runner, "execute", paced)
    prompt = list(range(20, 20 + 256))  # 16 full blocks of 16 tokens
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=64,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    used, finishes, usage = [], {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
        elif len(used) < 5:
            used.append(server.metrics()["gapless_kv_blocks_used"])
        steps.release(1 if len(used) < 5 else 1000)
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == 256 and usage.completion_tokens == 3 * 64
    # One prompt (16 blocks) plus each choice's own output blocks (64 tokens: at most 4 each);
    # three prompts alone would be 48.
    assert used and all(16 < u <= 16 + 3 * 4 for u in used), used
    assert server.metrics()["gapless_kv_blocks_used"] == 0


def test_llama3_template_is_detected_and_forced_calls_work(checkpoint, tmp_path):
    model_dir = with_template(checkpoint("llama"), tmp_path / "m", LLAMA3_TEMPLATE)
    with running_server(model_dir) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        # Detected: a choice left to the model needs a parser (a 400 without one). Random
        # weights write no call: the answer is text.
        auto = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0
        )
        [choice] = auto.choices
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert choice.message.content
        forced = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=60,
            temperature=0,  # unseeded sampling could spend the 60 tokens inside the call
        )
        check_calls(forced.choices[0].message.tool_calls, {"get_time"})
