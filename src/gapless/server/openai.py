"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models, /v1/cancel.

Requests become prompt ids and SamplingParams; engine events become OpenAI chunks (SSE ending
in `data: [DONE]`) or one response object; errors are {"error": {message, type, param, code}}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.model.tokenizer import Tokenizer
from gapless.server import protocol
from gapless.server.endpoint import (
    Renderer,
    ServerState,
    generate,
    new_request_id,
    progress_comment,
    read_json,
    sse,
)
from gapless.server.protocol import (
    APIError,
    bool_field,
    int_field,
    int_list_field,
    invalid,
    is_int,
    stop_field,
    str_field,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI reports an impossible logprob as -9999.0; JSON has no -Infinity.
_MIN_LOGPROB = -9999.0


def error_body(error: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A validated request, ready for the engine."""

    model: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    # completions: echo the prompt text (and its logprobs when logprobs is set)
    echo: bool = False
    prompt_text: str = ""
    # chat: logprobs requested; completions: the `logprobs` integer
    logprobs: int | None = None


def _common(
    body: dict[str, Any], prompt_len: int, prompt_param: str, max_model_len: int
) -> tuple[dict[str, Any], bool, bool]:
    """SamplingParams fields shared by both endpoints, plus (stream, include_usage)."""
    n = int_field(body, "n")
    if n is not None and n > 1:
        raise invalid("n > 1 is not supported", "n")
    if n is not None and n < 1:
        raise invalid(f"n must be 1, got {n}", "n")
    best_of = int_field(body, "best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of > 1 is not supported", "best_of")

    # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
    limit_param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = protocol.max_tokens(
        int_field(body, limit_param), limit_param, prompt_len, prompt_param, max_model_len
    )
    fields = protocol.number_fields(
        body,
        floats={
            name: name
            for name in (
                "temperature",
                "top_p",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
        },
        ints={"top_k": "top_k", "min_tokens": "min_tokens"},
    )
    fields.update(max_tokens=max_tokens, seed=int_field(body, "seed"), stop=stop_field(body))
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        value = bool_field(body, name)
        if value is not None:
            fields[name] = value
    fields["stop_token_ids"] = int_list_field(body, "stop_token_ids")

    stream = bool(bool_field(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = bool(bool_field(options, "include_usage"))
    return fields, stream, include_usage


def _message_content(content: Any, index: int) -> str | None:
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid("only text content parts are supported", param)
            if not isinstance(part.get("text"), str):
                raise invalid("a text content part needs a string `text`", param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid("content must be a string or a list of content parts", param)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid("each message must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}",
                f"messages[{i}].role",
            )
        content = _message_content(message.get("content"), i)
        if content is None and role != "assistant":
            raise invalid(f"a {role} message needs content", f"messages[{i}].content")
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        converted = {**message, "role": "system" if role == "developer" else role}
        converted["content"] = content
        out.append(converted)
    return out


def _chat_prompt(body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    messages = _messages(body)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    if "messages" in template_kwargs:
        raise invalid(
            "chat_template_kwargs cannot set `messages`; send them as `messages`",
            "chat_template_kwargs",
        )
    return protocol.encode_chat(tokenizer, messages, max_model_len, "messages", template_kwargs)


def parse_chat(body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> ParsedRequest:
    prompt_ids = _chat_prompt(body, tokenizer, max_model_len)
    fields, stream, include_usage = _common(body, len(prompt_ids), "messages", max_model_len)
    want_logprobs = bool(bool_field(body, "logprobs"))
    top = int_field(body, "top_logprobs")
    if top and not want_logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    fields["logprobs"] = logprobs
    params = protocol.sampling_params(fields, {"logprobs": "top_logprobs"})
    return ParsedRequest(
        str_field(body, "model"), prompt_ids, params, stream, include_usage, logprobs=logprobs
    )


def _prompt(
    body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int
) -> tuple[list[int], str]:
    """The prompt's ids and text; a batch of one prompt counts as that prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(is_int(t) for t in prompt):
        if len(prompt) > 1:
            raise invalid(
                f"batched prompts ({len(prompt)} prompts) are not supported; send one request "
                "per prompt",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return protocol.encode_prompt(tokenizer, prompt, max_model_len, "prompt"), prompt
    if isinstance(prompt, list) and all(is_int(t) for t in prompt):
        ids = _token_ids(prompt, tokenizer, "prompt")
        # As a string prompt echoes its special tokens, so does a token-id prompt.
        return ids, tokenizer.decode(ids, skip_special_tokens=False)
    raise invalid(
        "prompt must be a string, a list of token ids, or a list of one of those", "prompt"
    )


def _token_ids(ids: list[int], tokenizer: Tokenizer, param: str) -> list[int]:
    if not ids:
        raise invalid("the prompt is empty", param)
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"{param} token id {bad} is outside the vocabulary [0, {vocab})", param)
    return list(ids)


def parse_completion(
    body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int
) -> ParsedRequest:
    prompt_ids, prompt_text = _prompt(body, tokenizer, max_model_len)
    fields, stream, include_usage = _common(body, len(prompt_ids), "prompt", max_model_len)
    echo = bool(bool_field(body, "echo"))
    logprobs = int_field(body, "logprobs")
    if echo and logprobs is not None and stream:
        raise invalid("echo with logprobs is supported only without streaming", "echo")
    fields["logprobs"] = logprobs
    if echo and logprobs is not None:
        fields["prompt_logprobs"] = logprobs
    params = protocol.sampling_params(fields)
    return ParsedRequest(
        str_field(body, "model"),
        prompt_ids,
        params,
        stream,
        include_usage,
        echo,
        prompt_text,
        logprobs,
    )


def check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    name = state.settings.served_model_name
    # A missing model is allowed: one model is served, so there is nothing to choose.
    if model is None or model == name:
        return
    if not isinstance(model, str):
        raise invalid("model must be a string", "model")
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {name!r}",
        "not_found_error",
        "model",
        "model_not_found",
    )


# -- response shapes -----------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: {"content": [...]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {
            "token": text,
            "logprob": _lp(logprob),
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    content = []
    for token_id, logprob, alternatives in entries:
        entry = item(token_id, logprob)
        entry["top_logprobs"] = [item(i, lp) for i, lp in alternatives]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob | None], prompt_ids: list[int], offset: int
) -> dict[str, Any]:
    """Legacy completions logprobs; a None entry (the first prompt token) has no logprob.

    text_offset counts characters of the `tokens` strings, starting at `offset`.
    """
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for index, entry in enumerate(entries):
        if entry is None:
            token_id, logprob, top = prompt_ids[index], None, None
        else:
            token_id, logprob, alternatives = entry
            logprob = _lp(logprob)
            top = {tokenizer.token_text(i): _lp(lp) for i, lp in alternatives}
        text = tokenizer.token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# -- rendering engine events ---------------------------------------------------------------


