"""The Ollama dialect: /api/chat, /api/generate, /api/embed (and the older /api/embeddings),
/api/tags, /api/show, /api/ps, /api/version.

Requests (`options` holding the sampling fields, `format` the output's shape, `tools`) become
prompt ids and SamplingParams; engine events become NDJSON lines, one per token and a last one
with `done: true` and the counts and durations, or that last line alone with `stream: false`;
tool calls are read out of the output as on the OpenAI chat endpoint and come back as
`message.tool_calls`; errors are {"error": "..."}. One model is always loaded, so
`keep_alive` is accepted and changes nothing; `think` is the chat template's thinking
switch. /api/embed returns the engine's pooled, L2-normalized vectors, truncating an input
longer than the context unless `truncate` is false.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import version
from typing import Any

import jinja2
import jinja2.meta
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.server import protocol, tool_calls
from gapless.server.endpoint import (
    EmbeddingRenderer,
    FieldNames,
    ServerState,
    embed,
    generate,
    read_json,
)
from gapless.server.images import (
    MessageContent,
    SentImage,
    check_images,
    check_user_images,
    decode_base64,
)
from gapless.server.openai_embeddings import BATCH_CONTEXTS, MAX_INPUTS, check_dimensions
from gapless.server.openai_embeddings import check_prompts as check_embedding_prompts
from gapless.server.protocol import APIError, bool_field, invalid, str_field
from gapless.server.streaming import Renderer, ndjson
from gapless.server.structured_output import ollama_format_grammar
from gapless.server.tool_calls import ToolCall, ToolRequest

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
# `think` levels, as gpt-oss's reasoning effort.
THINK_LEVELS = ("low", "medium", "high")
# /api/ps: when the model unloads. Never: this is as far as the timestamp goes.
NEVER_EXPIRES = "9999-12-31T23:59:59Z"


def error_body(error: APIError) -> dict[str, Any]:
    return {"error": error.message_naming_param()}


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedOllama:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    tool_parser: str | None = None  # chat with tools: how calls are read out of the output


def _model_name(state: ServerState) -> str:
    return f"{state.settings.served_model_name}:latest"


def _adapter(model: str | None, admission: Admission) -> str | None:
    """The --lora adapter a model name picks (`NAME` or `NAME:latest`), else None."""
    name = (model or "").removesuffix(":latest")
    return name if name in admission.adapters else None


def _check_model(state: ServerState, body: dict[str, Any], adapters: bool = False) -> str:
    """The model named as the client named it; Ollama names carry a tag, `:latest` if none.
    adapters: the endpoint serves the --lora adapters' names too (chat and generate)."""
    model = str_field(body, "model")
    if model is None or protocol.serves(model, state.settings.served_model_name):
        return model or _model_name(state)
    if adapters and _adapter(model, state.engine.admission) is not None:
        return model
    served = [_model_name(state)]
    if adapters:
        served += [f"{name}:latest" for name in state.engine.admission.adapters]
    raise APIError(404, f"model {model!r} not found; this server serves {served}")


def field_names(chat: bool) -> FieldNames:
    """The request's names for the engine's fields: a chat's prompt is its messages."""
    return {**_OPTION_NAMES, "prompt": "messages", "images": "messages"} if chat else _OPTION_NAMES


def _check_samplers(options: dict[str, Any]) -> None:
    """Refuses the samplers gapless does not have, rather than sampling otherwise: mirostat
    (1 or 2) and locally typical sampling (typical_p below 1). Their off values pass."""
    if protocol.int_field(options, "mirostat"):
        raise invalid(
            "mirostat sampling is not supported; use temperature, top_p, top_k or min_p",
            "options.mirostat",
        )
    typical_p = protocol.float_field(options, "typical_p")
    if typical_p is not None and typical_p < 1:
        raise invalid(
            "typical sampling (typical_p below 1) is not supported; use top_p or min_p",
            "options.typical_p",
        )


def _sampling(
    body: dict[str, Any], admission: Admission, grammars: GrammarCompiler, prompt_len: int
) -> dict[str, Any]:
    """SamplingParams fields: `options`, `format` as the output's grammar, and the service
    class."""
    options = protocol.dict_field(body, "options") or {}
    _check_samplers(options)
    fields = protocol.number_fields(options, _FLOAT_OPTIONS, _INT_OPTIONS)
    fields["adapter"] = _adapter(str_field(body, "model"), admission)
    num_predict = protocol.int_field(options, "num_predict")
    # -1 (no limit) and -2 (fill the context) both mean: the rest of the context. A limit past
    # the context ends there, as Ollama's does: clients such as Open WebUI send one number for
    # every model, whatever its context.
    room = admission.output_budget(None, prompt_len)
    fields["max_tokens"] = (
        room if num_predict is None or num_predict < 0 else min(num_predict, room)
    )
    fields["stop"] = protocol.stop_field(options)
    fields["speculate"] = protocol.bool_field(body, "speculate") is not False
    fields["grammar"] = ollama_format_grammar(body.get("format"), grammars)
    fields["service_class"] = protocol.service_class(body, _stream(body))
    return fields


