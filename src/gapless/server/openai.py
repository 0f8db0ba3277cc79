"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models, /v1/cancel, and
vLLM's /tokenize and /detokenize.

Requests become prompt ids and SamplingParams; engine events become OpenAI chunks (SSE ending
in `data: [DONE]`) or one response object; errors are {"error": {message, type, param, code}}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.model.tokenizer import Tokenizer
from gapless.server import protocol, tool_calls
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
from gapless.server.structured_output import checked_schema_grammar, output_grammar
from gapless.server.tool_calls import ToolCallStream, ToolRequest

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
    # chat: the tools offered, and the parser that reads calls out of the output
    tools: ToolRequest | None = None
    tool_parser: str | None = None


def _common(
    body: dict[str, Any],
    prompt_len: int,
    prompt_param: str,
    max_model_len: int,
    grammars: GrammarCompiler,
) -> tuple[dict[str, Any], bool, bool]:
    """SamplingParams fields shared by both endpoints, plus (stream, include_usage)."""
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
        ints={"top_k": "top_k", "min_tokens": "min_tokens", "n": "n"},
    )
    fields["grammar"] = output_grammar(body, grammars)
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


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(protocol.chat_messages(body, CHAT_ROLES)):
        role = message["role"]
        content = protocol.text_content(message.get("content"), f"messages[{i}].content")
        if content is None and role != "assistant":
            raise invalid(f"a {role} message needs content", f"messages[{i}].content")
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        converted = {**message, "role": "system" if role == "developer" else role}
        converted["content"] = content
        out.append(protocol.template_message(converted, f"messages[{i}]"))
    return out


def _chat_prompt(
    body: dict[str, Any],
    tokenizer: Tokenizer,
    max_model_len: int,
    tools: ToolRequest | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    messages = _messages(body)
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
    template_kwargs = {**template_kwargs, "add_generation_prompt": add_generation_prompt}
    return protocol.encode_chat(tokenizer, messages, max_model_len, "messages", template_kwargs)


def parse_chat(
    body: dict[str, Any],
    tokenizer: Tokenizer,
    max_model_len: int,
    grammars: GrammarCompiler,
    tool_parser: str | None = None,
) -> ParsedRequest:
    tools = tool_calls.parse_tools(body)
    prompt_ids = _chat_prompt(body, tokenizer, max_model_len, tools)
    fields, stream, include_usage = _common(
        body, len(prompt_ids), "messages", max_model_len, grammars
    )
    parser = None
    if tools is not None and tools.forced:
        if fields["grammar"] is not None:
            raise invalid(
                "a forced tool_choice cannot be combined with an output format", "tool_choice"
            )
        schema = tool_calls.forced_calls_schema(tools)
        fields["grammar"] = checked_schema_grammar(schema, grammars, "tools")
    elif tools is not None and tools.tools:
        parser = tool_calls.choose_parser(tokenizer.chat_template, tool_parser)
        # Tool-call markers such as [TOOL_CALLS] are often special tokens: keep their text.
        fields.setdefault("skip_special_tokens", False)
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
        str_field(body, "model"),
        prompt_ids,
        params,
        stream,
        include_usage,
        logprobs=logprobs,
        tools=tools,
        tool_parser=parser,
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
        if not prompt:
            raise invalid("the prompt is empty", "prompt")
        ids = _check_vocab(prompt, tokenizer, "prompt")
        # As a string prompt echoes its special tokens, so does a token-id prompt.
        return ids, tokenizer.decode(ids, skip_special_tokens=False)
    raise invalid(
        "prompt must be a string, a list of token ids, or a list of one of those", "prompt"
    )


def _check_vocab(ids: list[int], tokenizer: Tokenizer, param: str) -> list[int]:
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"{param} token id {bad} is outside the vocabulary [0, {vocab})", param)
    return list(ids)


def parse_completion(
    body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int, grammars: GrammarCompiler
) -> ParsedRequest:
    prompt_ids, prompt_text = _prompt(body, tokenizer, max_model_len)
    fields, stream, include_usage = _common(
        body, len(prompt_ids), "prompt", max_model_len, grammars
    )
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
    protocol.check_model(body.get("model"), state.settings.served_model_name)


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


