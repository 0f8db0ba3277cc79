"""What the OpenAI endpoints share: the error shape {"error": {message, type, param, code}},
the sampling fields both /v1/chat/completions and /v1/completions take, the response envelope
with its choices and usage, and /v1/models.

Each endpoint is its own module (openai_chat.py, openai_completions.py, tokenization.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.server import protocol
from gapless.server.endpoint import ServerState
from gapless.server.protocol import (
    APIError,
    bool_field,
    int_field,
    int_list_field,
    invalid,
    stop_field,
    str_field,
)
from gapless.server.streaming import Renderer, progress_comment, sse
from gapless.server.structured_output import output_grammar
from gapless.server.tool_calls import ToolCallStream

# OpenAI reports an impossible logprob as -9999.0; JSON has no -Infinity.
_MIN_LOGPROB = -9999.0
# OpenAI's service_tier values as service classes; None: the request's default class.
SERVICE_TIERS = {"auto": None, "default": None, "flex": "batch", "priority": "interactive"}


def error_body(error: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def check_model(state: ServerState, body: dict[str, Any], adapters: bool = False) -> None:
    """adapters: the endpoint serves the --lora adapters' names too (completions and chat,
    whose sampling_fields pick the adapter)."""
    names = state.engine.admission.adapters if adapters else ()
    protocol.check_model(body.get("model"), state.settings.served_model_name, names)


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A validated request, ready for the engine."""

    model: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    # chat: top_logprobs when logprobs are requested; completions: the `logprobs` integer
    logprobs: int | None


def max_tokens_name(body: dict[str, Any]) -> str:
    """The request's name for max_tokens: max_completion_tokens is OpenAI's newer name, and
    wins when both are sent."""
    if body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def sampling_fields(
    body: dict[str, Any], admission: Admission, prompt_len: int, grammars: GrammarCompiler
) -> tuple[dict[str, Any], bool, bool]:
    """SamplingParams fields shared by both endpoints, plus (stream, include_usage)."""
    best_of = int_field(body, "best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of > 1 is not supported", "best_of")
    # Biasing logits needs a hook in the engine's sampler, which it does not have; an empty
    # map biases nothing.
    if protocol.dict_field(body, "logit_bias"):
        raise invalid("logit_bias is not supported; send an empty object or none", "logit_bias")

    limit = int_field(body, max_tokens_name(body))
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
    fields.update(
        max_tokens=admission.output_budget(limit, prompt_len),
        seed=int_field(body, "seed"),
        stop=stop_field(body),
    )
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculate"):
        value = bool_field(body, name)
        if value is not None:
            fields[name] = value
    fields["stop_token_ids"] = int_list_field(body, "stop_token_ids")
    if (model := body.get("model")) in admission.adapters:  # check_model let it through
        fields["adapter"] = model

    stream = bool(bool_field(body, "stream"))
    n = fields.get("n", 1)
    fields["service_class"] = protocol.service_class(body, stream, n, named_class(body))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = bool(bool_field(options, "include_usage"))
    return fields, stream, include_usage


def named_class(body: dict[str, Any]) -> str | None:
    """The service class that OpenAI's `service_tier` names, else vLLM's integer `priority`
    (lower is more urgent, 0 the default: below 0 interactive, above 0 batch); None: neither
    names one."""
    tier = str_field(body, "service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid(
            f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}",
            "service_tier",
        )
    if tier is not None and SERVICE_TIERS[tier] is not None:
        return SERVICE_TIERS[tier]
    priority = int_field(body, "priority") or 0
    if priority:
        return "interactive" if priority < 0 else "batch"
    return None


# -- responses -----------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprob(value: float) -> float:
    """A logprob as OpenAI reports it: an impossible one as -9999.0."""
    return max(value, _MIN_LOGPROB)


@dataclass
class Choice:
    """One of the request's n choices as it streams."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: FinishedEvent | None = None
    tool_stream: ToolCallStream | None = None  # chat: reads tool calls out of its output
    calls: list = field(default_factory=list)  # chat: the tool calls found in its output
    offset: int = 0  # completions: text_offset of its next token


class OpenAIRenderer(Renderer):
    """One request's engine events as OpenAI chunks (streaming) or one response object.

    A request for n choices streams their chunks interleaved as their tokens come, each
    marked with its choice's index; usage and [DONE] follow the last choice's finish."""

    id_prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str) -> None:
        super().__init__()
        self.tokenizer = state.engine.tokenizer
        self.model = parsed.params.adapter or state.settings.served_model_name
        self.parsed = parsed
        self.id = f"{self.id_prefix}{request_id}"
        self.created = protocol.now()
        self.choices = [Choice(i) for i in range(parsed.params.n)]

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

    def finish_reason(self, choice: Choice) -> str:
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

    def token_choice(self, choice: Choice, event: TokenEvent) -> dict[str, Any]:
        raise NotImplementedError

    def final_choices(self, choice: Choice) -> list[dict[str, Any]]:
        raise NotImplementedError

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


# -- /v1/models ----------------------------------------------------------------------------


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    """The base model's card, or an adapter's, which names the base as its parent."""
    served = state.settings.served_model_name
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "gapless",
        "max_model_len": state.description.context_length,
    }
    return card if name == served else card | {"parent": served}


async def list_models(state: ServerState, request: Request) -> Response:
    names = (state.settings.served_model_name, *state.engine.admission.adapters)
    return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in names]})


async def get_model(state: ServerState, request: Request) -> Response:
    name = request.path_params["model"]
    check_model(state, {"model": name}, adapters=True)
    if name not in state.engine.admission.adapters:
        name = state.settings.served_model_name  # its Ollama name too
    return JSONResponse(_model_card(state, name))


ROUTES = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
]
