"""The Anthropic Messages dialect: POST /v1/messages and /v1/messages/count_tokens.

A request (system, messages of text / tool_use / tool_result blocks, tools) becomes the
chat-template conversation transformers' apply_chat_template takes; engine events become a
message object, or its named SSE events in Anthropic's order; errors are
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission, CheckedImages
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.server import protocol, tool_calls
from gapless.server.endpoint import ServerState, generate, parse_off_loop, read_json
from gapless.server.images import (
    ImageReader,
    MessageContent,
    SentImage,
    check_images,
    decode_base64,
)
from gapless.server.protocol import APIError, bool_field, int_field, invalid
from gapless.server.streaming import Renderer, progress_comment, sse
from gapless.server.tool_calls import ToolCall, ToolRequest

# Anthropic's error types where ours differ in name.
_ERROR_TYPES = {"server_error": "api_error"}
# A message's id is this and the request's id.
ID_PREFIX = "msg_"
# The request's names for the engine's fields.
FIELD_NAMES = {"prompt": "messages", "images": "messages", "stop": "stop_sequences"}


def error_body(error: APIError) -> dict[str, Any]:
    kind = "request_too_large" if error.status == 413 else error.type
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(kind, kind), "message": error.message_naming_param()},
    }


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedMessages:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    tools: ToolRequest | None = None
    tool_parser: str | None = None  # how calls are read out of the output, if not forced


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise invalid("a tool_use block needs a string `name` and an object `input`", param)
    call_id = block.get("id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _image(block: dict[str, Any], param: str, reader: ImageReader) -> bytes:
    """An image block's bytes: its source is base64 data, or a URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return decode_base64(source.get("data"), f"{param}.source.data")
    if kind == "url":
        return reader.url(source.get("url"), f"{param}.source.url")
    raise invalid("an image block needs a source of type base64 or url", f"{param}.source")


def _turn(
    message: dict[str, Any], index: int, reader: ImageReader
) -> tuple[list[dict[str, Any]], list[SentImage]]:
    """One Anthropic message as template messages, and its images: its tool_result blocks
    become `tool` messages (answering the previous assistant turn, so they come first), its
    text, image and tool_use blocks one user or assistant message."""
    param, role = f"messages[{index}]", message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}], []
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content blocks", f"{param}.content")
    own = MessageContent()
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            own.text(block["text"])
        elif kind == "image" and role == "user":
            own.image(_image(block, where, reader), where)
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and role == "user":
            result = protocol.text_content(block.get("content", ""), f"{where}.content")
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
            )
        else:
            raise invalid(
                f"unsupported content block {kind!r} in a {role} message; text, image (user), "
                "tool_use (assistant) and tool_result (user) are",
                where,
            )
    turn: dict[str, Any] = {"role": role, "content": own.template_content()}
    if calls:
        turn["tool_calls"] = calls
    turns = results + [turn] if own.parts or calls or not results else results
    return turns, own.images


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions as the function schemas chat templates render."""
    tools = protocol.list_field(body, "tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or not isinstance(tool.get("input_schema"), dict)
        ):
            raise invalid(
                "a tool needs a string `name` and an object `input_schema`", f"tools[{i}]"
            )
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


# Anthropic's tool_choice types -> OpenAI's tool_choice (`tool` names one function).
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """`tools` and `tool_choice`, checked as the OpenAI endpoint checks its own."""
    tools = _tools(body)
    if tools is None:
        return None
    choice = protocol.dict_field(body, "tool_choice") or {"type": "auto"}
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        mapped: Any = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        mapped = _TOOL_CHOICES[kind]
    else:
        raise invalid("tool_choice must be auto, any, none, or a tool with its name", "tool_choice")
    parallel = not bool_field(choice, "disable_parallel_tool_use")
    openai_shaped = {"tools": tools, "tool_choice": mapped, "parallel_tool_calls": parallel}
    return tool_calls.parse_tools(openai_shaped)


def prompt_ids_of(
    body: dict[str, Any], admission: Admission, reader: ImageReader, tools: ToolRequest | None
) -> tuple[list[int], CheckedImages]:
    """The ids of `system`, `messages` and the tools offered through the chat template, not
    yet checked as a prompt (count_tokens counts them whatever their length), and the
    messages' images, checked."""
    messages = protocol.chat_messages(body, ("user", "assistant"))
    conversation = []
    sent: list[SentImage] = []
    system = protocol.text_content(body.get("system"), "system")
    if system:
        conversation.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        turns, images = _turn(message, i, reader)
        conversation += turns
        sent += images
    checked = check_images(admission, sent)
    offered = {"tools": tools.tools if tools is not None and tools.tools else None}
    return admission.encode_chat(conversation, **offered), checked


def parse_messages(
    body: dict[str, Any],
    admission: Admission,
    grammars: GrammarCompiler,
    reader: ImageReader,
    configured_parser: str | None,
) -> ParsedMessages:
    requested = int_field(body, "max_tokens")
    if requested is None:
        raise invalid("max_tokens is required", "max_tokens")
    tools = tool_request(body)
    ids, images = prompt_ids_of(body, admission, reader, tools)
    prompt_ids = admission.check_prompt(ids, images=images)
    fields = protocol.number_fields(
        body,
        floats={"temperature": "temperature", "top_p": "top_p"},
        ints={"top_k": "top_k"},
    )
    fields.update(
        max_tokens=admission.output_budget(requested, len(prompt_ids), least=1),
        stop=protocol.stop_field(body, "stop_sequences"),
        speculate=protocol.bool_field(body, "speculate") is not False,
    )
    stream = bool(bool_field(body, "stream"))
    # Anthropic's own service_tier (auto, standard_only) picks between its capacity pools,
    # which a single server has not: ignored.
    fields["service_class"] = protocol.service_class(body, stream)
    chat_template = admission.tokenizer.chat_template
    parser = tool_calls.apply_tools(tools, fields, grammars, chat_template, configured_parser)
    return ParsedMessages(prompt_ids, SamplingParams(**fields), stream, tools, parser)