@dataclass
class _Choice:
    """One of the request's n choices as it streams."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: FinishedEvent | None = None
    tool_stream: ToolCallStream | None = None
    calls: list = field(default_factory=list)  # the tool calls found in its output
    offset: int = 0  # completions: text_offset of its next token


class _OpenAIRenderer(Renderer):
    """One request's engine events as OpenAI chunks (streaming) or one response object.

    A request for n choices streams their chunks interleaved as their tokens come, each
    marked with its choice's index; usage and [DONE] follow the last choice's finish."""

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
        self.choices = [_Choice(i) for i in range(parsed.params.n)]

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

    def usage(self) -> dict[str, Any]:
        """The prompt counted once, and every choice's completion tokens."""
        finishes = [c.finished for c in self.choices if c.finished is not None]
        return usage(
            finishes[0].prompt_tokens,
            sum(f.completion_tokens for f in finishes),
            finishes[0].cached_prompt_tokens,
        )

    def finish_reason(self, choice: _Choice) -> str:
        assert choice.finished is not None
        reason = choice.finished.finish_reason
        return "tool_calls" if choice.calls and reason == "stop" else reason

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return [progress_comment(event)]

    def token(self, event: TokenEvent) -> list[bytes]:
        return [self.chunk(self.token_choice(self.choices[event.index], event))]

    def finished(self, event: FinishedEvent) -> list[bytes]:
        choice = self.choices[event.index]
        choice.finished = event
        pieces = [self.chunk(c) for c in self.final_choices(choice)]
        if any(c.finished is None for c in self.choices):
            return pieces
        if self.parsed.include_usage:
            out = self.envelope([], self.chunk_object)
            out["usage"] = self.usage()
            pieces.append(sse(out))
        return [*pieces, sse("[DONE]")]

    def failed(self, error: APIError) -> list[bytes]:
        return [sse(error_body(error)), sse("[DONE]")]

    def absorb(self, event: TokenEvent) -> None:
        choice = self.choices[event.index]
        choice.text.append(event.text)
        choice.logprobs += event.logprobs or []

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        for event in self.finishes:
            self.choices[event.index].finished = event
        out = self.envelope([self.whole_choice(c) for c in self.choices], self.object_name)
        out["usage"] = self.usage()
        return out

    def token_choice(self, choice: _Choice, event: TokenEvent) -> dict[str, Any]:
        raise NotImplementedError

    def final_choices(self, choice: _Choice) -> list[dict[str, Any]]:
        raise NotImplementedError

    def whole_choice(self, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class _ChatRenderer(_OpenAIRenderer):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
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

    def token_choice(self, choice: _Choice, event: TokenEvent) -> dict[str, Any]:
        text = event.text
        if choice.tool_stream is not None:
            text = choice.tool_stream.feed(text)  # a call's text is held back, never content
        return {
            "index": choice.index,
            "delta": {"content": text},
            "logprobs": self._logprobs(event.logprobs or []),
            "finish_reason": None,
        }

    def _settle(self, choice: _Choice) -> str:
        """At the choice's end: its tool calls, and the held text that was not one."""
        if choice.tool_stream is None:
            return ""
        rest, choice.calls = choice.tool_stream.finish()
        return rest

    def final_choices(self, choice: _Choice) -> list[dict[str, Any]]:
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

    def whole_choice(self, choice: _Choice) -> dict[str, Any]:
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


class _CompletionRenderer(_OpenAIRenderer):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        super().__init__(state, parsed, request_id)
        # Generated tokens' text_offset points into prompt + completion text.
        for choice in self.choices:
            choice.offset = len(parsed.prompt_text)

    def _logprobs(self, choice: _Choice, entries: list) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        out = completion_logprobs(self.tokenizer, entries, [], choice.offset)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out

    def opening(self) -> list[bytes]:
        if not self.parsed.echo:
            return []
        text = self.parsed.prompt_text
        return [
            self.chunk({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})
            for c in self.choices
        ]

    def token_choice(self, choice: _Choice, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": event.text,
            "logprobs": self._logprobs(choice, event.logprobs or []),
            "finish_reason": None,
        }

    def final_choices(self, choice: _Choice) -> list[dict[str, Any]]:
        final = {"index": choice.index, "text": "", "logprobs": None}
        return [{**final, "finish_reason": self.finish_reason(choice)}]

    def whole_choice(self, choice: _Choice) -> dict[str, Any]:
        p = self.parsed
        assert choice.finished is not None
        text = "".join(choice.text)
        logprobs = None
        if p.logprobs is not None and p.echo:
            prompt = completion_logprobs(
                self.tokenizer, choice.finished.prompt_logprobs or [], p.prompt_ids, 0
            )
            # Offsets then count the `tokens` strings throughout, special tokens included.
            choice.offset = sum(len(t) for t in prompt["tokens"])
            generated = self._logprobs(choice, choice.logprobs)
            logprobs = {k: prompt[k] + generated[k] for k in prompt}
        elif p.logprobs is not None:
            logprobs = self._logprobs(choice, choice.logprobs)
        if p.echo:
            text = p.prompt_text + text
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason(choice),
        }


# -- endpoints ------------------------------------------------------------------------------


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    parse = parse_chat if chat else parse_completion
    # Chat templating and tokenizing a long prompt take a while: keep the event loop free.
    engine = state.engine
    args = [body, engine.tokenizer, engine.max_model_len, engine.grammars]
    if chat:
        args.append(state.settings.tool_call_parser)
    parsed = await anyio.to_thread.run_sync(parse, *args)
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
    for prefix in ("chatcmpl-", "cmpl-", "msg_"):
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


def _tokenize(body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    """vLLM's /tokenize: a `prompt`, or `messages` through the chat template."""
    if "messages" in body:
        add_generation_prompt = bool_field(body, "add_generation_prompt")
        tools = tool_calls.parse_tools(body)
        return _chat_prompt(
            body, tokenizer, max_model_len, tools, add_generation_prompt is not False
        )
    prompt = str_field(body, "prompt")
    if prompt is None:
        raise invalid("send a `prompt` string or `messages`", "prompt")
    protocol.check_text_fits(tokenizer, len(prompt), max_model_len, "prompt")
    return tokenizer.encode(
        prompt, add_special_tokens=bool_field(body, "add_special_tokens") is not False
    )


async def tokenize(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    tokenizer = state.engine.tokenizer
    ids = await anyio.to_thread.run_sync(_tokenize, body, tokenizer, state.engine.max_model_len)
    strs = [tokenizer.token_text(t) for t in ids] if bool_field(body, "return_token_strs") else None
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": state.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    if body.get("tokens") is None:
        raise invalid("tokens is required: a list of token ids", "tokens")
    tokenizer = state.engine.tokenizer
    ids = _check_vocab(int_list_field(body, "tokens"), tokenizer, "tokens")
    # As vLLM (and transformers' decode): special tokens stay, so a round trip is exact.
    return JSONResponse({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})


ROUTES = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/cancel/{request_id}", cancel),
    # vLLM's extensions, at its paths.
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]
