"""OpenAI's legacy /v1/completions: a text or token-id prompt, engine events as
text_completion chunks or one text_completion, with the prompt echoed and its logprobs on
request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gapless.engine.admission import Admission, CheckedPrompt
from gapless.engine.events import TokenEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.structured import GrammarCompiler
from gapless.model.tokenizer import Tokenizer
from gapless.server.endpoint import (
    EngineResponse,
    FieldNames,
    ServerState,
    generate,
    read_json,
)
from gapless.server.openai_common import (
    Choice,
    OpenAIRenderer,
    ParsedRequest,
    check_model,
    logprob,
    max_tokens_name,
    sampling_fields,
)
from gapless.server.protocol import bool_field, int_field, invalid, is_int, str_field

# A completion's id is this and the request's id.
ID_PREFIX = "cmpl-"


# -- requests ------------------------------------------------------------------------------


@dataclass
class ParsedCompletion(ParsedRequest):
    # echo the prompt text (and its logprobs when logprobs is set)
    echo: bool = False
    prompt_text: str = ""


def field_names(body: dict[str, Any]) -> FieldNames:
    """The request's names for the engine's fields."""
    return {"max_tokens": max_tokens_name(body)}


def _prompt(body: dict[str, Any], admission: Admission) -> tuple[CheckedPrompt, str]:
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
        return admission.check_prompt(prompt), prompt
    if isinstance(prompt, list) and all(is_int(t) for t in prompt):
        ids = admission.check_prompt(prompt)
        # As a string prompt echoes its special tokens, so does a token-id prompt.
        return ids, admission.tokenizer.decode(ids, skip_special_tokens=False)
    raise invalid(
        "prompt must be a string, a list of token ids, or a list of one of those", "prompt"
    )


def parse_completion(
    body: dict[str, Any], admission: Admission, grammars: GrammarCompiler
) -> ParsedCompletion:
    prompt_ids, prompt_text = _prompt(body, admission)
    fields, stream, include_usage = sampling_fields(body, admission, len(prompt_ids), grammars)
    echo = bool(bool_field(body, "echo"))
    logprobs = int_field(body, "logprobs")
    if echo and logprobs is not None and stream:
        raise invalid("echo with logprobs is supported only without streaming", "echo")
    fields["logprobs"] = logprobs
    if echo and logprobs is not None:
        fields["prompt_logprobs"] = logprobs
    return ParsedCompletion(
        str_field(body, "model"),
        prompt_ids,
        SamplingParams(**fields),
        stream,
        include_usage,
        logprobs,
        echo,
        prompt_text,
    )


# -- rendering engine events ---------------------------------------------------------------


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
            token_id, value, top = prompt_ids[index], None, None
        else:
            token_id, value, alternatives = entry
            value = logprob(value)
            top = {tokenizer.token_text(i): logprob(lp) for i, lp in alternatives}
        text = tokenizer.token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class _CompletionRenderer(OpenAIRenderer):
    id_prefix = ID_PREFIX
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, parsed: ParsedCompletion, request_id: str) -> None:
        super().__init__(state, parsed, request_id)
        # Generated tokens' text_offset points into prompt + completion text.
        for choice in self.choices:
            choice.offset = len(parsed.prompt_text)

    def _logprobs(self, choice: Choice, entries: list) -> dict[str, Any] | None:
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

    def token_choice(self, choice: Choice, event: TokenEvent) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": event.text,
            "logprobs": self._logprobs(choice, event.logprobs or []),
            "finish_reason": None,
        }

    def final_choices(self, choice: Choice) -> list[dict[str, Any]]:
        final = {"index": choice.index, "text": "", "logprobs": None}
        return [{**final, "finish_reason": self.finish_reason(choice)}]

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
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


# -- endpoint -------------------------------------------------------------------------------


async def completions(state: ServerState, request: Request) -> Response:
    return await respond(state, await read_json(state, request))


async def respond(state: ServerState, body: dict[str, Any]) -> EngineResponse:
    """The response to a completion request's body: the endpoint's, or a batch job line's
    (batch_jobs.py)."""
    check_model(state, body, adapters=True)
    parse = partial(parse_completion, body, state.engine.admission, state.engine.grammars)
    return await generate(state, field_names(body), parse, partial(_CompletionRenderer, state))


ROUTES = [("POST", "/v1/completions", completions)]