# -- rendering engine events ---------------------------------------------------------------


def _stop_reason(finished: FinishedEvent, calls: list[ToolCall]) -> str:
    if calls and finished.finish_reason == "stop":
        return "tool_use"
    if finished.finish_reason == "length":
        return "max_tokens"
    if finished.stop_string is not None:
        return "stop_sequence"
    # gapless's own "cancelled" passes through, as on the OpenAI endpoints.
    return "end_turn" if finished.finish_reason == "stop" else finished.finish_reason


def _usage(finished: FinishedEvent) -> dict[str, Any]:
    # Anthropic counts prompt tokens read from the cache apart from input_tokens.
    return {
        "input_tokens": finished.prompt_tokens - finished.cached_prompt_tokens,
        "cache_read_input_tokens": finished.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": finished.completion_tokens,
    }


class _MessageRenderer(Renderer):
    def __init__(self, state: ServerState, parsed: ParsedMessages, request_id: str) -> None:
        super().__init__()
        self.id = f"{ID_PREFIX}{request_id}"
        self.model = state.settings.served_model_name
        self.input_tokens = len(parsed.prompt_ids)
        # feed(): the text that is content (a call's is held back); finish(): held text
        # that was not a call after all, and the calls.
        self.tool_stream = tool_calls.output_stream(parsed.tools, parsed.tool_parser)

    def message(self, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    @staticmethod
    def event(data: dict[str, Any]) -> bytes:
        return sse(data, event=data["type"])

    def opening(self) -> list[bytes]:
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0}
        block = {"type": "text", "text": ""}
        return [
            self.event({"type": "message_start", "message": self.message([], usage)}),
            self.event({"type": "content_block_start", "index": 0, "content_block": block}),
        ]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return [progress_comment(event)]

    def text_delta(self, text: str) -> list[bytes]:
        if not text:  # text held back (half a character, a possible stop sequence, a call)
            return []
        delta = {"type": "text_delta", "text": text}
        return [self.event({"type": "content_block_delta", "index": 0, "delta": delta})]

    def token(self, event: TokenEvent) -> list[bytes]:
        return self.text_delta(self.tool_stream.feed(event.text))

    def finished(self, event: FinishedEvent) -> list[bytes]:
        rest, calls = self.tool_stream.finish()
        pieces = [*self.text_delta(rest), self.event({"type": "content_block_stop", "index": 0})]
        # Each call is one tool_use block after the text, its input sent whole.
        for index, call in enumerate(calls, 1):
            block = {**_tool_use(call), "input": {}}
            json_delta = {"type": "input_json_delta", "partial_json": call.arguments}
            pieces += [
                self.event({"type": "content_block_start", "index": index, "content_block": block}),
                self.event({"type": "content_block_delta", "index": index, "delta": json_delta}),
                self.event({"type": "content_block_stop", "index": index}),
            ]
        delta = {"stop_reason": _stop_reason(event, calls), "stop_sequence": event.stop_string}
        return [
            *pieces,
            self.event({"type": "message_delta", "delta": delta, "usage": _usage(event)}),
            self.event({"type": "message_stop"}),
        ]

    def failed(self, error: APIError) -> list[bytes]:
        return [sse(error_body(error), event="error")]

    def absorb(self, event: TokenEvent) -> None:
        self.text.append(self.tool_stream.feed(event.text))

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        rest, calls = self.tool_stream.finish()
        text = "".join(self.text) + rest
        content = [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(call) for call in calls]
        out = self.message(content, _usage(finished))
        out.update(stop_reason=_stop_reason(finished, calls), stop_sequence=finished.stop_string)
        return out


def _tool_use(call: ToolCall) -> dict[str, Any]:
    tool_id = f"toolu_{call.id.removeprefix('call_')}"
    return {
        "type": "tool_use",
        "id": tool_id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


# -- endpoint -------------------------------------------------------------------------------


async def messages(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    protocol.check_model(body.get("model"), state.settings.served_model_name)
    engine, parser = state.engine, state.settings.tool_call_parser
    reader = state.settings.image_reader
    parse = partial(parse_messages, body, engine.admission, engine.grammars, reader, parser)
    return await generate(state, FIELD_NAMES, parse, partial(_MessageRenderer, state))


def _count(body: dict[str, Any], admission: Admission, reader: ImageReader) -> int:
    ids, images = prompt_ids_of(body, admission, reader, tool_request(body))
    return len(admission.expand_images(ids, images))


async def count_tokens(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    protocol.check_model(body.get("model"), state.settings.served_model_name)
    count = partial(_count, body, state.engine.admission, state.settings.image_reader)
    return JSONResponse({"input_tokens": await parse_off_loop(FIELD_NAMES, count)})


ROUTES = [
    ("POST", "/v1/messages", messages),
    ("POST", "/v1/messages/count_tokens", count_tokens),
]
