"""The scheduling policies: in which order prompts get a step's prompt tokens, how tenants
share them, which decode waits under a latency target. The scheduler (scheduler.py) applies
them; each is a small object or function of its own, so a new order is one class here.

- Service classes are strict (SERVICE_CLASSES: interactive, standard, batch): a prompt never
  goes ahead of a more urgent class's, and a decode is scheduled by class, then admission
  (`precedence`); the last by precedence is the first preempted.
- Within a class, tenants take turns (FairShare), and the PrefillPolicy orders each tenant's
  prompts: `fcfs` by arrival, or `shortest` remaining prefill first, aged by steps waited so
  that no prompt starves behind its own class.
- Under per-class latency targets (LatencyTargets), the step's target is the strictest of its
  decoding classes'. Where the decodes alone would leave it less than `min_prefill_chunk`
  prompt tokens, decodes of classes with a looser target (or none) wait a step, as few as
  needed and in turns: under overload a batch stream slows down so that an interactive one
  keeps its latency. Without a stricter class decoding, nobody waits.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

from gapless.engine.plan import ScheduledChunk
from gapless.engine.request import Request
from gapless.engine.sampling_params import SERVICE_CLASSES


class PrefillPolicy:
    """Which prompt gets a step's prompt tokens first: requests go in the order of `key`,
    smallest first. A new policy is one subclass (PREFILL_POLICIES finds it)."""

    name: str
    # Whether a waiting request that does not fit yet holds back those behind it.
    head_blocks: bool = False

    def key(self, request: Request, steps: int) -> tuple[float, float]:
        raise NotImplementedError


class FirstComeFirstServed(PrefillPolicy):
    name = "fcfs"
    head_blocks = True  # keep arrival order: nobody overtakes a request that does not fit

    def key(self, request: Request, steps: int) -> tuple[float, float]:
        return (0, request.arrival_time)


class ShortestFirst(PrefillPolicy):
    """Remaining prefill first, aged so that no prompt starves."""

    name = "shortest"
    # Each step a request has waited counts as this many fewer prompt tokens: a 30k-token
    # prompt overtaken by a stream of short ones still reaches the front within ~470 steps.
    # Counted in steps, not seconds, so the order does not depend on machine speed.
    aging_tokens_per_step = 64

    def key(self, request: Request, steps: int) -> tuple[float, float]:
        waited = steps - request.arrival_step
        return (
            request.num_uncomputed - self.aging_tokens_per_step * waited,
            request.arrival_time,
        )


# Every subclass above, by name: --prefill-policy's choices.
PREFILL_POLICIES: dict[str, PrefillPolicy] = {p.name: p() for p in PrefillPolicy.__subclasses__()}


def urgency(request: Request) -> int:
    """The request's service class as a rank: 0 for the most urgent."""
    return SERVICE_CLASSES.index(request.params.service_class)


def precedence(request: Request) -> tuple[int, int]:
    """The order in which admitted requests keep their place: by class, then by admission.
    Decodes are scheduled in this order, and the last one is the first preempted."""
    return urgency(request), request.admitted_seq


def share(request: Request) -> tuple[int, str | None]:
    """What FairShare counts a request's tokens against: its class and tenant."""
    return urgency(request), request.params.tenant


class FairShare:
    """Within a service class, tenants (SamplingParams.tenant) take turns at prompt tokens:
    the tenant given the fewest since its prompts began waiting goes first, and the policy
    orders its own prompts (start-time fair queuing, counted in tokens). So a tenant with 50
    queued requests gets one tenant's share, not 50, and admission to the batch follows the
    same order. A tenant whose prompts arrive while others' wait starts level with the least
    served of them: it is owed nothing for the time it had none. With one tenant (no API
    keys) the order is the policy's alone."""

    def __init__(self) -> None:
        self._given: dict[tuple[int, str | None], int] = {}  # (urgency, tenant) -> tokens

    def order(self, candidates: list[Request]) -> None:
        """Forgets the tenants with nothing waiting, and starts those new to the queue."""
        waiting = {share(r) for r in candidates}
        given = {k: n for k, n in self._given.items() if k in waiting}
        for new in waiting - given.keys():
            level = [n for (rank, _), n in given.items() if rank == new[0]]
            given[new] = min(level, default=0)
        self._given = given

    def key(self, request: Request) -> int:
        return self._given[share(request)]

    def give(self, request: Request, tokens: int) -> None:
        self._given[share(request)] += tokens


