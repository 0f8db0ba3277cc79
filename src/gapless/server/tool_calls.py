"""Tool calling for the OpenAI chat API: the request's `tools` and `tool_choice`, and the
model's text parsed back into `tool_calls`.

Each model family writes its calls in its own format, which its chat template teaches it:

| parser | what the model writes |
| --- | --- |
| `hermes` (Hermes, Qwen 2.5/3) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call |
| `llama3_json` (Llama 3.x) | `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;` |
| `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` |
| `phi4_mini` (Phi-4-mini) | `<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>`, one per call (or a list in one) |
| `harmony` (gpt-oss) | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, a message per call |

A harmony reply is a sequence of messages on channels: with tools offered, all of it is held
until the end, its calls read out of the messages addressed `to=functions.NAME`, its
content is the `final` channel's text, and its `analysis` channel (the model's reasoning) is
dropped, as OpenAI's API does not return it.

A forced call (`tool_choice` `required` or a named function) is generated under a grammar
instead, as a JSON list of `{"name", "arguments"}` objects (`forced_calls_schema`), whatever
the model's own format: the output is then always a valid call.

Text before a call streams as content; from where a call may begin, text is held back until
the output ends, then it becomes tool calls if it parses, and content if it does not.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gapless.engine.structured import GrammarCompiler
from gapless.server.protocol import invalid
from gapless.server.structured_output import checked_schema_grammar

PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini", "harmony")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


# -- requests ------------------------------------------------------------------------------


@dataclass
class ToolRequest:
    """What a chat request asks of tools: those to offer the template, and how to read the
    output back."""

    tools: list[dict[str, Any]]  # for the template; empty when tool_choice is none
    choice: str | dict[str, Any]  # auto, required, none, or {"type": "function", ...}
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, checked; None when it offers none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs `tools`", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of tools", "tools")
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    if len(set(names)) < len(names):
        raise invalid("tools must have distinct function names", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid(
                'a tool_choice object must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise invalid(
            "tool_choice must be none, auto, required or a function object", "tool_choice"
        )
    if choice == "required" and not tools:
        raise invalid("tool_choice required needs at least one tool", "tool_choice")
    # tool_choice none: as OpenAI, the model is not to call tools; it is not shown them.
    return ToolRequest(tools if choice != "none" else [], choice, parallel)


def _check_tool(tool: Any, i: int) -> str:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid('each tool must be {"type": "function", "function": {...}}', param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid("a tool needs a `function` object", f"{param}.function")
    return check_function(function, f"{param}.function")


def check_function(function: dict[str, Any], param: str) -> str:
    """A function's `name`, `description` and `parameters` (at `param`); its name."""
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise invalid(
            "a function name must be 1 to 64 letters, digits, '_', '.' or '-'", f"{param}.name"
        )
    if not isinstance(function.get("description", ""), str):
        raise invalid("a function description must be a string", f"{param}.description")
    if not isinstance(function.get("parameters", {}), dict):
        raise invalid("function parameters must be a JSON schema object", f"{param}.parameters")
    return name


def forced_calls_schema(request: ToolRequest) -> dict[str, Any]:
    """The JSON schema of a forced answer: a list of calls, each of an offered function with
    arguments valid for its parameters."""
    tools = [t["function"] for t in request.tools]
    if isinstance(request.choice, dict):
        tools = [f for f in tools if f["name"] == request.choice["function"]["name"]]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in tools
    ]
    one_call = isinstance(request.choice, dict) or not request.parallel
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if one_call:
        schema["maxItems"] = 1
    return schema


def apply_tools(
    tools: ToolRequest | None,
    fields: dict[str, Any],
    grammars: GrammarCompiler,
    chat_template: str | None,
    configured_parser: str | None,
) -> str | None:
    """A request's SamplingParams `fields` for its tools, in every dialect: a forced call is
    generated under its schema's grammar (so it is always valid; never beside an output
    format); a call the model may choose to write is read by the parser returned, and
    special tokens are kept, since markers such as [TOOL_CALLS] often are ones."""
    if tools is None:
        return None
    if tools.forced:
        if fields.get("grammar") is not None:
            raise invalid(
                "a forced tool_choice cannot be combined with an output format", "tool_choice"
            )
        schema = forced_calls_schema(tools)
        fields["grammar"] = checked_schema_grammar(schema, grammars, "tools")
        return None
    if not tools.tools:
        return None
    fields.setdefault("skip_special_tokens", False)
    return choose_parser(chat_template, configured_parser)


# -- parsing the output --------------------------------------------------------------------


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs, if it shows one."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|channel|>" in template:
        return "harmony"
    # Phi-4-mini's own template has only the <|tool|> slot for the offered tools.
    if "<|tool_call|>" in template or "<|tool|>" in template:
        return "phi4_mini"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None


def choose_parser(chat_template: str | None, configured: str | None) -> str:
    """The parser for a request that lets the model choose whether to call tools."""
    parser = configured or detect_parser(chat_template)
    if parser is None:
        raise invalid(
            "this model's chat template shows no tool-call format this server can read; "
            f"start the server with --tool-call-parser ({', '.join(PARSERS)})",
            "tools",
        )
    return parser


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values written one after another in text, or None if it is anything else."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


# What a parser makes of the held text: the content it holds (only a harmony reply has any
# beside its calls) and the calls; None when it is not what the format writes.
Parsed = tuple[str, list[ToolCall]] | None


def _all(calls: list[ToolCall | None]) -> Parsed:
    return None if not calls or None in calls else ("", calls)  # type: ignore[return-value]