def _stream(body: dict[str, Any]) -> bool:
    return bool_field(body, "stream") is not False  # Ollama streams unless told not to


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`think` as the chat template's switch: true or false as `enable_thinking` (Qwen3's,
    SmolLM3's), a level as `reasoning_effort` (gpt-oss's harmony template). A template
    without the switch renders as it always does; Ollama's own `template` (a Go template
    replacing the model's) cannot be run, so it is refused."""
    if str_field(body, "template"):
        raise invalid(
            "template (an Ollama Go template) is not supported: the model's own chat "
            "template renders every prompt",
            "template",
        )
    think = body.get("think")
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in THINK_LEVELS:
        return {"reasoning_effort": think}
    raise invalid(f"think must be true, false or one of {', '.join(THINK_LEVELS)}", "think")


def _images(value: Any, param: str) -> list[SentImage]:
    """`images`: a list of base64 strings."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("images must be a list of base64 strings", param)
    return [
        SentImage(decode_base64(data, f"{param}[{j}]"), f"{param}[{j}]")
        for j, data in enumerate(value)
    ]


def _with_images(message: dict[str, Any], images: list[SentImage]) -> dict[str, Any]:
    """A message whose images come before its text, as Ollama places them."""
    if not images:
        return message
    content = MessageContent()
    for image in images:
        content.image(image.data, image.param)
    content.text(message.get("content") or "")
    out = {k: v for k, v in message.items() if k != "images"}
    return {**out, "content": content.template_content()}


def _messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[SentImage]]:
    """The messages as the chat template takes them, and their images in order."""
    out, images = [], []
    for i, message in enumerate(protocol.chat_messages(body, CHAT_ROLES)):
        if not isinstance(message.get("content", ""), str):
            raise invalid("content must be a string", f"messages[{i}].content")
        own = _images(message.get("images"), f"messages[{i}].images")
        check_user_images(message["role"], own, f"messages[{i}].images")
        images += own
        out.append(protocol.template_message(_with_images(message, own), f"messages[{i}]"))
    return out, images


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    """`tools`, in OpenAI's shape; Ollama has no tool_choice: the model chooses."""
    return tool_calls.parse_tools({"tools": protocol.list_field(body, "tools") or None})


def parse_chat(
    body: dict[str, Any],
    admission: Admission,
    grammars: GrammarCompiler,
    configured_parser: str | None,
) -> ParsedOllama:
    tools = _tools(body)
    offered = tools.tools if tools is not None and tools.tools else None
    (messages, sent), kwargs = _messages(body), _template_kwargs(body)
    images = check_images(admission, sent)
    ids = admission.encode_chat(messages, tools=offered, **kwargs)
    prompt_ids = admission.check_prompt(ids, images=images)
    fields = _sampling(body, admission, grammars, len(prompt_ids))
    chat_template = admission.tokenizer.chat_template
    parser = tool_calls.apply_tools(tools, fields, grammars, chat_template, configured_parser)
    return ParsedOllama(prompt_ids, SamplingParams(**fields), _stream(body), parser)


def parse_generate(
    body: dict[str, Any], admission: Admission, grammars: GrammarCompiler
) -> ParsedOllama:
    """A prompt goes through the chat template as a user message (after `system`, if any),
    as Ollama does, unless `raw` is set or the model has no template."""
    prompt = str_field(body, "prompt") or ""
    system = str_field(body, "system")
    kwargs = _template_kwargs(body)
    sent = _images(body.get("images"), "images")
    images = check_images(admission, sent)
    if str_field(body, "suffix"):
        raise invalid(
            "suffix (fill-in-the-middle) needs a template that places text after the "
            "insertion point, and gapless has none for any model: send the prompt alone",
            "suffix",
        )
    if bool_field(body, "raw") or admission.tokenizer.chat_template is None:
        # The prompt holds the images' placeholders itself.
        prompt_ids = admission.check_prompt(prompt, images=images)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append(_with_images({"role": "user", "content": prompt}, sent))
        ids = admission.encode_chat(messages, **kwargs)
        prompt_ids = admission.check_prompt(ids, images=images)
    fields = _sampling(body, admission, grammars, len(prompt_ids))
    return ParsedOllama(prompt_ids, SamplingParams(**fields), _stream(body))


# -- rendering engine events ---------------------------------------------------------------


def _created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


