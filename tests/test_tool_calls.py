"""Tool-call parsers on canned model outputs, whole and streamed, well-formed or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gapless.server.tool_calls import (
    ToolCallStream,
    ToolRequest,
    detect_parser,
    forced_calls_schema,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "CET"}}


def run(parser: str | None, text: str, pieces: int = 1, **kw) -> tuple[list[str], str, list]:
    """Feeds text in `pieces`-character steps; returns the content deltas as streamed, the
    content left at the end, and the calls as (name, arguments) pairs."""
    stream = ToolCallStream(parser, **kw)
    streamed = [stream.feed(text[i : i + pieces]) for i in range(0, len(text), pieces)]
    rest, calls = stream.finish()
    return streamed, rest, [(c.name, json.loads(c.arguments)) for c in calls]


def hermes(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def phi4(call: dict) -> str:
    return f"<|tool_call|>{json.dumps(call)}<|/tool_call|>"


def harmony_call(call: dict) -> str:
    """A gpt-oss call as the model writes it after `<|start|>assistant`."""
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.{call['name']} "
        f"<|constrain|>json<|message|>{json.dumps(call['arguments'])}<|call|>"
    )


@pytest.mark.parametrize("pieces", [1, 3, 1000])
@pytest.mark.parametrize(
    ("parser", "output", "content", "calls"),
    [
        ("hermes", "Let me look." + hermes(WEATHER), "Let me look.", [WEATHER]),
        ("hermes", hermes(WEATHER, TIME), "", [WEATHER, TIME]),
        # The model stopped after the JSON without closing the tag.
        ("hermes", "<tool_call>" + json.dumps(WEATHER), "", [WEATHER]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            "",
            [WEATHER],
        ),
        (
            "llama3_json",
            ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}',
            "",
            [WEATHER, TIME],
        ),
        ("mistral", "Sure.[TOOL_CALLS]" + json.dumps([WEATHER, TIME]), "Sure.", [WEATHER, TIME]),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
            "",
            [WEATHER],
        ),
        (
            "phi4_mini",
            "Let me check." + phi4(WEATHER) + phi4(TIME),
            "Let me check.",
            [WEATHER, TIME],
        ),
        (
            "phi4_mini",
            f"<|tool_call|>{json.dumps([WEATHER, TIME])}<|/tool_call|>",
            "",
            [WEATHER, TIME],
        ),
        # Generation stops at <|call|> (an end-of-generation token), which may be cut off.
        ("phi4_mini", "<|tool_call|>" + json.dumps(WEATHER), "", [WEATHER]),
        # gpt-oss: reasoning, then a call; the reasoning is not content.
        (
            "harmony",
            "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
            + harmony_call(WEATHER),
            "",
            [WEATHER],
        ),
        # The recipient may come before the channel, as the template writes past calls.
        (
            "harmony",
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
            '{"zone": "CET"}<|call|>' + harmony_call(WEATHER),
            "",
            [TIME, WEATHER],
        ),
        # No call: the final channel is the content.
        (
            "harmony",
            "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
            "<|message|>It is 4.<|return|>",
            "It is 4.",
            [],
        ),
    ],
)
def test_calls_are_parsed_and_never_streamed_as_content(parser, output, content, calls, pieces):
    streamed, rest, got = run(parser, output, pieces)
    assert "".join(streamed) + rest == content
    assert got == [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("pieces", [1, 1000])
@pytest.mark.parametrize(
    ("parser", "output"),
    [
        ("hermes", "No tools needed: the answer is 4."),
        ("hermes", 'I will call <tool_call>{"name": "get_weather", "arguments": {"ci'),  # cut off
        ("hermes", "<tool_call>not json</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", "a partial marker at the end <tool_"),
        ("llama3_json", "Paris is sunny today."),
        ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
        ("mistral", "[TOOL_CALLS][{"),
        ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),  # not a list
        ("phi4_mini", "<|tool_call|>get_weather(city='Paris')<|/tool_call|>"),  # not JSON
        ("phi4_mini", 'Use <|tool_call|>{"name": "get_weather", "arguments": {"ci'),  # cut off
        ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json"),  # no body
        ("harmony", '<|channel|>commentary to=functions.f<|message|>{"a": 1'),  # cut off
        ("harmony", "<|channel|>commentary to=functions.f<|message|>[1, 2]<|call|>"),  # no object
        (None, hermes(WEATHER)),  # no parser: all text
    ],
)
def test_malformed_or_partial_calls_stay_text(parser, output, pieces):
    streamed, rest, calls = run(parser, output, pieces)
    assert calls == []
    assert "".join(streamed) + rest == output


def test_text_before_a_call_streams_before_the_call_ends():
    stream = ToolCallStream("hermes")
    assert stream.feed("Checking the ") == "Checking the "
    assert stream.feed("weather <tool") == "weather "  # `<tool` may begin a call: held
    assert stream.feed("_call>{") == ""
    assert stream.feed(json.dumps(WEATHER)[1:] + "</tool_call>") == ""
    rest, [call] = stream.finish()
    assert rest == "" and call.name == "get_weather" and call.id.startswith("call_")


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, _, calls = run("hermes", hermes(WEATHER, TIME), parallel=False)
    assert [name for name, _ in calls] == ["get_weather"]


def test_forced_calls_are_a_json_list():
    _, rest, calls = run(None, json.dumps([WEATHER, TIME]), 2, forced=True)
    assert rest == "" and [n for n, _ in calls] == ["get_weather", "get_time"]


def test_forced_schema_names_only_the_chosen_function():
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("a", "b")
    ]
    named = forced_calls_schema(
        ToolRequest(tools, {"type": "function", "function": {"name": "b"}}, True)
    )
    assert [c["properties"]["name"] for c in named["items"]["anyOf"]] == [{"const": "b"}]
    assert named["maxItems"] == 1
    required = forced_calls_schema(ToolRequest(tools, "required", True))
    assert len(required["items"]["anyOf"]) == 2 and "maxItems" not in required


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}", "hermes"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
        ('{"name": function name, "parameters": dictionary of argument name}', "llama3_json"),
        ("<|python_tag|>{{ message.content }}", "llama3_json"),
        ("{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}", "phi4_mini"),
        ("respond with <|tool_call|>{...}<|/tool_call|>", "phi4_mini"),
        ("{{- '<|start|>assistant<|channel|>final<|message|>' }}", "harmony"),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_parser_is_detected_from_the_template(template, parser):
    assert detect_parser(template) == parser


@pytest.mark.parametrize(
    ("name", "parser"),
    [
        ("openai-gpt-oss-120b.jinja", "harmony"),
        ("microsoft-Phi-4-mini-instruct.jinja", "phi4_mini"),
        ("microsoft-Phi-3.5-mini-instruct.jinja", None),
        ("google-gemma-3-it.jinja", None),
    ],
)
def test_parser_is_detected_from_the_families_templates(name, parser):
    """The real templates (tests/chat_templates, sources in test_chat_templates.py); Gemma 3's
    and Phi-3's have no tool-call format."""
    path = Path(__file__).parent / "chat_templates" / name
    assert detect_parser(path.read_text(encoding="utf-8")) == parser
