"""Rerank and score: Cohere's and Jina's rerank at /v1/rerank, /rerank and /v2/rerank, and
vLLM's /score and /v1/score, for a model that scores (query, document) pairs
(engine/scoring.py: a sequence classifier, or a yes/no reranker served with --reranker).

Each pair is a sequence of one engine request: it prefills in chunks beside the running
decodes like an embedding's prompt, then ends with its score (Engine.add_score). A rerank's
pairs share their query's prefix, which is prefilled once and served to the others by the
prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gapless.engine.engine import NOT_A_SCORER, Engine
from gapless.engine.events import FinishedEvent
from gapless.server.endpoint import PrefillOnlyRenderer, ServerState, embed, read_json
from gapless.server.openai_common import check_model
from gapless.server.openai_embeddings import BATCH_CONTEXTS, MAX_INPUTS, check_prompts
from gapless.server.protocol import APIError, bool_field, int_field, invalid, now

# The request's name for the engine's prompt: a pair's refusal names the document (rerank).
RERANK_FIELDS = {"prompt": "documents"}
SCORE_FIELDS = {"prompt": "text_2"}


@dataclass
class ParsedPairs:
    """A rerank or score request's pairs, as prompt ids, and what its response shows."""

    prompts: list[list[int]]
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False


def _text(value: Any, param: str, objects: bool = False) -> str:
    """A text field: a string, or (a rerank's documents) an object with a string `text`."""
    if objects and isinstance(value, dict):
        value = value.get("text")
        param = f"{param}.text"
    if not isinstance(value, str):
        shape = "a string or an object with a string text" if objects else "a string"
        raise invalid(f"{param} must be {shape}", param)
    return value


def _texts(body: dict[str, Any], param: str, objects: bool = False) -> list[str]:
    """A non-empty list of texts (or one text, as a list of one where a list may be sent)."""
    value = body.get(param)
    if value is None:
        raise invalid(f"{param} is required", param)
    if not isinstance(value, list):
        return [_text(value, param, objects)]
    if not value:
        raise invalid(f"{param} is empty: send at least one text", param)
    if len(value) > MAX_INPUTS:
        raise invalid(f"{param} may hold at most {MAX_INPUTS} texts, got {len(value)}", param)
    return [_text(item, f"{param}[{i}]", objects) for i, item in enumerate(value)]


def _pairs(engine: Engine, queries: list[str], documents: list[str], param: str) -> list[list[int]]:
    """Each (query, document) pair's prompt ids, checked as an embedding's prompt; a refusal
    (a pair longer than the context) names the document's field."""
    scorer, admission = engine.scorer, engine.admission
    assert scorer is not None  # _check_scores refused the request otherwise
    for query, document in zip(queries, documents, strict=True):
        admission.check_length(len(query) + len(document))  # before tokenizing a huge one
    ids = [scorer.pair(admission.tokenizer, q, d) for q, d in zip(queries, documents, strict=True)]
    return check_prompts(ids, admission, param)  # type: ignore[arg-type]


def parse_rerank(body: dict[str, Any], engine: Engine) -> ParsedPairs:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise invalid("query is required: a non-empty string", "query")
    documents = _texts(body, "documents", objects=True)
    top_n = int_field(body, "top_n")
    if top_n is not None and top_n < 1:
        raise invalid(f"top_n must be at least 1, got {top_n}", "top_n")
    return_documents = bool_field(body, "return_documents") or False
    prompts = _pairs(engine, [query] * len(documents), documents, "documents")
    return ParsedPairs(prompts, documents, top_n, return_documents)


def parse_score(body: dict[str, Any], engine: Engine) -> ParsedPairs:
    """vLLM's pairings: text_1 and text_2 each a string or a list; one text_1 against every
    text_2 (1:1, 1:N), or the two lists zipped (N:N)."""
    firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise invalid(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1 for "
            "any number of text_2, or as many of each (pairs are 1:1, 1:N or N:N)",
            "text_2",
        )
    return ParsedPairs(_pairs(engine, firsts, seconds, "text_2"), seconds)


class _PairsRenderer(PrefillOnlyRenderer):
    """The pairs' scores, in the order of the pairs, once all are computed."""

    def __init__(self, state: ServerState, parsed: ParsedPairs, request_id: str) -> None:
        super().__init__()
        self.model = state.settings.served_model_name
        self.parsed = parsed
        self.request_id = request_id

    def scores(self) -> list[float]:
        return self.results("score", "scores")


class _RerankRenderer(_PairsRenderer):
    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        parsed = self.parsed
        ranked = sorted(enumerate(self.scores()), key=lambda pair: -pair[1])
        results = []
        for index, score in ranked[: parsed.top_n]:
            result: dict[str, Any] = {"index": index, "relevance_score": score}
            if parsed.return_documents:
                result["document"] = {"text": parsed.documents[index]}
            results.append(result)
        return {
            "id": f"rerank-{self.request_id}",
            "model": self.model,
            "results": results,
            "usage": {"total_tokens": self.prompt_tokens},
        }


class _ScoreRenderer(_PairsRenderer):
    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        tokens = self.prompt_tokens
        return {
            "id": f"score-{self.request_id}",
            "object": "list",
            "created": now(),
            "model": self.model,
            "data": [
                {"index": i, "object": "score", "score": score}
                for i, score in enumerate(self.scores())
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }


def _check_scores(state: ServerState) -> None:
    if state.engine.scorer is None:
        raise APIError(400, NOT_A_SCORER, param="model", code="model_cannot_score")


async def rerank(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request, BATCH_CONTEXTS)
    check_model(state, body)
    _check_scores(state)
    parse = partial(parse_rerank, body, state.engine)
    renderer = partial(_RerankRenderer, state)
    return await embed(state, RERANK_FIELDS, parse, renderer, score=True)


async def score(state: ServerState, request: Request) -> Response:
    body = await read_json(state, request, BATCH_CONTEXTS)
    check_model(state, body)
    _check_scores(state)
    parse = partial(parse_score, body, state.engine)
    return await embed(state, SCORE_FIELDS, parse, partial(_ScoreRenderer, state), score=True)


ROUTES = [
    *(("POST", path, rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
    ("POST", "/score", score),
    ("POST", "/v1/score", score),
]
