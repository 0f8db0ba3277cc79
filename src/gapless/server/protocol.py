"""OpenAI request parsing and response shapes.

Requests are validated here, before the engine sees them, so every mistake a client can make
becomes a 400 naming the offending field. Fields this server does not know are ignored, since
OpenAI clients send extras (user, response_format, ...).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from gapless.engine.events import TokenLogprob
from gapless.engine.sampling_params import SamplingParams, SamplingParamsError
from gapless.model.tokenizer import Tokenizer, is_unicode

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI reports an impossible logprob as -9999.0; JSON has no -Infinity.
_MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


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


# -- typed field access --------------------------------------------------------------------

# JSON can escape a lone UTF-16 surrogate, which no Unicode text may hold; only a body that
# has such an escape needs the walk over all its strings.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def check_unicode(raw: str, body: dict[str, Any]) -> None:
    """Refuses a body holding a lone surrogate anywhere, naming the field."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[str | None, Any]] = [(None, body)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, str) and not is_unicode(value):
            raise invalid(f"{name} is not valid Unicode: it holds a lone surrogate", name)
        if isinstance(value, dict):
            for key, item in value.items():
                if not is_unicode(key):
                    raise invalid("a field name is not valid Unicode: it holds a lone surrogate")
                stack.append((key if name is None else f"{name}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{name}[{i}]", item) for i, item in enumerate(value))


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, but `true` is no token count; 16.0 is one.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def _float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _exact(body: dict[str, Any], name: str, kind: type, label: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind):
        raise invalid(f"{name} must be {label}, got {value!r}", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool | None:
    return _exact(body, name, bool, "a boolean")


def _str(body: dict[str, Any], name: str) -> str | None:
    return _exact(body, name, str, "a string")


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise invalid("stop must be a string or a list of strings", "stop")


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    raise invalid(f"{name} must be a list of integers", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- requests ------------------------------------------------------------------------------


def _common(
    body: dict[str, Any], prompt_len: int, prompt_param: str, max_model_len: int
) -> tuple[dict[str, Any], bool, bool]:
    """SamplingParams fields shared by both endpoints, plus (stream, include_usage)."""
    n = _int(body, "n")
    if n is not None and n > 1:
        raise invalid("n > 1 is not supported", "n")
    if n is not None and n < 1:
        raise invalid(f"n must be 1, got {n}", "n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of > 1 is not supported", "best_of")

    if prompt_len >= max_model_len:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens (at most {max_model_len - 1} leave room for output)",
            prompt_param,
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
    limit_param = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _int(body, limit_param)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 0:
        raise invalid(f"{limit_param} must be >= 0, got {max_tokens}", limit_param)
    elif max_tokens > room:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
            f"{max_tokens} for the output); {limit_param} can be at most {room}",
            limit_param,
            "context_length_exceeded",
        )

    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "seed": _int(body, "seed"),
        "stop": _stop(body),
    }
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = _float(body, name)
        if value is not None:
            fields[name] = value
    for name in ("top_k", "min_tokens"):
        value = _int(body, name)
        if value is not None:
            fields[name] = value
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        value = _bool(body, name)
        if value is not None:
            fields[name] = value
    fields["stop_token_ids"] = _int_list(body, "stop_token_ids")

    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = bool(_bool(options, "include_usage"))
    return fields, stream, include_usage


def _sampling_params(
    fields: dict[str, Any], rename: dict[str, str] | None = None
) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as e:
        param = (rename or {}).get(e.param, e.param)
        raise invalid(str(e), param) from e


def _model(body: dict[str, Any]) -> str | None:
    return _str(body, "model")


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


def _check_text_fits(tokenizer: Tokenizer, num_chars: int, max_model_len: int, param: str) -> None:
    """Refuses, before tokenizing, a text too long to fit the context with any tokenization:
    a 15 MB prompt costs nothing, instead of seconds of tokenizing and gigabytes of memory."""
    if tokenizer.surely_exceeds(num_chars, max_model_len):
        raise invalid(
            f"the prompt has {num_chars} characters, more than this model's maximum context "
            f"length of {max_model_len} tokens can hold",
            param,
            "context_length_exceeded",
        )


def parse_chat(body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> ParsedRequest:
    messages = _messages(body)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    if "messages" in template_kwargs:
        raise invalid(
            "chat_template_kwargs cannot set `messages`; send them as `messages`",
            "chat_template_kwargs",
        )
    # The rendered prompt holds every message's content.
    chars = sum(len(m["content"]) for m in messages if m["content"] is not None)
    _check_text_fits(tokenizer, chars, max_model_len, "messages")
    try:
        prompt_ids = tokenizer.encode_chat(messages, **template_kwargs)
    except ValueError as e:  # no template, or the template rejected the conversation
        raise invalid(str(e), "messages") from e
    if not prompt_ids:
        raise invalid("the prompt is empty", "messages")

    fields, stream, include_usage = _common(body, len(prompt_ids), "messages", max_model_len)
    want_logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs")
    if top and not want_logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    fields["logprobs"] = logprobs
    params = _sampling_params(fields, {"logprobs": "top_logprobs"})
    return ParsedRequest(_model(body), prompt_ids, params, stream, include_usage, logprobs=logprobs)


def _prompt(
    body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int
) -> tuple[list[int], str]:
    """The prompt's ids and text; a batch of one prompt counts as that prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        if len(prompt) > 1:
            raise invalid(
                f"batched prompts ({len(prompt)} prompts) are not supported; send one request "
                "per prompt",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("the prompt is empty", "prompt")
        _check_text_fits(tokenizer, len(prompt), max_model_len, "prompt")
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise invalid("the prompt is empty", "prompt")
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        # As a string prompt echoes its special tokens, so does a token-id prompt.
        return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    raise invalid(
        "prompt must be a string, a list of token ids, or a list of one of those", "prompt"
    )


def parse_completion(
    body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int
) -> ParsedRequest:
    prompt_ids, prompt_text = _prompt(body, tokenizer, max_model_len)
    fields, stream, include_usage = _common(body, len(prompt_ids), "prompt", max_model_len)
    echo = bool(_bool(body, "echo"))
    logprobs = _int(body, "logprobs")
    if echo and logprobs is not None and stream:
        raise invalid("echo with logprobs is supported only without streaming", "echo")
    fields["logprobs"] = logprobs
    if echo and logprobs is not None:
        fields["prompt_logprobs"] = logprobs
    params = _sampling_params(fields)
    return ParsedRequest(
        _model(body), prompt_ids, params, stream, include_usage, echo, prompt_text, logprobs
    )


# -- responses -----------------------------------------------------------------------------


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


def now() -> int:
    return int(time.time())
