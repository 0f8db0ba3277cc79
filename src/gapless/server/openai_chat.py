"""OpenAI's /v1/chat/completions: messages (and tools) through the chat template, engine events
as chat.completion chunks or one chat.completion, tool calls read out of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gapless.engine.admission import Admission, CheckedImages
from gapless.engine.events import TokenEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.model.tokenizer import Tokenizer
from gapless.server import protocol, tool_calls
from gapless.server.endpoint import (
    EngineResponse,
    FieldNames,
    ServerState,
    generate,
    read_json,
)
from gapless.server.images import (
    ImageReader,
    MessageContent,
    SentImage,
    check_images,
    check_user_images,
)
from gapless.server.openai_common import (
    Choice,
    OpenAIRenderer,
    ParsedRequest,
    check_model,
    logprob,
    max_tokens_name,
    sampling_fields,
)
from gapless.server.protocol import bool_field, int_field, invalid, str_field
from gapless.server.tool_calls import ToolCallStream, ToolRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# A chat completion's id is this and the request's id.
ID_PREFIX = "chatcmpl-"


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedChat(ParsedRequest):
    # the tools offered, and the parser that reads calls out of the output
    tools: ToolRequest | None = None
    tool_parser: str | None = None


def field_names(body: dict[str, Any]) -> FieldNames:
    """The request's names for the engine's fields."""
    return {
        "prompt": "messages",
        "images": "messages",  # the placeholders' count, in the rendered messages
        "max_tokens": max_tokens_name(body),
        "logprobs": "top_logprobs",
    }


def _content(content: Any, param: str, reader: ImageReader) -> MessageContent:
    """A message's content: a string, or text and image_url parts."""
    out = MessageContent()
    if content is None or isinstance(content, str):
        out.text(content or "")
        return out
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content parts", param)
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.text(part["text"])
        elif kind == "image_url":
            image = part.get("image_url")
            # {"url": ...} as OpenAI documents it; a bare string as some clients send it.
            url = image.get("url") if isinstance(image, dict) else image
            out.image(reader.url(url, f"{where}.image_url.url"), where)
        elif kind == "text":
            raise invalid("a text content part needs a string `text`", where)
        else:
            raise invalid(f"unsupported content part {kind!r}; text and image_url parts are", where)
    return out


def _messages(
    body: dict[str, Any], reader: ImageReader
) -> tuple[list[dict[str, Any]], list[SentImage]]:
    """The messages as the chat template takes them, and their images in order."""
    out, images = [], []
    for i, message in enumerate(protocol.chat_messages(body, CHAT_ROLES)):
        role = message["role"]
        param = f"messages[{i}].content"
        if message.get("content") is None and role != "assistant":
            raise invalid(f"a {role} message needs content", param)
        content = _content(message.get("content"), param, reader)
        check_user_images(role, content.images, param)
        images += content.images
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        converted = {**message, "role": "system" if role == "developer" else role}
        converted["content"] = (
            None if message.get("content") is None else content.template_content()
        )
        out.append(protocol.template_message(converted, f"messages[{i}]"))
    return out, images


def chat_prompt(
    body: dict[str, Any],
    admission: Admission,
    reader: ImageReader,
    tools: ToolRequest | None = None,
    add_generation_prompt: bool = True,
) -> tuple[list[int], CheckedImages]:
    """The ids of the request's messages through the chat template, not yet checked as a
    prompt (/tokenize counts them whatever their length), and their images, checked (each
    has one placeholder in the ids)."""
    messages, sent = _messages(body, reader)
    images = check_images(admission, sent)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    if "messages" in template_kwargs:
        raise invalid(
            "chat_template_kwargs cannot set `messages`; send them as `messages`",
            "chat_template_kwargs",
        )
    if tools is not None and tools.tools:
        # As transformers' apply_chat_template(tools=...) passes them.
        template_kwargs = {**template_kwargs, "tools": tools.tools}
    effort = str_field(body, "reasoning_effort")
    if effort is not None:
        # The variable gpt-oss's harmony template reads, as vLLM passes it; a template
        # without it renders as it always does.
        template_kwargs = {**template_kwargs, "reasoning_effort": effort}
    template_kwargs = {**template_kwargs, "add_generation_prompt": add_generation_prompt}
    return admission.encode_chat(messages, **template_kwargs), images


