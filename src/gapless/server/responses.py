"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

`input` (a string, or message, function_call and function_call_output items) and
`instructions` become the chat-template conversation, after a stored response's conversation
when `previous_response_id` names one; function `tools` and `text.format` take the chat
endpoint's paths (tool_calls.py, the output grammar). Engine events become one response
object, or its typed SSE events in the documented order, each with a `sequence_number`. A
response is stored (`store`, default true, as OpenAI) in the server's bounded ResponseStore
(response_store.py). Errors are OpenAI's shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.server import protocol, tool_calls
from gapless.server.endpoint import ServerState, generate, read_json
from gapless.server.openai_chat import chat_logprobs
from gapless.server.openai_common import check_model, named_class
from gapless.server.protocol import (
    APIError,
    bool_field,
    dict_field,
    int_field,
    invalid,
    list_field,
    str_field,
)
from gapless.server.response_store import StoredResponse
from gapless.server.streaming import Renderer, progress_comment, sse
from gapless.server.structured_output import text_format_grammar
from gapless.server.tool_calls import ToolCall, ToolRequest

# A response's id is this and the request's id.
ID_PREFIX = "resp_"
# The request's names for the engine's fields.
FIELD_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}
_ROLES = ("user", "system", "developer", "assistant")
# What `include` names to have the output text's logprobs (top_logprobs says how many more).
LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text")


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedResponse:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    store: bool
    # The conversation's input items, a previous response's included, in the shape _item
    # gives them: what a stored response keeps, before its output.
    items: list[dict[str, Any]]
    settings: dict[str, Any]  # the request's settings, which the response object repeats
    tools: ToolRequest | None = None
    tool_parser: str | None = None  # how calls are read out of the output, if not forced


def _text(content: Any, param: str) -> str:
    """A message's content, or a call's output: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(
                f"unsupported content part {kind!r}; input_text and output_text parts with a "
                "string `text` are supported",
                f"{param}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{name} must be a non-empty string", f"{param}.{name}")
    return value


def _item(item: Any, param: str) -> dict[str, Any]:
    """One input item, checked, in the one shape the conversation is built from."""
    if not isinstance(item, dict):
        raise invalid("each input item must be an object", param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid(
                f"unknown role {role!r}; expected one of {', '.join(_ROLES)}", f"{param}.role"
            )
        content = _text(item.get("content"), f"{param}.content")
        return {"type": "message", "role": role, "content": content}
    if kind == "function_call":
        arguments = item.get("arguments")
        try:
            valid = isinstance(json.loads(arguments), dict)
        except (TypeError, json.JSONDecodeError):
            valid = False
        if not valid:
            raise invalid("arguments must be a JSON object, as a string", f"{param}.arguments")
        return {
            "type": "function_call",
            "call_id": _string(item, "call_id", param),
            "name": _string(item, "name", param),
            "arguments": arguments,
        }
    if kind == "function_call_output":
        output = _text(item.get("output"), f"{param}.output")
        return {
            "type": "function_call_output",
            "call_id": _string(item, "call_id", param),
            "output": output,
        }
    raise invalid(
        f"unsupported input item type {kind!r}; message, function_call and "
        "function_call_output items are supported",
        f"{param}.type",
    )


def _input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("input")
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of input items", "input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _conversation(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked items as the messages transformers' apply_chat_template takes: a call joins
    the assistant turn before it (its text, or the calls before it), a call's output is a
    `tool` message."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for item in items:
        if item["type"] == "message":
            # `developer` is OpenAI's newer name for `system`; templates know only the latter.
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            names[item["call_id"]] = item["name"]
            function = {"name": item["name"], "arguments": json.loads(item["arguments"])}
            call = {"id": item["call_id"], "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], ToolRequest | None]:
    """The function tools as given (flat, as the Responses API has them), and as the chat
    endpoint's ToolRequest."""
    tools = list_field(body, "tools") or []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"only function tools are supported, not {kind!r}", f"tools[{i}].type")
        tool_calls.check_function(tool, f"tools[{i}]")
        if not isinstance(tool.get("strict", False), bool | None):
            raise invalid("strict must be a boolean", f"tools[{i}].strict")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid(
                'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    functions = [
        {
            "type": "function",
            "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool},
        }
        for tool in tools
    ]
    chat_shaped = {
        "tools": functions if "tools" in body else None,
        "tool_choice": choice,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }
    return tools, tool_calls.parse_tools(chat_shaped)


