"""OpenAI's /v1/embeddings: a text or token-id input, or a batch of either, as one vector each
(the engine's pooling of the final hidden states, L2-normalized), as floats or as base64.

Each input is a sequence of one engine request: it prefills in chunks beside the running
decodes like any prompt, then ends without sampling (Engine.add_embedding).
"""

from __future__ import annotations

import array
import base64
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gapless.engine.admission import Admission, RequestError
from gapless.engine.events import FinishedEvent
from gapless.server.endpoint import (
    EmbeddingRenderer,
    EngineResponse,
    ServerState,
    embed,
    read_json,
)
from gapless.server.openai_common import check_model
from gapless.server.protocol import int_field, invalid, is_int, str_field

# Inputs one request may hold, as OpenAI allows.
MAX_INPUTS = 2048
# A batch's body may hold the JSON values of this many full contexts (endpoint.read_json).
BATCH_CONTEXTS = 32
ENCODING_FORMATS = ("float", "base64")
# The request's name for the engine's prompt.
FIELD_NAMES = {"prompt": "input"}


@dataclass
class ParsedEmbeddings:
    prompts: list[list[int]]
    encoding_format: str


def inputs(body: dict[str, Any], param: str = "input") -> list[str | list[int]]:
    """`input`: a string, a list of token ids, or a non-empty list of either, as prompts."""
    value = body.get(param)
    shapes = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid(f"{param} is required: {shapes}", param)
    if not value:
        raise invalid(f"{param} is empty: send {shapes}", param)
    if all(is_int(t) for t in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise invalid(f"{param} may hold at most {MAX_INPUTS} inputs, got {len(value)}", param)
    for i, item in enumerate(value):
        is_ids = isinstance(item, list) and all(is_int(t) for t in item)
        if not (isinstance(item, str) or is_ids):
            raise invalid(f"{param}[{i}] must be a string or a list of token ids", f"{param}[{i}]")
    return value


def check_prompts(
    prompts: list[str | list[int]], admission: Admission, param: str, truncate: bool = False
) -> list[list[int]]:
    """Each input's ids, checked as an embedding's prompt (it may fill the context); a
    refusal names the input (`input[2]`) when there are several."""
    checked = []
    for i, prompt in enumerate(prompts):
        try:
            checked.append(admission.check_prompt(prompt, output=False, truncate=truncate))
        except RequestError as e:
            name = param if len(prompts) == 1 else f"{param}[{i}]"
            raise RequestError(str(e), name, e.code) from e
    return checked


def check_dimensions(body: dict[str, Any], width: int) -> None:
    """`dimensions` may only name the model's own width: shortening a vector helps only a
    model trained for it (Matryoshka), which a decoder's hidden states are not."""
    dimensions = int_field(body, "dimensions")
    if dimensions is not None and dimensions != width:
        raise invalid(
            f"dimensions must be {width}, this model's embedding width, or absent; got "
            f"{dimensions} (its embeddings cannot be shortened)",
            "dimensions",
        )


def parse_embeddings(body: dict[str, Any], admission: Admission, width: int) -> ParsedEmbeddings:
    encoding_format = str_field(body, "encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise invalid(
            f"encoding_format must be float or base64, got {encoding_format!r}", "encoding_format"
        )
    check_dimensions(body, width)
    return ParsedEmbeddings(check_prompts(inputs(body), admission, "input"), encoding_format)


def as_base64(vector: list[float]) -> str:
    """Little-endian float32, base64-encoded, as the openai client decodes it."""
    packed = array.array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


class _EmbeddingsRenderer(EmbeddingRenderer):
    def __init__(self, state: ServerState, parsed: ParsedEmbeddings, request_id: str) -> None:
        super().__init__()
        self.model = state.settings.served_model_name
        self.parsed = parsed

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        encode = as_base64 if self.parsed.encoding_format == "base64" else list
        data = [
            {"object": "embedding", "index": i, "embedding": encode(vector)}
            for i, vector in enumerate(self.vectors())
        ]
        tokens = self.prompt_tokens
        return {
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


async def embeddings(state: ServerState, request: Request) -> Response:
    return await respond(state, await read_json(state, request, BATCH_CONTEXTS))


async def respond(state: ServerState, body: dict[str, Any]) -> EngineResponse:
    """The response to an embedding request's body: the endpoint's, or a batch job line's
    (batch_jobs.py)."""
    check_model(state, body)
    width = state.engine.decoder.config.hidden_size
    parse = partial(parse_embeddings, body, state.engine.admission, width)
    return await embed(state, FIELD_NAMES, parse, partial(_EmbeddingsRenderer, state))


ROUTES = [("POST", "/v1/embeddings", embeddings)]