def parse_chat(
    body: dict[str, Any],
    admission: Admission,
    grammars: GrammarCompiler,
    reader: ImageReader,
    tool_parser: str | None = None,
) -> ParsedChat:
    tools = tool_calls.parse_tools(body)
    ids, images = chat_prompt(body, admission, reader, tools)
    prompt_ids = admission.check_prompt(ids, images=images)
    fields, stream, include_usage = sampling_fields(body, admission, len(prompt_ids), grammars)
    chat_template = admission.tokenizer.chat_template
    parser = tool_calls.apply_tools(tools, fields, grammars, chat_template, tool_parser)
    want_logprobs = bool(bool_field(body, "logprobs"))
    top = int_field(body, "top_logprobs")
    if top and not want_logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    fields["logprobs"] = logprobs
    return ParsedChat(
        str_field(body, "model"),
        prompt_ids,
        SamplingParams(**fields),
        stream,
        include_usage,
        logprobs,
        tools,
        parser,
    )


# -- rendering engine events ---------------------------------------------------------------


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: {"content": [...]}."""

    def item(token_id: int, value: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {
            "token": text,
            "logprob": logprob(value),
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    content = []
    for token_id, value, alternatives in entries:
        entry = item(token_id, value)
        entry["top_logprobs"] = [item(i, lp) for i, lp in alternatives]
        content.append(entry)
    return {"content": content}


class _ChatRenderer(OpenAIRenderer):
    id_prefix = ID_PREFIX
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, parsed: ParsedChat, request_id: str) -> None:
        super().__init__(state, parsed, request_id)
        tools = parsed.tools
        if tools is not None and (tools.forced or parsed.tool_parser):
            for choice in self.choices:
                choice.tool_stream = ToolCallStream(
                    parsed.tool_parser, tools.forced, tools.parallel
                )

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, entries)

    def opening(self) -> list[bytes]:
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            for c in self.choices
        ]

    def token_choice(self, choice: Choice, event: TokenEvent) -> dict[str, Any]:
        text = event.text
        if choice.tool_stream is not None:
            text = choice.tool_stream.feed(text)  # a call's text is held back, never content
        return {
            "index": choice.index,
            "delta": {"content": text},
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def _settle(self, choice: Choice) -> str:
        """At the choice's end: its tool calls, and the held text that was not one."""
        if choice.tool_stream is None:
            return ""
        rest, choice.calls = choice.tool_stream.finish()
        return rest

    def final_choices(self, choice: Choice) -> list[dict[str, Any]]:
        rest = self._settle(choice)
        deltas = []
        if rest:
            deltas.append({"content": rest})
        if choice.calls:
            deltas.append({"tool_calls": [c.to_dict(i) for i, c in enumerate(choice.calls)]})
        out = [
            {"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        last = {"index": choice.index, "delta": {}, "logprobs": None}
        return [*out, {**last, "finish_reason": self.finish_reason(choice)}]

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        if choice.tool_stream is not None:
            text = choice.tool_stream.feed(text) + self._settle(choice)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.calls:
            message["content"] = text or None
            message["tool_calls"] = [c.to_dict() for c in choice.calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": self.finish_reason(choice),
        }


# -- endpoint -------------------------------------------------------------------------------


async def chat_completions(state: ServerState, request: Request) -> Response:
    return await respond(state, await read_json(state, request))


async def respond(state: ServerState, body: dict[str, Any]) -> EngineResponse:
    """The response to a chat completion request's body: the endpoint's, or a batch job
    line's (batch_jobs.py)."""
    check_model(state, body, adapters=True)
    engine, parser = state.engine, state.settings.tool_call_parser
    reader = state.settings.image_reader
    parse = partial(parse_chat, body, engine.admission, engine.grammars, reader, parser)
    return await generate(state, field_names(body), parse, partial(_ChatRenderer, state))


ROUTES = [("POST", "/v1/chat/completions", chat_completions)]