def parse_request(
    body: dict[str, Any],
    admission: Admission,
    grammars: GrammarCompiler,
    configured_parser: str | None,
    previous: StoredResponse | None,
) -> ParsedResponse:
    if bool_field(body, "background"):
        raise invalid("background responses are not supported", "background")
    if body.get("conversation") is not None:
        raise invalid(
            "conversations are not supported; continue one with previous_response_id",
            "conversation",
        )
    earlier = [] if previous is None else previous.conversation
    items = [_item(item, "previous_response_id") for item in earlier] + _input_items(body)
    instructions = str_field(body, "instructions")
    # As OpenAI: a previous response's instructions are not carried over.
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _conversation(items)
    flat_tools, tools = _tools(body)
    offered = tools.tools if tools is not None and tools.tools else None
    prompt_ids = admission.check_prompt(admission.encode_chat(messages, tools=offered))

    limit = int_field(body, "max_output_tokens")
    fields = protocol.number_fields(
        body, floats={"temperature": "temperature", "top_p": "top_p"}, ints={}
    )
    fields["max_tokens"] = admission.output_budget(limit, len(prompt_ids), least=1)
    fields["speculate"] = protocol.bool_field(body, "speculate") is not False
    text = dict_field(body, "text") or {}
    text_format = text.get("format") or {"type": "text"}
    fields["grammar"] = text_format_grammar(text_format, grammars)
    chat_template = admission.tokenizer.chat_template
    parser = tool_calls.apply_tools(tools, fields, grammars, chat_template, configured_parser)
    top = int_field(body, "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
    fields["logprobs"] = (top or 0) if LOGPROBS in (list_field(body, "include") or []) else None
    stream = bool(bool_field(body, "stream"))
    fields["service_class"] = protocol.service_class(body, stream, named=named_class(body))
    params = SamplingParams(**fields)
    store = bool_field(body, "store") is not False
    settings = {
        "instructions": instructions,
        "max_output_tokens": limit,
        "metadata": dict_field(body, "metadata") or {},
        "parallel_tool_calls": tools.parallel if tools is not None else True,
        "previous_response_id": None if previous is None else previous.response["id"],
        "store": store,
        "temperature": params.temperature,
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": flat_tools,
        "top_logprobs": top,
        "top_p": params.top_p,
        "truncation": "disabled",
    }
    return ParsedResponse(prompt_ids, params, stream, store, items, settings, tools, parser)


# -- rendering engine events ---------------------------------------------------------------


def _status(finished: FinishedEvent) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details; a cancelled request is incomplete with
    reason "cancelled", gapless's addition to OpenAI's reasons."""
    if finished.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finished.finish_reason == "cancelled":
        return "incomplete", {"reason": "cancelled"}
    return "completed", None


def _usage(finished: FinishedEvent) -> dict[str, Any]:
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_prompt_tokens},
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _function_call(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{call.id.removeprefix('call_')}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


class _ResponseRenderer(Renderer):
    def __init__(self, state: ServerState, parsed: ParsedResponse, request_id: str) -> None:
        super().__init__()
        self.state = state
        self.parsed = parsed
        self.id = f"{ID_PREFIX}{request_id}"
        self.model = state.settings.served_model_name
        self.created_at = protocol.now()
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence_number = 0
        self.message_open = False  # streaming: its output_item.added has been sent
        self.tokenizer = state.engine.tokenizer
        self.logprobs: list[dict[str, Any]] = []  # of every token so far, if requested
        self.logprobs_sent = 0  # streaming: how many of them deltas carried
        # feed(): the text that is content (a call's is held back); finish(): held text
        # that was not a call after all, and the calls.
        self.tool_stream = tool_calls.output_stream(parsed.tools, parsed.tool_parser)

    def envelope(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "usage": None,
            **self.parsed.settings,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_output_text(text, self.logprobs)] if status != "in_progress" else [],
        }

    def take_logprobs(self, event: TokenEvent) -> None:
        """The event's tokens' logprobs, as the chat endpoint gives them, if requested."""
        if self.parsed.params.logprobs is not None:
            self.logprobs += chat_logprobs(self.tokenizer, event.logprobs or [])["content"]

    def whole(self, finished: FinishedEvent, text: str, calls: list[ToolCall]) -> dict[str, Any]:
        """The finished response, stored if the request asked for that."""
        status, incomplete = _status(finished)
        output = [self.message(text, status)] if text or not calls else []
        output += [_function_call(call) for call in calls]
        out = self.envelope(status, output)
        out.update(incomplete_details=incomplete, usage=_usage(finished))
        if status == "completed":
            out["completed_at"] = protocol.now()
        if self.parsed.store:
            self.state.responses.put(out, self.parsed.items)
        return out

    # Streaming.
    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(data, event=kind)

    def opening(self) -> list[bytes]:
        response = self.envelope("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return [progress_comment(event)]

    def open_message(self) -> list[bytes]:
        """The message's output item and its one output_text part, empty, once."""
        if self.message_open:
            return []
        self.message_open = True
        return [
            self.event(
                "response.output_item.added", output_index=0, item=self.message("", "in_progress")
            ),
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=_output_text(""),
            ),
        ]

    def text_delta(self, text: str) -> list[bytes]:
        """The text as a delta of the message, which opens with the first text."""
        if not text:  # text held back (half a character, a possible stop string, a call)
            return []
        self.text.append(text)
        opened = self.open_message()  # first: the events are numbered as they are made
        # Held text's tokens' logprobs come with the delta that brings its text.
        logprobs = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        delta = self.event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )
        return [*opened, delta]

    def token(self, event: TokenEvent) -> list[bytes]:
        self.take_logprobs(event)
        return self.text_delta(self.tool_stream.feed(event.text))

    def finished(self, event: FinishedEvent) -> list[bytes]:
        rest, calls = self.tool_stream.finish()
        pieces = self.text_delta(rest)
        text = "".join(self.text)
        response = self.whole(event, text, calls)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        if text or not calls:  # the message, empty if there was no text at all
            message = response["output"][0]
            pieces += [
                *self.open_message(),
                self.event("response.output_text.done", **where, text=text, logprobs=self.logprobs),
                self.event("response.content_part.done", **where, part=message["content"][0]),
                self.event("response.output_item.done", output_index=0, item=message),
            ]
        first = 1 if text or not calls else 0
        for index, call in enumerate(calls, first):
            item = _function_call(call)
            at = {"item_id": item["id"], "output_index": index}
            pieces += [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item=_function_call(call, "in_progress"),
                ),
                self.event("response.function_call_arguments.delta", **at, delta=call.arguments),
                self.event("response.function_call_arguments.done", **at, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*pieces, self.event(kind, response=response)]

    def failed(self, error: APIError) -> list[bytes]:
        response = self.envelope("failed", [])
        response["error"] = {"code": "server_error", "message": error.message}
        return [self.event("response.failed", response=response)]

    # Not streaming.
    def absorb(self, event: TokenEvent) -> None:
        self.take_logprobs(event)
        self.text.append(self.tool_stream.feed(event.text))

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        rest, calls = self.tool_stream.finish()
        return self.whole(finished, "".join(self.text) + rest, calls)


# -- endpoints ------------------------------------------------------------------------------


def _not_found(response_id: str, param: str | None = None) -> APIError:
    code = "previous_response_not_found" if param else "response_not_found"
    kind = "invalid_request_error" if param else "not_found_error"
    return APIError(
        404,
        f"no stored response {response_id!r}: it was not stored, or was deleted or evicted",
        kind,
        param,
        code,
    )


async def create(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    previous = None
    previous_id = str_field(body, "previous_response_id")
    if previous_id is not None:
        previous = state.responses.get(previous_id)
        if previous is None:
            raise _not_found(previous_id, "previous_response_id")
    engine, parser = state.engine, state.settings.tool_call_parser
    parse = partial(parse_request, body, engine.admission, engine.grammars, parser, previous)
    return await generate(state, FIELD_NAMES, parse, partial(_ResponseRenderer, state))


async def retrieve(state: ServerState, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


async def delete(state: ServerState, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


ROUTES = [
    ("POST", "/v1/responses", create),
    ("GET", "/v1/responses/{response_id}", retrieve),
    ("DELETE", "/v1/responses/{response_id}", delete),
]
