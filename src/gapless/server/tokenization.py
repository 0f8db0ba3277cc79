"""vLLM's /tokenize and /detokenize, at its paths, with OpenAI's error shape."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.engine.admission import Admission
from gapless.server import tool_calls
from gapless.server.endpoint import ServerState, admission_errors, parse_off_loop, read_json
from gapless.server.images import ImageReader
from gapless.server.openai_chat import chat_prompt
from gapless.server.openai_common import check_model
from gapless.server.protocol import bool_field, int_list_field, invalid, str_field


def _tokenize(body: dict[str, Any], admission: Admission, reader: ImageReader) -> list[int]:
    """A `prompt`, or `messages` through the chat template (each image as the run of tokens
    it takes in the prompt)."""
    if "messages" in body:
        add_generation_prompt = bool_field(body, "add_generation_prompt")
        tools = tool_calls.parse_tools(body)
        ids, images = chat_prompt(
            body, admission, reader, tools, add_generation_prompt is not False
        )
        return admission.expand_images(ids, images)
    prompt = str_field(body, "prompt")
    if prompt is None:
        raise invalid("send a `prompt` string or `messages`", "prompt")
    return admission.encode(prompt, bool_field(body, "add_special_tokens") is not False)


async def tokenize(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request)
    check_model(state, body)
    names = {"prompt": "messages"} if "messages" in body else {}
    parse = partial(_tokenize, body, state.engine.admission, state.settings.image_reader)
    ids = await parse_off_loop(names, parse)
    tokenizer = state.engine.tokenizer
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
    ids = int_list_field(body, "tokens")
    with admission_errors():
        state.engine.admission.check_token_ids(ids, "tokens")
    # As vLLM (and transformers' decode): special tokens stay, so a round trip is exact.
    return JSONResponse({"prompt": state.engine.tokenizer.decode(ids, skip_special_tokens=False)})


ROUTES = [
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]
