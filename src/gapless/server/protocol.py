"""Request validation that every API dialect shares.

Requests are validated before the engine sees them, so every mistake a client can make
becomes a 4xx naming the offending field. Each dialect module (e.g. anthropic.py) reads its own
field names with these helpers and shapes APIError its own way; the checks against the model
(the prompt's length and ids, the output budget) are the engine's Admission, whose refusals
endpoint.admission_errors names as the request does.
Fields a dialect does not know are ignored, since clients send extras.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from gapless.engine.sampling_params import default_service_class
from gapless.model.tokenizer import is_unicode
from gapless.server.tenants import CALLER

# Seconds a client is told to wait before retrying a request refused for load (a 503 or 429).
RETRY_AFTER_S = 1


def retry_later(
    status: int, message: str, type: str, code: str, retry_after_s: int = RETRY_AFTER_S
) -> APIError:
    """A refusal for load, with the Retry-After header that tells the client when to retry."""
    return APIError(status, message, type, code=code, headers={"Retry-After": str(retry_after_s)})


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

    def message_naming_param(self) -> str:
        """The message, led by the field it is about unless it names it already: for the
        error shapes that have no `param`."""
        if self.param is None or self.param in self.message:
            return self.message
        return f"{self.param}: {self.message}"


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


def service_class(
    body: dict[str, Any], streamed: bool, n: int = 1, named: str | None = None
) -> str:
    """The request's service class (docs/server.md, Service classes): its `service_class`,
    else the one its dialect's own fields name (`named`: OpenAI's service_tier, vLLM's
    priority), else the default for how it is asked (default_service_class). An unknown name
    is refused once, by SamplingParams, as any field's value is."""
    requested = str_field(body, "service_class")
    if requested is not None:
        return requested
    caller = CALLER.get()  # an API key's default class comes before the request's shape's
    return named or (caller and caller.service_class) or default_service_class(n, streamed)


def chat_messages(body: dict[str, Any], roles: tuple[str, ...]) -> list[dict[str, Any]]:
    """`messages`: a non-empty list of objects, each with one of `roles`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid("each message must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in roles:
            raise invalid(
                f"unknown role {role!r}; expected one of {', '.join(roles)}",
                f"messages[{i}].role",
            )
    return messages


def text_content(content: Any, param: str) -> str | None:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...}),
    the shape OpenAI content parts and Anthropic text blocks share; None passes through."""
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


def serves(model: str, served: str) -> bool:
    """Whether a request's `model` names the served model: its name, or its Ollama name
    `<name>:latest` (which Ollama's clients, Open WebUI's Ollama connection among them, send
    to every dialect)."""
    return model in (served, f"{served}:latest")


def check_model(model: Any, served: str, adapters: tuple[str, ...] = ()) -> None:
    """A request's `model` must name the served model (serves) or one of `adapters` (the
    --lora names the endpoint serves); a missing one is allowed: the base model runs."""
    if model is None or serves(model, served) or model in adapters:
        return
    if not isinstance(model, str):
        raise invalid("model must be a string", "model")
    names = ", ".join(repr(name) for name in (served, *adapters))
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {names}",
        "not_found_error",
        "model",
        "model_not_found",
    )


# -- chat messages -------------------------------------------------------------------------


def template_message(message: dict[str, Any], param: str) -> dict[str, Any]:
    """A chat message in the shape chat templates are written for (transformers documents
    it): tool-call arguments as an object, not the JSON string the OpenAI API sends, and
    content a string even where the API allows null (an assistant turn that only calls
    tools), since many templates concatenate it. Other fields pass through."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    calls = out.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise invalid("tool_calls must be a list", f"{param}.tool_calls")
    out["tool_calls"] = [
        _template_tool_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)
    ]
    return out


def _template_tool_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid("a tool call needs a `function` with a string `name`", param)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise invalid(
                f"tool call arguments are not valid JSON: {e}", f"{param}.function.arguments"
            ) from e
    if not isinstance(arguments, dict):
        raise invalid("tool call arguments must be a JSON object", f"{param}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


def now() -> int:
    return int(time.time())
