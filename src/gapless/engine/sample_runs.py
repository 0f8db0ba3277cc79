"""Sampling a step's rows: each request that samples now, its rows in order, all requests'
row j in one batch (speculation.py says why verifying proposals this way keeps the output's
distribution)."""

from __future__ import annotations

import torch

from gapless.engine.emitter import Emitter
from gapless.engine.events import TokenLogprob
from gapless.engine.metrics import EngineMetrics
from gapless.engine.plan import StepOutcome
from gapless.engine.request import Request
from gapless.engine.sampler import sample_each


def sample_runs(
    runs: list[tuple[Request, torch.Tensor, list[int]]],
    outcome: StepOutcome,
    emitter: Emitter,
    metrics: EngineMetrics,
) -> None:
    """Samples each request's rows in order, all requests' row j in one batch, and appends
    each token as it comes. A request's next row is sampled only while its tokens are its
    draft's: row j's logits saw draft[j] in the context, so they are the next token's only
    if draft[j] is what was drawn (speculation.py says why this keeps the distribution).
    The outcome gets who sampled, and each verified request's accepted proposals (whose
    K/V it keeps; the rest is dropped: Scheduler.update)."""
    rows_of = {req: rows for req, rows, _ in runs}
    draft_of = {req: draft for req, _, draft in runs}
    accepted = dict.fromkeys(draft_of, 0)
    live = list(draft_of)
    position = 0
    while live:
        sampled = _sample([(req, rows_of[req][position]) for req in live], emitter)
        live = []
        for req, token, info in sampled:
            try:
                emitter.token(req, token, info)
            except Exception as exc:
                emitter.fail(req, exc)
                continue
            if position == 0:
                outcome.sampled.append(req)
            draft = draft_of[req]
            if position < len(draft) and token == draft[position]:
                accepted[req] += 1
                if not emitter.has_ended(req):
                    live.append(req)
        position += 1
    for req, draft in draft_of.items():
        if not draft:
            continue
        req.speculation.observe(len(draft), accepted[req])
        metrics.speculative_proposed_tokens += len(draft)
        metrics.speculative_accepted_tokens += accepted[req]
        outcome.accepted[req] = accepted[req]


def _sample(
    batch: list[tuple[Request, torch.Tensor]], emitter: Emitter
) -> list[tuple[Request, int, TokenLogprob | None]]:
    """A token for each row, failing only the requests whose rows fail (sample_each)."""
    if not batch:
        return []
    reqs = [r for r, _ in batch]
    results = sample_each([r.sampling for r in reqs], torch.stack([x for _, x in batch]))
    sampled = []
    for req, result in zip(reqs, results, strict=True):
        if isinstance(result, Exception):
            emitter.fail(req, result)
        else:
            sampled.append((req, *result))
    return sampled
