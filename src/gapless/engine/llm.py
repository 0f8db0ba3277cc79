"""Offline batch generation, in the shape users know from vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    # Per prompt position: None for the first, then the actual token's logprob (+ top-k).
    prompt_logprobs: list[TokenLogprob | None] | None
    cached_prompt_tokens: int


class LLM:
    """`LLM(path, **options).generate(prompts, params)` or `.embed(prompts)`; options as
    EngineConfig.of takes them (engine/options.py lists where they are declared).

    Under tensor parallelism its worker ranks are processes, its own: `close()` ends them, as
    does leaving a `with LLM(...) as llm:` block, garbage collection, or this process's exit,
    and never another LLM's (two may be alive at once, and `llm = LLM(...)` may rebind)."""

    def __init__(self, model: str | Path, **options: Any) -> None:
        """Loads the model, then runs the largest step it can schedule once, as `gapless
        serve` does at start (Engine.reserve_peak_memory): the first long prompt then runs
        as fast here as in a server."""
        self.engine = Engine.from_pretrained(model, EngineConfig.of(**options))
        self.engine.reserve_peak_memory()
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def embed(
        self, prompts: str | list[str] | list[list[int]], pooling: str | None = None
    ) -> list[list[float]]:
        """One L2-normalized vector per prompt: the hidden states after the final norm, pooled
        as `pooling` says (default: the `pooling` option, `last` unless set)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        rid = self.engine.add_embedding(list(prompts), pooling=pooling)
        vectors: dict[int, list[float]] = {}
        while len(vectors) < len(prompts):
            for event in self.engine.step():
                if isinstance(event, FinishedEvent) and event.request_id == rid:
                    if event.embedding is None:
                        raise RuntimeError(f"request {rid} failed: {event.error}")
                    vectors[event.index] = event.embedding
        return [vectors[i] for i in range(len(prompts))]

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if any(p.n > 1 for p in params):
            raise ValueError("LLM.generate returns one output per prompt: n must be 1")
        prompt_ids = [self.engine.admission.check_prompt(p) for p in prompts]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, params, strict=True)]
        asked = dict(zip(ids, zip(prompt_ids, params, strict=True), strict=True))
        outputs: dict[str, RequestOutput] = {}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprob]] = {i: [] for i in ids}
        while len(outputs) < len(ids):
            for event in self.engine.step():
                rid = event.request_id
                if isinstance(event, TokenEvent):
                    tokens[rid] += event.token_ids
                    texts[rid].append(event.text)
                    logprobs[rid] += event.logprobs or []
                elif isinstance(event, FinishedEvent):
                    if event.error:
                        raise RuntimeError(f"request {rid} failed: {event.error}")
                    outputs[rid] = RequestOutput(
                        request_id=rid,
                        prompt_token_ids=list(asked[rid][0]),
                        token_ids=tokens[rid],
                        text="".join(texts[rid]),
                        finish_reason=event.finish_reason,
                        logprobs=logprobs[rid] if asked[rid][1].logprobs is not None else None,
                        prompt_logprobs=event.prompt_logprobs,
                        cached_prompt_tokens=event.cached_prompt_tokens,
                    )
        return [outputs[i] for i in ids]
