"""OpenAI's Responses API (/v1/responses) through the official `openai` client, against a real
server on a loopback port: input shapes, text.format, tools, the event stream, the stored
responses and their caps, and errors in OpenAI's shape.

Greedy decoding makes the text deterministic, so a response's text is checked against the
chat endpoint's for the same conversation, token for token.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixture import MODEL, RunningServer, running_server
from test_tools_api import HERMES_TEMPLATE, with_template

from gapless.server.response_store import ResponseStore

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory) -> Iterator[RunningServer]:
    model_dir = with_template(
        checkpoint("llama"), tmp_path_factory.mktemp("r") / "m", HERMES_TEMPLATE
    )
    with running_server(model_dir, prefill_chunk=16) as running:
        yield running


def chat_text(client: httpx.Client, messages: list[dict[str, Any]], max_tokens: int) -> str:
    """The chat endpoint's greedy answer to the same conversation."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def prompt_len(server: RunningServer, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    return len(server.engine.tokenizer.encode_chat(messages, **kwargs))


# -- creating a response --------------------------------------------------------------------


def test_string_input_with_instructions(
    oai: openai.OpenAI, client: httpx.Client, server: RunningServer
) -> None:
    response = oai.responses.create(
        input="Hello there", instructions="Be brief.", max_output_tokens=12, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.instructions == "Be brief."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text == chat_text(client, messages, 12)
    usage = response.usage
    assert usage.input_tokens == prompt_len(server, messages)
    assert usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + 12
    assert usage.output_tokens_details.reasoning_tokens == 0
    # No other test sends this prompt; the same request again finds its whole blocks cached.
    assert usage.input_tokens_details.cached_tokens == 0
    again = oai.responses.create(
        input="Hello there", instructions="Be brief.", max_output_tokens=12, **GREEDY
    )
    block = server.engine.kv.pool.block_size
    cached = (usage.input_tokens - 1) // block * block  # the last token is always recomputed
    assert again.usage.input_tokens_details.cached_tokens == cached > 0
    # 12 tokens of a greedy answer that does not end by itself within them.
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"


def test_list_input_is_the_chat_conversation(
    oai: openai.OpenAI, client: httpx.Client, server: RunningServer
) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Bonjour.", "annotations": []}],
        },
        {"role": "user", "content": "And the weather?"},
    ]
    response = oai.responses.create(input=items, max_output_tokens=8, **GREEDY)
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "And the weather?"},
    ]
    assert response.usage.input_tokens == prompt_len(server, messages)
    assert response.output_text == chat_text(client, messages, 8)


def test_a_response_that_ends_by_itself_is_completed(oai: openai.OpenAI) -> None:
    # A schema's grammar ends the output when the JSON is complete.
    response = oai.responses.create(
        input="A person:",
        max_output_tokens=60,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        **GREEDY,
    )
    assert response.status == "completed" and response.incomplete_details is None
    assert response.completed_at is not None
    assert response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), PERSON)

    anything = oai.responses.create(
        input="An object:",
        max_output_tokens=200,
        text={"format": {"type": "json_object"}},
        **GREEDY,
    )
    assert anything.status == "completed"
    assert isinstance(json.loads(anything.output_text), dict)


def test_logprobs_are_the_chat_endpoints(oai: openai.OpenAI, client: httpx.Client) -> None:
    kwargs: dict[str, Any] = {
        "input": "Hello there",
        "max_output_tokens": 6,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
        **GREEDY,
    }
    response = oai.responses.create(**kwargs)
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()["choices"][0]["logprobs"]["content"]
    got = [lp.model_dump() for lp in response.output[0].content[0].logprobs]
    assert len(got) == 6 and all(len(lp["top_logprobs"]) == 2 for lp in got)
    assert got == chat
    events = list(oai.responses.create(stream=True, **kwargs))
    streamed = [
        lp.model_dump()
        for e in events
        if e.type == "response.output_text.delta"
        for lp in e.logprobs
    ]
    assert [(lp["token"], lp["logprob"]) for lp in streamed] == [
        (lp["token"], lp["logprob"]) for lp in chat
    ]
    # Without `include`, none.
    plain = oai.responses.create(**{**kwargs, "include": []})
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 2


# -- streaming ------------------------------------------------------------------------------


def test_stream_events_in_order(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"input": "Tell me a story.", "max_output_tokens": 10, **GREEDY}
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 10 tokens: cut short
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item_id}
    assert events[-4].text == text and events[-3].part.text == text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "incomplete"
    assert final.output[0].content[0].text == text
    assert final.usage.output_tokens == 10
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


def test_stream_helper_assembles_the_final_response(oai: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    with oai.responses.stream(
        input="A person:", max_output_tokens=60, text={"format": fmt}, **GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), PERSON)


