"""Turns each sequence's logits into its next token, per its own SamplingParams."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gapless.engine.events import TokenLogprob
from gapless.engine.request import Request


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    """CTRL-style repetition penalty over prompt and generated tokens (divide positive
    logits, multiply negative), then OpenAI frequency and presence penalties over generated
    tokens; the order vLLM uses."""
    logits = logits.clone()
    if repetition != 1.0:
        seen = torch.tensor(list(set(prompt_ids) | set(output_ids)), device=logits.device)
        if len(seen):
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
    if output_ids and (presence or frequency):
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= presence + frequency * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Masks tokens outside top-k, the top-p nucleus and the min-p floor with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep a token if the mass before it is still under top_p (the top token always stays).
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    alternatives: list[tuple[int, float]] = []
    if k:
        values, ids = logprobs.topk(k)
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return (token_id, float(logprobs[token_id]), alternatives)


def sample(requests: list[Request], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
    """One token per row of logits [B, vocab] (float32), with its logprobs when asked for.

    Each seeded request draws from its own generator, so its tokens do not depend on which
    other requests share the batch.
    """
    greedy_rows = [i for i, r in enumerate(requests) if r.params.greedy and not _penalised(r)]
    plain_greedy = set(greedy_rows)
    choices: list[int] = [0] * len(requests)
    if greedy_rows:
        picked = logits[greedy_rows].argmax(-1).tolist()
        for i, token in zip(greedy_rows, picked, strict=True):
            choices[i] = token
    for i, req in enumerate(requests):
        if i in plain_greedy:
            continue
        p = req.params
        row = apply_penalties(
            logits[i],
            req.prompt_ids,
            req.output_ids,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        if p.greedy:
            choices[i] = int(row.argmax())
            continue
        row = filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = row.softmax(-1)
        choices[i] = int(torch.multinomial(probs, 1, generator=req.generator))
    results: list[tuple[int, TokenLogprob | None]] = []
    for i, req in enumerate(requests):
        info = None
        if req.params.logprobs is not None:
            info = top_logprobs(logits[i].log_softmax(-1), choices[i], req.params.logprobs)
        results.append((choices[i], info))
    return results


def _penalised(request: Request) -> bool:
    p = request.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