class _OpenAIRenderer(Renderer):
    """One request's engine events as OpenAI chunks (streaming) or one response object."""

    id_prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        super().__init__()
        self.tokenizer = state.engine.tokenizer
        self.model = state.settings.served_model_name
        self.parsed = parsed
        self.id = f"{self.id_prefix}-{request_id}"
        self.created = protocol.now()
        self.logprobs: list = []

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error_body(error)

    def envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any]) -> bytes:
        out = self.envelope([choice], self.chunk_object)
        if self.parsed.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last has usage null
        return sse(out)

    def usage(self, finished: FinishedEvent) -> dict[str, Any]:
        return usage(
            finished.prompt_tokens, finished.completion_tokens, finished.cached_prompt_tokens
        )

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return [progress_comment(event)]

    def token(self, event: TokenEvent) -> list[bytes]:
        return [self.chunk(self.token_choice(event))]

    def finished(self, event: FinishedEvent) -> list[bytes]:
        pieces = [self.chunk(self.final_choice(event))]
        if self.parsed.include_usage:
            out = self.envelope([], self.chunk_object)
            out["usage"] = self.usage(event)
            pieces.append(sse(out))
        return [*pieces, sse("[DONE]")]

    def failed(self, error: APIError) -> list[bytes]:
        return [sse(error_body(error)), sse("[DONE]")]

    def absorb(self, event: TokenEvent) -> None:
        super().absorb(event)
        self.logprobs += event.logprobs or []

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        raise NotImplementedError