# -- tools ----------------------------------------------------------------------------------


def test_forced_call_then_its_output_continues_the_conversation(
    oai: openai.OpenAI, client: httpx.Client, server: RunningServer
) -> None:
    first = oai.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        **GREEDY,
    )
    assert first.status == "completed"
    [call] = first.output  # no message: the whole output is the call
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert first.tool_choice.name == "get_weather"

    second = oai.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=6,
        **GREEDY,
    )
    assert second.previous_response_id == first.id
    [message] = second.output
    assert message.type == "message"
    # The template saw the whole conversation: the question, the call, its output.
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.arguments)},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.call_id,
            "name": "get_weather",
            "content": "18 degrees",
        },
    ]
    assert second.usage.input_tokens == prompt_len(server, conversation)
    text = server.engine.tokenizer.decode(
        server.engine.tokenizer.encode_chat(conversation), skip_special_tokens=False
    )
    assert "<tool_response>18 degrees</tool_response>" in text
    assert message.content[0].text == chat_text(client, conversation, 6)

    # The same turn with the conversation sent whole (no store) reads the same prompt.
    whole = oai.responses.create(
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
        ],
        store=False,
        max_output_tokens=6,
        **GREEDY,
    )
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(whole.id)


def test_required_tool_call_streams_its_arguments(oai: openai.OpenAI) -> None:
    with oai.responses.stream(
        input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=40, **GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert delta.item_id == added.item.id == item_done.item.id
    assert delta.delta == done.arguments == item_done.item.arguments
    assert json.loads(done.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    [call] = final.output
    assert call.call_id == item_done.item.call_id and call.arguments == done.arguments


def test_tools_reach_the_template(oai: openai.OpenAI, server: RunningServer) -> None:
    response = oai.responses.create(
        input="Weather?", tools=[WEATHER], tool_choice="auto", max_output_tokens=1, **GREEDY
    )
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in WEATHER if k != "type"}}
    messages = [{"role": "user", "content": "Weather?"}]
    assert response.usage.input_tokens == prompt_len(server, messages, tools=[chat_tool])
    assert response.tools[0].name == "get_weather"


# -- stored responses -----------------------------------------------------------------------


def test_get_and_delete_a_stored_response(oai: openai.OpenAI, client: httpx.Client) -> None:
    response = oai.responses.create(input="Hi", max_output_tokens=3, **GREEDY)
    assert response.store is True
    stored = oai.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    deleted = client.delete(f"/v1/responses/{response.id}")
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for gone in (
        client.get(f"/v1/responses/{response.id}"),
        client.delete(f"/v1/responses/{response.id}"),
    ):
        assert gone.status_code == 404
        assert gone.json()["error"]["type"] == "not_found_error"
        assert gone.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(input="Hi", previous_response_id=response.id, **GREEDY)
    assert missing.value.body["param"] == "previous_response_id"