def over_share(
    request: Request, running: list[Request], preemptible: list[Request]
) -> Request | None:
    """Within a class, decode slots are shared between tenants too: the latest admitted
    preemptible request of the tenant running the most of the waiting request's class, when
    it runs at least two more than the waiting request's tenant (so that the preempted tenant
    does not take the slot straight back). None when no tenant runs more than its share."""
    mine = share(request)
    counts = collections.Counter(share(r) for r in running)
    fullest = max((s for s in counts if s[0] == mine[0]), key=counts.__getitem__, default=None)
    if fullest is None or counts[fullest] < counts[mine] + 2:
        return None
    return max((r for r in preemptible if share(r) == fullest), key=precedence, default=None)


def fresh_tokens(tokens: int, start: int) -> float:
    """A chunk's work counted in its tokens, wherever it starts."""
    return tokens


def affordable(work: Callable[[int, int], float], start: int, budget: float, first: bool) -> int:
    """The most prompt tokens from `start` whose work fits in `budget`; at least one for the
    step's first prompt chunk, so that no history is too long to move."""
    # Every count above hi costs more than the budget, and lo fits (a token's work is >= 1).
    lo, hi = 0, max(0, math.floor(budget))
    while lo < hi and work(hi, start) > budget:
        mid = (lo + hi + 1) // 2
        if work(mid, start) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return max(hi, 1 if first else 0)


def is_urgent(prompt: Request, decodes: list[ScheduledChunk]) -> bool:
    """Whether the prompt is as urgent as every decode: only then does it take a step's room
    from a decode, or the guaranteed min_prefill_chunk beyond the step's target."""
    return all(urgency(prompt) <= urgency(c.request) for c in decodes)


@dataclass
class LatencyTargets:
    """Per-class inter-token latency targets (EngineConfig.latency_targets) and the cost
    model's prompt budget that meets them: `prefill_budget(contexts, start, target)`, the
    prompt tokens that fit in `target` seconds beside decodes at these contexts, the first
    prompt chunk starting at `start`."""

    itl: dict[str, float]
    prefill_budget: Callable[[list[int], int, float], int]
    min_prefill_chunk: int

    def step_target(self, decodes: list[ScheduledChunk]) -> float | None:
        """The step's target: the strictest of its decodes' classes' (None when none of them
        has one: the static chunk budget)."""
        classes = {c.request.params.service_class for c in decodes}
        return min((self.itl[c] for c in classes & self.itl.keys()), default=None)

    def defer(
        self,
        decodes: list[ScheduledChunk],
        target: float,
        start: int,
        prompt: Request | None,
    ) -> list[ScheduledChunk]:
        """The step's decodes, less those of classes with a looser target than the step's (or
        none) that must wait a step for the step to meet it: as few as leave the decodes
        within the target and, when the first waiting prompt is more urgent than some of
        them, as few of those as leave it min_prefill_chunk tokens beside them. A decode never
        waits for a prompt of its own class or a less urgent one: a batch stream does not stop
        for a batch prompt. The least urgent wait first, and within a class those given a
        token most recently, so that they take turns."""
        deferrable = [
            c for c in decodes if self.itl.get(c.request.params.service_class, math.inf) > target
        ]
        if not deferrable:
            return decodes
        # Of streams last served in the same step, the one with more tokens waits first.
        deferrable.sort(
            key=lambda c: (
                -urgency(c.request),
                -(c.request.last_token_time or 0),
                -len(c.request.output_ids),
            )
        )

        def fewest(candidates: int, need: int) -> int:
            """The fewest of deferrable[:candidates] whose wait leaves `need` prompt tokens in
            the target (all of them, if none does)."""
            lo, hi = 0, candidates
            while lo < hi:
                mid = (lo + hi) // 2
                waiting = {id(c) for c in deferrable[:mid]}
                contexts = [c.request.num_computed + 1 for c in decodes if id(c) not in waiting]
                if self.prefill_budget(contexts, start, target) >= need:
                    hi = mid
                else:
                    lo = mid + 1
            return lo

        deferred = fewest(len(deferrable), 1)
        if prompt is not None:
            below = sum(urgency(c.request) > urgency(prompt) for c in deferrable)  # a prefix
            deferred = max(deferred, fewest(below, self.min_prefill_chunk))
        waiting = {id(c) for c in deferrable[:deferred]}
        return [c for c in decodes if id(c) not in waiting]
