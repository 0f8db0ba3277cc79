"""The Ollama dialect: /api/chat, /api/generate, /api/tags, /api/show, /api/version.

Requests (`options` holding the sampling fields) become prompt ids and SamplingParams; engine
events become NDJSON lines, one per token and a last one with `done: true` and the counts and
durations, or that last line alone with `stream: false`; errors are {"error": "..."}.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import version
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.server import protocol
from gapless.server.endpoint import (
    FieldNames,
    Renderer,
    ServerState,
    generate,
    ndjson,
    read_json,
)
from gapless.server.protocol import APIError, bool_field, invalid, str_field

CHAT_ROLES = ("system", "user", "assistant", "tool")
# options name -> SamplingParams field
_FLOAT_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_INT_OPTIONS = {"top_k": "top_k", "seed": "seed"}
# The request's names for the engine's fields where the options name them differently.
_OPTION_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}


def error_body(error: APIError) -> dict[str, Any]:
    return {"error": error.message_naming_param()}


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedOllama:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


def _model_name(state: ServerState) -> str:
    return f"{state.settings.served_model_name}:latest"


def _check_model(state: ServerState, body: dict[str, Any]) -> str:
    """The model named as the client named it; Ollama names carry a tag, `:latest` if none."""
    model = str_field(body, "model")
    served = state.settings.served_model_name
    if model is None or model in (served, _model_name(state)):
        return model or _model_name(state)
    raise APIError(404, f"model {model!r} not found; this server serves {_model_name(state)!r}")


def field_names(chat: bool) -> FieldNames:
    """The request's names for the engine's fields: a chat's prompt is its messages."""
    return {**_OPTION_NAMES, "prompt": "messages"} if chat else _OPTION_NAMES


def _sampling(body: dict[str, Any], admission: Admission, prompt_len: int) -> SamplingParams:
    options = protocol.dict_field(body, "options") or {}
    fields = protocol.number_fields(options, _FLOAT_OPTIONS, _INT_OPTIONS)
    num_predict = protocol.int_field(options, "num_predict")
    # -1 (no limit) and -2 (fill the context) both mean: the rest of the context.
    if num_predict is not None and num_predict < 0:
        num_predict = None
    fields["max_tokens"] = admission.output_budget(num_predict, prompt_len)
    fields["stop"] = protocol.stop_field(options)
    return SamplingParams(**fields)


def _stream(body: dict[str, Any]) -> bool:
    return bool_field(body, "stream") is not False  # Ollama streams unless told not to


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(protocol.chat_messages(body, CHAT_ROLES)):
        if message.get("images"):
            raise invalid("images are not supported", f"messages[{i}].images")
        if not isinstance(message.get("content", ""), str):
            raise invalid("content must be a string", f"messages[{i}].content")
        out.append(protocol.template_message(message, f"messages[{i}]"))
    return out


def parse_chat(body: dict[str, Any], admission: Admission) -> ParsedOllama:
    tools = protocol.list_field(body, "tools") or None
    prompt_ids = admission.check_prompt(admission.encode_chat(_messages(body), tools=tools))
    params = _sampling(body, admission, len(prompt_ids))
    return ParsedOllama(prompt_ids, params, _stream(body))


def parse_generate(body: dict[str, Any], admission: Admission) -> ParsedOllama:
    """A prompt goes through the chat template as a user message (after `system`, if any),
    as Ollama does, unless `raw` is set or the model has no template."""
    prompt = str_field(body, "prompt") or ""
    system = str_field(body, "system")
    if body.get("images"):
        raise invalid("images are not supported", "images")
    if bool_field(body, "raw") or admission.tokenizer.chat_template is None:
        prompt_ids = admission.check_prompt(prompt)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        prompt_ids = admission.check_prompt(admission.encode_chat(messages))
    params = _sampling(body, admission, len(prompt_ids))
    return ParsedOllama(prompt_ids, params, _stream(body))


# -- rendering engine events ---------------------------------------------------------------


def _created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


class _OllamaRenderer(Renderer):
    stream_media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool) -> None:
        super().__init__()
        self.model = model
        self.chat = chat

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error_body(error)

    def line(self, text: str, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _created_at()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = done
        return out

    def last(self, text: str, finished: FinishedEvent) -> dict[str, Any]:
        timings = finished.timings
        end = timings.get("finished", 0.0)
        first_token = timings.get("first_token", end)
        return {
            **self.line(text, done=True),
            "done_reason": finished.finish_reason,
            "total_duration": _ns(end),
            "load_duration": 0,
            "prompt_eval_count": finished.prompt_tokens,
            "prompt_eval_duration": _ns(first_token - timings.get("first_scheduled", 0.0)),
            "eval_count": finished.completion_tokens,
            "eval_duration": _ns(end - first_token),
        }

    def token(self, event: TokenEvent) -> list[bytes]:
        return [ndjson(self.line(event.text, done=False))] if event.text else []

    def finished(self, event: FinishedEvent) -> list[bytes]:
        return [ndjson(self.last("", event))]

    def failed(self, error: APIError) -> list[bytes]:
        return [ndjson(error_body(error))]

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        return self.last("".join(self.text), finished)


# -- endpoints ------------------------------------------------------------------------------


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    body = await read_json(state, request)
    model = _check_model(state, body)
    if not chat and not body.get("prompt"):
        # An empty prompt only loads the model, which is always loaded here.
        loaded = {"model": model, "created_at": _created_at(), "response": "", "done": True}
        return JSONResponse({**loaded, "done_reason": "load"})
    parse = partial(parse_chat if chat else parse_generate, body, state.engine.admission)
    renderer = _OllamaRenderer(model, chat)
    return await generate(state, field_names(chat), parse, lambda parsed, request_id: renderer)


async def chat(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=True)


async def generate_text(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=False)


def _family(state: ServerState) -> str:
    """The architecture as GGUF (and so Ollama) names it: LlamaForCausalLM is `llama`."""
    return state.engine.decoder.config.architecture.removesuffix("ForCausalLM").lower()


def _details(state: ServerState) -> dict[str, Any]:
    family = _family(state)
    return {
        "parent_model": "",
        "format": "",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    }


def _modified_at(state: ServerState) -> str:
    return datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")


async def tags(state: ServerState, request: Request) -> Response:
    name = _model_name(state)
    card = {
        "name": name,
        "model": name,
        "modified_at": _modified_at(state),
        "size": 0,
        "digest": "",
        "details": _details(state),
    }
    return JSONResponse({"models": [card]})


async def show(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    _check_model(state, body)
    family = _family(state)
    template = state.engine.tokenizer.chat_template
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": template or "",
            "details": _details(state),
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": state.engine.max_model_len,
            },
            "capabilities": ["completion"],
            "modified_at": _modified_at(state),
        }
    )


async def ollama_version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": version("gapless")})


ROUTES = [
    ("POST", "/api/chat", chat),
    ("POST", "/api/generate", generate_text),
    ("GET", "/api/tags", tags),
    ("POST", "/api/show", show),
    ("GET", "/api/version", ollama_version),
]
