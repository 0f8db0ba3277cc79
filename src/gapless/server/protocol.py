"""Request validation that every API dialect shares.

Requests are validated before the engine sees them, so every mistake a client can make
becomes a 4xx naming the offending field. Each dialect module (e.g. openai.py) reads its own
field names with these helpers and shapes APIError its own way.
Fields a dialect does not know are ignored, since clients send extras.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from gapless.engine.sampling_params import SamplingParams, SamplingParamsError
from gapless.model.tokenizer import Tokenizer, is_unicode


class APIError(Exception):
    """A refused or failed request: status, message, error type, the field it names, a code.

    Each dialect renders it in its own error shape.
    """

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


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


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


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, but `true` is no token count; 16.0 is one.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def float_field(body: dict[str, Any], name: str) -> float | None:
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


def bool_field(body: dict[str, Any], name: str) -> bool | None:
    return _exact(body, name, bool, "a boolean")


def str_field(body: dict[str, Any], name: str) -> str | None:
    return _exact(body, name, str, "a string")


def dict_field(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _exact(body, name, dict, "an object")


def list_field(body: dict[str, Any], name: str) -> list[Any] | None:
    return _exact(body, name, list, "a list")


def stop_field(body: dict[str, Any], name: str = "stop") -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise invalid(f"{name} must be a string or a list of strings", name)


def int_list_field(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(is_int(t) for t in value):
        return value
    raise invalid(f"{name} must be a list of integers", name)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number_fields(
    body: dict[str, Any], floats: dict[str, str], ints: dict[str, str]
) -> dict[str, Any]:
    """SamplingParams fields from the body's numbers; each dict maps body name -> field."""
    fields: dict[str, Any] = {}
    for names, read in ((floats, float_field), (ints, int_field)):
        for name, field in names.items():
            value = read(body, name)
            if value is not None:
                fields[field] = value
    return fields


# -- prompts and limits --------------------------------------------------------------------


def check_text_fits(tokenizer: Tokenizer, num_chars: int, max_model_len: int, param: str) -> None:
    """Refuses, before tokenizing, a text too long to fit the context with any tokenization:
    a 15 MB prompt costs nothing, instead of seconds of tokenizing and gigabytes of memory."""
    if tokenizer.surely_exceeds(num_chars, max_model_len):
        raise invalid(
            f"the prompt has {num_chars} characters, more than this model's maximum context "
            f"length of {max_model_len} tokens can hold",
            param,
            "context_length_exceeded",
        )


def encode_prompt(tokenizer: Tokenizer, text: str, max_model_len: int, param: str) -> list[int]:
    if not text:
        raise invalid("the prompt is empty", param)
    check_text_fits(tokenizer, len(text), max_model_len, param)
    return tokenizer.encode(text)


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    max_model_len: int,
    param: str,
    template_kwargs: dict[str, Any],
) -> list[int]:
    """Prompt ids of a conversation through the checkpoint's chat template. Messages are in
    the shape transformers' apply_chat_template takes (content may be None); template_kwargs
    (tools, ...) are the template's variables, whatever their names."""
    # The rendered prompt holds every message's content.
    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    check_text_fits(tokenizer, chars, max_model_len, param)
    try:
        prompt_ids = tokenizer.encode_chat(messages, **template_kwargs)
    except ValueError as e:  # no template, or the template rejected the conversation
        raise invalid(str(e), param) from e
    if not prompt_ids:
        raise invalid("the prompt is empty", param)
    return prompt_ids


def max_tokens(
    requested: int | None, param: str, prompt_len: int, prompt_param: str, max_model_len: int
) -> int:
    """The output budget: `requested` checked against the context, or all of the context
    the prompt leaves when None."""
    if prompt_len >= max_model_len:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens (at most {max_model_len - 1} leave room for output)",
            prompt_param,
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested < 0:
        raise invalid(f"{param} must be >= 0, got {requested}", param)
    if requested > room:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_len + requested} were requested ({prompt_len} in the prompt, "
            f"{requested} for the output); {param} can be at most {room}",
            param,
            "context_length_exceeded",
        )
    return requested


def sampling_params(fields: dict[str, Any], rename: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from validated fields; its own range checks name the request's field."""
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as e:
        param = (rename or {}).get(e.param, e.param)
        raise invalid(str(e), param) from e


def now() -> int:
    return int(time.time())