class _ChatRenderer(_OpenAIRenderer):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, entries)

    def opening(self) -> list[bytes]:
        delta = {"role": "assistant", "content": ""}
        return [self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {"content": event.text},
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": finished.finish_reason,
        }

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(self.text)}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(self.logprobs),
            "finish_reason": finished.finish_reason,
        }
        out = self.envelope([choice], self.object_name)
        out["usage"] = self.usage(finished)
        return out


class _CompletionRenderer(_OpenAIRenderer):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        super().__init__(state, parsed, request_id)
        # Generated tokens' text_offset points into prompt + completion text.
        self.offset = len(parsed.prompt_text)

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        out = completion_logprobs(self.tokenizer, entries, [], self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def opening(self) -> list[bytes]:
        if not self.parsed.echo:
            return []
        choice = {"index": 0, "text": self.parsed.prompt_text, "logprobs": None}
        return [self.chunk({**choice, "finish_reason": None})]

    def token_choice(self, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "text": event.text,
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def final_choice(self, finished: FinishedEvent) -> dict[str, Any]:
        return {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": finished.finish_reason,
        }

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        p = self.parsed
        text = "".join(self.text)
        logprobs = None
        if p.logprobs is not None and p.echo:
            prompt = completion_logprobs(
                self.tokenizer, finished.prompt_logprobs or [], p.prompt_ids, 0
            )
            # Offsets then count the `tokens` strings throughout, special tokens included.
            self.offset = sum(len(t) for t in prompt["tokens"])
            generated = self._logprobs(self.logprobs)
            logprobs = {k: prompt[k] + generated[k] for k in prompt}
        elif p.logprobs is not None:
            logprobs = self._logprobs(self.logprobs)
        if p.echo:
            text = p.prompt_text + text
        choice = {"index": 0, "text": text, "logprobs": logprobs}
        out = self.envelope(
            [{**choice, "finish_reason": finished.finish_reason}], "text_completion"
        )
        out["usage"] = self.usage(finished)
        return out


# -- endpoints ------------------------------------------------------------------------------


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    parse = parse_chat if chat else parse_completion
    # Chat templating and tokenizing a long prompt take a while: keep the event loop free.
    parsed = await anyio.to_thread.run_sync(
        parse, body, state.engine.tokenizer, state.engine.max_model_len
    )
    request_id = new_request_id()
    renderer = (_ChatRenderer if chat else _CompletionRenderer)(state, parsed, request_id)
    return generate(
        state,
        parsed.prompt_ids,
        parsed.params,
        renderer,
        parsed.stream,
        request_id,
        "messages" if chat else "prompt",
    )


async def chat_completions(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=True)


async def completions(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=False)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "gapless",
        "max_model_len": state.engine.max_model_len,
    }


async def list_models(state: ServerState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(state: ServerState, request: Request) -> Response:
    check_model(state, {"model": request.path_params["model"]})
    return JSONResponse(_model_card(state))


async def cancel(state: ServerState, request: Request) -> Response:
    request_id = request.path_params["request_id"]
    for prefix in ("chatcmpl-", "cmpl-"):
        request_id = request_id.removeprefix(prefix)
    if not state.async_engine.cancel(request_id):
        raise APIError(
            404,
            f"no live request {request_id!r}",
            "not_found_error",
            "request_id",
            "request_not_found",
        )
    return JSONResponse({"id": request_id, "object": "cancellation", "cancelled": True})


ROUTES = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/cancel/{request_id}", cancel),
]