def test_the_store_evicts_the_least_recently_used(
    oai: openai.OpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = server.server.state.responses
    monkeypatch.setattr(store, "max_entries", 2)
    ids = [
        oai.responses.create(input=f"Hi {i}", max_output_tokens=2, **GREEDY).id for i in range(3)
    ]
    assert ids[0] not in store and ids[1] in store and ids[2] in store
    oai.responses.retrieve(ids[1])  # now the most recently used
    ids.append(oai.responses.create(input="Hi 3", max_output_tokens=2, **GREEDY).id)
    assert ids[2] not in store and ids[1] in store and ids[3] in store
    # A follow-up counts as a use, and keeps the whole conversation it continues.
    follow = oai.responses.create(
        input="Again", previous_response_id=ids[1], max_output_tokens=2, **GREEDY
    )
    assert ids[3] not in store
    # The byte cap: each entry is about the same size, so room for one evicts the other.
    monkeypatch.setattr(store, "max_entries", 100)
    monkeypatch.setattr(store, "max_bytes", store.get(follow.id).size + 400)
    last = oai.responses.create(input="Hi 4", max_output_tokens=2, **GREEDY)
    assert len(store) == 1 and last.id in store and store.bytes <= store.max_bytes
    # One over the cap alone is not stored at all.
    monkeypatch.setattr(store, "max_bytes", 100)
    too_big = oai.responses.create(input="Hi 5", max_output_tokens=2, **GREEDY)
    assert too_big.id not in store and last.id in store


def test_response_store_unit() -> None:
    store = ResponseStore(max_entries=3, max_bytes=10_000)

    def put(i: int, size: int = 10) -> bool:
        return store.put({"id": f"resp_{i}", "output": [{"text": "x" * size}]}, [])

    for i in range(3):
        assert put(i)
    assert store.get("resp_0") is not None  # resp_1 is now the least recently used
    assert put(3)
    assert "resp_1" not in store and len(store) == 3
    sizes = sum(store.get(f"resp_{i}").size for i in (0, 2, 3))
    assert store.bytes == sizes
    assert store.delete("resp_0") and not store.delete("resp_0")
    assert store.bytes == sizes - len(
        json.dumps([{"id": "resp_0", "output": [{"text": "x" * 10}]}, []])
    )
    assert not put(4, size=20_000) and len(store) == 2
    assert put(2, size=20)  # replacing an entry counts it once
    assert len(store) == 2 and store.get("resp_2").response["output"][0]["text"] == "x" * 20
    store.max_bytes = store.bytes + 5
    assert put(5, size=40)  # room is made by evicting the least recently used first
    assert "resp_3" not in store and "resp_2" not in store and "resp_5" in store


def test_conversation_outlives_the_responses_it_began_with(
    oai: openai.OpenAI, server: RunningServer
) -> None:
    first = oai.responses.create(input="One", max_output_tokens=2, **GREEDY)
    second = oai.responses.create(
        input="Two", previous_response_id=first.id, max_output_tokens=2, **GREEDY
    )
    oai.responses.delete(first.id)
    third = oai.responses.create(
        input="Three", previous_response_id=second.id, max_output_tokens=2, **GREEDY
    )
    messages = [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Three"},
    ]
    assert third.usage.input_tokens == prompt_len(server, messages)


# -- cancellation and failures ---------------------------------------------------------------


def test_cancel_by_response_id(
    oai: openai.OpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine waits inside its first step until the request has been cancelled.
    gate = threading.Event()
    execute = server.engine.runner.execute

    def gated(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return execute(*args, **kwargs)

    monkeypatch.setattr(server.engine.runner, "execute", gated)
    try:
        stream = oai.responses.create(input="Go on", max_output_tokens=500, stream=True, **GREEDY)
        created = next(iter(stream))
        assert created.type == "response.created"
        cancelled = httpx.post(f"{server.url}/v1/cancel/{created.response.id}", json={})
        assert cancelled.status_code == 200
    finally:
        gate.set()
    events = list(stream)
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "cancelled"
    assert final.response.usage.output_tokens < 500


def test_failure_fails_the_response(
    oai: openai.OpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(server.engine.runner, "execute", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        oai.responses.create(input="fail me", max_output_tokens=3, **GREEDY)
    assert caught.value.body["type"] == "server_error"
    events = list(oai.responses.create(input="fail me", max_output_tokens=3, stream=True, **GREEDY))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = events[-1].response
    assert failed.status == "failed" and "injected" in failed.error.message
    assert failed.id not in server.server.state.responses


# -- bad requests ---------------------------------------------------------------------------

TEXT = {"model": MODEL, "input": "hi"}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL}, "input"),
        ({**TEXT, "input": []}, "input"),
        ({**TEXT, "input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {**TEXT, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({**TEXT, "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {
                **TEXT,
                "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
            },
            "input[0].arguments",
        ),
        ({**TEXT, "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({**TEXT, "instructions": 5}, "instructions"),
        ({**TEXT, "max_output_tokens": 0}, "max_output_tokens"),
        ({**TEXT, "max_output_tokens": 10**6}, "max_output_tokens"),
        ({**TEXT, "temperature": "hot"}, "temperature"),
        ({**TEXT, "top_p": 7}, "top_p"),
        ({**TEXT, "top_logprobs": 21}, "top_logprobs"),
        ({**TEXT, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({**TEXT, "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({**TEXT, "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {**TEXT, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice",
        ),
        ({**TEXT, "tool_choice": "required"}, "tool_choice"),
        (
            {
                **TEXT,
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
        ),
        ({**TEXT, "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({**TEXT, "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        (
            {
                **TEXT,
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "objectz"}}
                },
            },
            "text.format.schema",
        ),
        ({**TEXT, "background": True}, "background"),
        ({**TEXT, "conversation": "conv_1"}, "conversation"),
    ],
)
def test_bad_requests(client: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_unknown_previous_response_and_model(client: httpx.Client) -> None:
    r = client.post("/v1/responses", json={**TEXT, "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "previous_response_not_found"
    r = client.post("/v1/responses", json={**TEXT, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.put("/v1/responses", json=TEXT).status_code == 405


def test_unknown_fields_are_ignored(oai: openai.OpenAI, server: RunningServer) -> None:
    response = oai.responses.create(
        input="Hi",
        max_output_tokens=2,
        metadata={"run": "7"},
        truncation="disabled",
        user="someone",
        extra_body={"stop": ["x"], "some_future_field": 1},
        **GREEDY,
    )
    assert response.metadata == {"run": "7"}
    assert response.usage.output_tokens == 2