class _OllamaRenderer(Renderer):
    stream_media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool, parsed: ParsedOllama) -> None:
        super().__init__()
        self.model = model
        self.chat = chat
        # feed(): the text that is content (a call's is held back); finish(): held text
        # that was not a call after all, and the calls.
        self.tool_stream = tool_calls.output_stream(None, parsed.tool_parser)

    def line(self, text: str, done: bool, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _created_at()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if calls:
                out["message"]["tool_calls"] = [_tool_call(call) for call in calls]
        else:
            out["response"] = text
        out["done"] = done
        return out

    def last(self, text: str, finished: FinishedEvent, calls: list[ToolCall]) -> dict[str, Any]:
        timings = finished.timings
        end = timings.get("finished", 0.0)
        first_token = timings.get("first_token", end)
        return {
            **self.line(text, True, calls),
            "done_reason": finished.finish_reason,
            "total_duration": _ns(end),
            "load_duration": 0,
            "prompt_eval_count": finished.prompt_tokens,
            "prompt_eval_duration": _ns(first_token - timings.get("first_scheduled", 0.0)),
            "eval_count": finished.completion_tokens,
            "eval_duration": _ns(end - first_token),
        }

    def token(self, event: TokenEvent) -> list[bytes]:
        text = self.tool_stream.feed(event.text)
        return [ndjson(self.line(text, done=False))] if text else []

    def finished(self, event: FinishedEvent) -> list[bytes]:
        # As Ollama streams them: the calls in a line of their own before the last.
        rest, calls = self.tool_stream.finish()
        pieces = [ndjson(self.line(rest, False, calls))] if rest or calls else []
        return [*pieces, ndjson(self.last("", event, []))]

    def failed(self, error: APIError) -> list[bytes]:
        return [ndjson(error_body(error))]

    def absorb(self, event: TokenEvent) -> None:
        self.text.append(self.tool_stream.feed(event.text))

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        rest, calls = self.tool_stream.finish()
        return self.last("".join(self.text) + rest, finished, calls)


# -- embeddings -----------------------------------------------------------------------------


@dataclass
class ParsedEmbed:
    prompts: list[list[int]]


def _embed_inputs(body: dict[str, Any], legacy: bool) -> list[str]:
    """/api/embed's `input` (a string or a non-empty list of them), or the legacy
    /api/embeddings's `prompt`."""
    param = "prompt" if legacy else "input"
    value = body.get(param)
    if isinstance(value, str):
        return [value]
    if legacy or not isinstance(value, list):
        what = "a string" if legacy else "a string or a list of strings"
        raise invalid(f"{param} must be {what}", param)
    if not value:
        raise invalid("input is empty: send a string or a list of strings", param)
    if len(value) > MAX_INPUTS:
        raise invalid(f"input may hold at most {MAX_INPUTS} strings, got {len(value)}", param)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid("must be a string", f"input[{i}]")
    return value


def parse_embed(
    body: dict[str, Any], admission: Admission, width: int, legacy: bool
) -> ParsedEmbed:
    """`options` and `keep_alive` are accepted and change nothing; /api/embed's `truncate`
    (default true) cuts an input longer than the context to its first tokens that fit."""
    protocol.dict_field(body, "options")
    check_dimensions(body, width)
    truncate = not legacy and bool_field(body, "truncate") is not False
    prompts = _embed_inputs(body, legacy)
    param = "prompt" if legacy else "input"
    return ParsedEmbed(check_embedding_prompts(prompts, admission, param, truncate))


class _EmbedRenderer(EmbeddingRenderer):
    def __init__(self, model: str, legacy: bool) -> None:
        super().__init__()
        self.model = model
        self.legacy = legacy
        self.started = time.monotonic()

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        vectors = self.vectors()
        if self.legacy:
            return {"embedding": vectors[0]}
        return {
            "model": self.model,
            "embeddings": vectors,
            "total_duration": _ns(time.monotonic() - self.started),
            "load_duration": 0,
            "prompt_eval_count": self.prompt_tokens,
        }


async def _embed(state: ServerState, request: Request, legacy: bool) -> Response:
    body = await read_json(state, request, BATCH_CONTEXTS)
    model = _check_model(state, body)
    width = state.engine.decoder.config.hidden_size
    parse = partial(parse_embed, body, state.engine.admission, width, legacy)

    def renderer(parsed: ParsedEmbed, request_id: str) -> _EmbedRenderer:
        return _EmbedRenderer(model, legacy)

    return await embed(state, {}, parse, renderer)


async def embed_endpoint(state: ServerState, request: Request) -> Response:
    return await _embed(state, request, legacy=False)


async def embeddings(state: ServerState, request: Request) -> Response:
    """The older endpoint: one `prompt`, one `embedding`."""
    return await _embed(state, request, legacy=True)


# -- endpoints ------------------------------------------------------------------------------


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    body = await read_json(state, request)
    model = _check_model(state, body, adapters=True)
    if not chat and not body.get("prompt") and not body.get("suffix"):
        # An empty prompt only loads the model, which is always loaded here.
        loaded = {"model": model, "created_at": _created_at(), "response": "", "done": True}
        return JSONResponse({**loaded, "done_reason": "load"})
    engine = state.engine
    if chat:
        parser = state.settings.tool_call_parser
        parse = partial(parse_chat, body, engine.admission, engine.grammars, parser)
    else:
        parse = partial(parse_generate, body, engine.admission, engine.grammars)

    def renderer(parsed: ParsedOllama, request_id: str) -> _OllamaRenderer:
        return _OllamaRenderer(model, chat, parsed)

    return await generate(state, field_names(chat), parse, renderer)


async def chat(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=True)


async def generate_text(state: ServerState, request: Request) -> Response:
    return await _generate(state, request, chat=False)


def _details(state: ServerState) -> dict[str, Any]:
    model = state.description
    return {
        "parent_model": "",
        "format": "",
        "family": model.family,
        "families": [model.family],
        "parameter_size": model.parameter_size,
        "quantization_level": model.quantization_level,
    }


def _modified_at(state: ServerState) -> str:
    return datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")


def _card(state: ServerState, name: str | None = None) -> dict[str, Any]:
    """The served model's card, or (name) an adapter's, whose details name the base as
    parent_model."""
    card = {
        "name": name or _model_name(state),
        "model": name or _model_name(state),
        "size": state.description.held_bytes,
        "digest": "",
        "details": _details(state),
    }
    if name is not None:
        card["details"] = card["details"] | {"parent_model": _model_name(state)}
    return card


async def tags(state: ServerState, request: Request) -> Response:
    adapters = [_card(state, f"{name}:latest") for name in state.engine.admission.adapters]
    cards = [_card(state), *adapters]
    return JSONResponse(
        {"models": [{**card, "modified_at": _modified_at(state)} for card in cards]}
    )


async def ps(state: ServerState, request: Request) -> Response:
    """The loaded model: always the one served, which never unloads, in memory (not VRAM)."""
    loaded = {
        **_card(state),
        "expires_at": NEVER_EXPIRES,
        "size_vram": 0,
        "context_length": state.description.context_length,
    }
    return JSONResponse({"models": [loaded]})


def takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (Ollama's "tools" capability)."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def _parameters(state: ServerState) -> str:
    """Modelfile PARAMETER lines: the context length and the tokens that end generation."""
    tokenizer = state.engine.tokenizer
    lines = [("num_ctx", str(state.engine.max_model_len))]
    for token_id in sorted(state.engine.tokenizer.eos_token_ids):
        lines.append(("stop", json.dumps(tokenizer.token_text(token_id), ensure_ascii=False)))
    return "\n".join(f"{name:<30} {value}" for name, value in lines)


def _model_info(state: ServerState) -> dict[str, Any]:
    """GGUF's metadata keys, as Ollama shows them."""
    model, config = state.description, state.engine.decoder.config
    info: dict[str, Any] = {
        "general.architecture": model.family,
        "general.parameter_count": model.parameter_count,
    }
    for key, value in (
        ("context_length", model.context_length),
        ("embedding_length", config.hidden_size),
        ("feed_forward_length", config.intermediate_size),
        ("block_count", config.num_layers),
        ("attention.head_count", config.num_heads),
        ("attention.head_count_kv", config.num_kv_heads),
        ("attention.key_length", config.head_dim),
        ("attention.value_length", config.head_dim),
        ("attention.layer_norm_rms_epsilon", config.rms_norm_eps),
        ("rope.freq_base", config.rope_theta),
        ("vocab_size", config.vocab_size),
    ):
        info[f"{model.family}.{key}"] = value
    return info


async def show(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    _check_model(state, body)
    template = state.engine.tokenizer.chat_template
    capabilities = ["embedding"]
    if state.settings.task != "embed":
        capabilities[:0] = ["completion"] + (["tools"] if takes_tools(template) else [])
        if state.engine.admission.vision is not None:
            capabilities.insert(1, "vision")  # what Ollama's clients check before sending images
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": _parameters(state),
            "template": template or "",
            "details": _details(state),
            "model_info": _model_info(state),
            "capabilities": capabilities,
            "modified_at": _modified_at(state),
        }
    )


async def ollama_version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": version("gapless")})


ROUTES = [
    ("POST", "/api/chat", chat),
    ("POST", "/api/generate", generate_text),
    ("POST", "/api/embed", embed_endpoint),
    ("POST", "/api/embeddings", embeddings),
    ("GET", "/api/tags", tags),
    ("POST", "/api/show", show),
    ("GET", "/api/ps", ps),
    ("GET", "/api/version", ollama_version),
]
