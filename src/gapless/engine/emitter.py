"""What a step's results do to their requests, and the events that tell of them: progress
through a prompt, its logprobs, pooled embeddings, each sampled token, and each end."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from gapless.engine.draft import DraftModel
from gapless.engine.events import Event, FinishedEvent, ProgressEvent, TokenEvent, TokenLogprob
from gapless.engine.intake import Intake
from gapless.engine.metrics import EngineMetrics
from gapless.engine.request import Request, RequestState
from gapless.engine.sampler import top_logprobs

log = logging.getLogger("gapless.engine")


class Emitter:
    def __init__(
        self,
        eos_ids: set[int],
        max_model_len: int,
        metrics: EngineMetrics,
        intake: Intake,
        draft: DraftModel | None,
    ) -> None:
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.intake = intake
        self.draft = draft
        self._events: list[Event] = []
        # Requests ended since the scheduler last dropped the ended ones: in a step, it does
        # so when it books the step (Scheduler.update), after their computed blocks.
        self._ended: dict[Request, None] = {}

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def take_ended(self) -> list[Request]:
        """The requests ended since the last call, for the scheduler to drop."""
        ended, self._ended = list(self._ended), {}
        return ended

    def has_ended(self, req: Request) -> bool:
        return req.state is RequestState.FINISHED or req in self._ended

    def progress(self, req: Request, processed: int) -> None:
        event = ProgressEvent(req.request_id, processed, len(req.prompt_ids))
        if req.progress_callback is not None:
            req.progress_callback(event)
        self._events.append(event)

    def forked(self, req: Request) -> None:
        """The request's prompt is complete and its other choices fork from it (the plan's
        Fork): they start with its prompt logprobs, and no longer end with it."""
        for child in req.forks:
            child.prompt_logprobs = list(req.prompt_logprobs)
        req.forks = []

    def token(self, req: Request, token: int, info: TokenLogprob | None) -> None:
        """Appends a sampled token, and ends the request if the token ends it."""
        req.sampling.accept(token)
        req.output_ids.append(token)
        self._observe_token(req)
        finish = req.finish_reason(token, self.eos_ids, self.max_model_len)
        shown = None if req.is_stop_token(token, self.eos_ids) else token
        text, logprobs, stopped = req.output.render(shown, info, last=finish is not None)
        if stopped:
            finish = "stop"
        self._events.append(TokenEvent(req.request_id, [token], text, logprobs or None, req.index))
        if finish is not None:
            self.finish(req, finish)

    def _observe_token(self, req: Request) -> None:
        now = time.monotonic()
        share = req.params.service_class, req.params.tenant
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.first_token(*share, now - req.arrival_time)
        else:
            self.metrics.next_token(*share, now - req.last_token_time)
        req.last_token_time = now
        self.metrics.generation_tokens += 1

    def fail(self, req: Request, exc: Exception) -> None:
        log.error(
            "request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc
        )
        self.finish(req, "error", f"{type(exc).__name__}: {exc}")

    def finish(
        self,
        req: Request,
        reason: str,
        error: str | None = None,
        embedding: list[float] | None = None,
        score: float | None = None,
    ) -> None:
        if self.has_ended(req):
            return  # a fork already ended with the choice it waited on
        self._ended[req] = None  # the scheduler drops it (take_ended)
        if self.draft is not None:
            self.draft.release(req)
        req.finish_time = time.monotonic()
        self.intake.ended(req)
        self.metrics.finished(req.params.service_class, req.params.tenant, reason)
        self._events.append(
            FinishedEvent(
                req.request_id,
                reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                cached_prompt_tokens=req.cached_prompt_tokens,
                prompt_logprobs=req.prompt_logprobs
                if req.params.prompt_logprobs is not None
                else None,
                error=error,
                stop_string=req.output.stop_string,
                preempted=req.preemptions,
                timings=_timings(req),
                index=req.index,
                embedding=embedding,
                score=score,
            )
        )
        req.pooled = None
        # Choices still waiting to fork from this one end with it: they have no prompt KV.
        forks, req.forks = req.forks, []
        for fork in forks:
            self.finish(fork, reason, error)


def _timings(req: Request) -> dict[str, float]:
    marks = {
        "first_scheduled": req.first_scheduled_time,
        "first_token": req.first_token_time,
        "finished": req.finish_time,
    }
    return {k: v - req.arrival_time for k, v in marks.items() if v is not None}


def record_prompt_logprobs(req: Request, start: int, rows: torch.Tensor) -> None:
    """The logprobs of a prompt chunk's tokens (from start), from its rows' logits."""
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)  # the first token has no context
    logprobs = rows.log_softmax(-1)
    k = req.params.prompt_logprobs or 0
    for offset in range(len(rows)):
        target = start + offset + 1
        if target >= len(req.prompt_ids) or target < len(req.prompt_logprobs):
            continue
        req.prompt_logprobs.append(top_logprobs(logprobs[offset], req.prompt_ids[target], k))


def pool(req: Request, start: int, hidden: torch.Tensor) -> None:
    """Books an embedding chunk's hidden state (runner.execute): the last token's, or (mean)
    the sum of the chunk's, added to the sum so far. A mean-pooled prompt reads no prefix
    cache, so it always starts again from its first token (after a preemption too)."""
    if req.pooling == "mean" and start > 0:
        req.pooled = req.pooled + hidden
    else:
        req.pooled = hidden


def embedding(req: Request) -> list[float]:
    pooled = req.pooled
    if req.pooling == "mean":
        pooled = pooled / len(req.prompt_ids)
    return F.normalize(pooled, dim=-1).tolist()