def _hermes(held: str) -> Parsed:
    # The last call may lack its closing tag when the model stopped right after its JSON.
    bodies = re.split(r"</tool_call>\s*(?:<tool_call>)?", held.removeprefix("<tool_call>"))
    values = [_json_values(b, "") for b in bodies if b.strip()]
    return _all([_call(v[0]) if v and len(v) == 1 else None for v in values])


def _llama3(held: str) -> Parsed:
    values = _json_values(held.removeprefix("<|python_tag|>"), ";")
    return _all([_call(v, "parameters") for v in values or []])


def _mistral(held: str) -> Parsed:
    body = held.removeprefix("[TOOL_CALLS]")
    if "[ARGS]" in body:  # newer format: name[ARGS]{...}, once per call
        parts = re.split(r"\[TOOL_CALLS\]", body)
        calls = []
        for part in parts:
            name, _, arguments = part.partition("[ARGS]")
            values = _json_values(arguments, "")
            calls.append(_call({"name": name.strip(), "arguments": values[0]}) if values else None)
        return _all(calls)
    values = _json_values(body, "")
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    return _all([_call(v) for v in values[0]])


def _forced(held: str) -> Parsed:
    values = _json_values(held, "")
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    return _all([_call(v) for v in values[0]])


def _phi4_mini(held: str) -> Parsed:
    bodies = re.split(
        r"<\|/tool_call\|>\s*(?:<\|tool_call\|>)?", held.removeprefix("<|tool_call|>")
    )
    calls: list[ToolCall | None] = []
    for body in filter(str.strip, bodies):
        values = _json_values(body, "")
        if not values or len(values) != 1:
            return None
        calls += (
            [_call(v) for v in values[0]] if isinstance(values[0], list) else [_call(values[0])]
        )
    return _all(calls)


_HARMONY_MESSAGE = re.compile(
    r"(?P<header>.*?)<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S
)
_HARMONY_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.-]+)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>(\w+)")


def _harmony(held: str) -> Parsed:
    """Messages, each `[<|start|>assistant][ to=functions.NAME]<|channel|>CHANNEL[ to=...]
    [<|constrain|>json]<|message|>BODY` up to <|end|>, <|call|> or <|return|> (the last two
    end generation, so the output may stop before them)."""
    content, calls = [], []
    for part in filter(None, held.split("<|start|>")):
        message = _HARMONY_MESSAGE.fullmatch(part)
        if message is None:
            return None
        recipient = _HARMONY_RECIPIENT.search(message["header"])
        channel = _HARMONY_CHANNEL.search(message["header"])
        if recipient is not None:
            values = _json_values(message["body"], "")
            if not values or len(values) != 1 or not isinstance(values[0], dict):
                return None
            calls.append(ToolCall(recipient[1], json.dumps(values[0], ensure_ascii=False)))
        elif channel is not None and channel[1] == "final":
            content.append(message["body"])
    return "".join(content), calls


# parser -> (the texts where calls begin, how the held text becomes calls)
_FORMATS = {
    "hermes": (("<tool_call>",), _hermes),
    "llama3_json": (("<|python_tag|>", "{"), _llama3),
    "mistral": (("[TOOL_CALLS]",), _mistral),
    "phi4_mini": (("<|tool_call|>",), _phi4_mini),
    "harmony": (("<|channel|>", "<|start|>"), _harmony),
}


class ToolCallStream:
    """One choice's output text, split into content and tool calls as it streams.

    feed() returns the content that is safe to show now; finish() returns the rest of the
    content and the calls. Held text that does not parse comes back as content."""

    def __init__(self, parser: str | None, forced: bool = False, parallel: bool = True) -> None:
        if forced:
            self._markers: tuple[str, ...] = ("",)  # everything is the call
            self._parse = _forced
        else:
            self._markers, self._parse = _FORMATS[parser] if parser else ((), None)
        # llama3_json's `{` begins a call only as the first thing the model writes.
        self._anywhere = tuple(m for m in self._markers if m != "{")
        self._at_start = "{" in self._markers
        self._parallel = parallel
        self._pending = ""  # text that may be the start of a marker
        self._held: str | None = None  # from the marker on
        self._seen_text = False

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held += text
            return ""
        text = self._pending + text
        if self._at_start and not self._seen_text:
            stripped = text.lstrip()
            if not stripped:
                self._pending = text
                return ""
            self._seen_text = True
            if stripped.startswith("{"):
                self._pending, self._held = "", stripped
                return ""
        starts = [(text.find(m), m) for m in self._anywhere if m in text]
        if starts:
            at = min(starts)[0]
            self._pending, self._held = "", text[at:]
            return text[:at]
        keep = max((_partial_suffix(text, m) for m in self._anywhere), default=0)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._held is None or self._parse is None:
            rest, self._pending = self._pending, ""
            return rest, []
        held, self._held = self._held, None
        parsed = self._parse(held)
        if parsed is None:
            return held, []  # not a call after all: the model's text, unchanged
        content, calls = parsed
        return content, calls if self._parallel else calls[:1]


def output_stream(tools: ToolRequest | None, parser: str | None) -> ToolCallStream:
    """One output's split into content and calls: a forced call is the whole output, `parser`
    (apply_tools') reads the calls the model chose to write, and with neither (no tools, or
    tool_choice none) all of it is content."""
    forced = tools is not None and tools.forced
    return ToolCallStream(parser, forced, tools.parallel if tools is not None else True)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
