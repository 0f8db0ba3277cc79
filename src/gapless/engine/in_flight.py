"""A pipeline's steps in flight: launched over its stages and not yet completed. While a
request is in one, its KV is being written, so the scheduler neither preempts it nor plans
its next decode; only a prompt whose chunks in flight do not complete it gets another chunk,
which starts past them (Request.num_in_flight)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gapless.engine.plan import ScheduledChunk, StepPlan
from gapless.engine.request import Request


@dataclass
class LaunchedStep:
    """A pipeline's step launched and not yet completed."""

    plan: StepPlan
    rows: Callable[[], list[tuple[ScheduledChunk, torch.Tensor]]]  # waits for the last stage
    features: list[float]  # the cost model's, taken at launch
    started: float

    def requests(self) -> set[Request]:
        """Every request whose state the step's update moves: its chunks' and their forks'."""
        forks = [child for f in self.plan.forks for child in (*f.children, *f.waiting)]
        return {c.request for c in self.plan.chunks} | set(forks)


class StepsInFlight:
    """Which requests the steps in flight hold, and those cancelled meanwhile."""

    def __init__(self) -> None:
        self.held: collections.Counter[Request] = collections.Counter()  # steps holding each
        # Cancelled while in flight: planned nothing more, ended when their last step lands.
        self.cancelled: set[Request] = set()
        # Prompt chunks launched while the prompt's chunk before was in flight (/metrics): how
        # often a prompt fills the pipeline's stages rather than one micro-batch at a time.
        self.prompt_chunks_overlapped = 0

    def __contains__(self, request: Request) -> bool:
        return request in self.held

    def any_decoding(self) -> bool:
        """Whether a decode is in flight: a micro-batch beside it is not an idle step."""
        return any(r.is_decoding for r in self.held)

    def launched(self, plan: StepPlan, requests: set[Request]) -> None:
        """The plan's step launched over these requests (its chunks' and forks'): none is
        preempted or decodes until it lands, and a prompt's next chunk starts past this
        one's tokens."""
        self.held.update(requests)
        for chunk in plan.chunks:
            # Only a prompt's chunk is planned while its request has tokens in flight.
            self.prompt_chunks_overlapped += chunk.request.num_in_flight > 0
            chunk.request.num_in_flight += chunk.num_tokens

    def cancel(self, request: Request) -> bool:
        """Whether the cancelled request has a step in flight, which still writes its blocks:
        then it is planned nothing more, and ends when its last step lands (landed)."""
        if request not in self.held:
            return False
        self.cancelled.add(request)
        return True

    def landed(self, plan: StepPlan, requests: set[Request]) -> list[Request]:
        """The launched step completed (before its update books it, or dropped). Returns the
        requests cancelled in flight that no step in flight holds any more: they end now."""
        self.held -= collections.Counter(requests)
        for chunk in plan.chunks:
            chunk.request.num_in_flight -= chunk.num_tokens
        ended = [r for r in self.cancelled if r not in self.held]
        self.cancelled.difference_update(ended)
        return ended
