"""Turns each sequence's logits into its next token, per its own SamplingParams."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.engine.events import TokenLogprob
from gapless.engine.sampling_params import SamplingParams

log = logging.getLogger("gapless.engine")

if TYPE_CHECKING:
    from gapless.engine.structured import GrammarMatcher


class TokenCounts:
    """A penalised request's tokens as counts over the vocabulary, updated as tokens are
    accepted: penalties then cost one pass over the vocabulary per step, however long the
    prompt and the output grow."""

    def __init__(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int, device: torch.device
    ) -> None:
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        self.output = torch.zeros(vocab, dtype=torch.int32, device=device)
        for token in output_ids:
            self.add(token)

    def add(self, token: int) -> None:
        self.output[token] += 1


@dataclass
class SamplingState:
    """What sampling a request's next token reads, made with the request. sample() changes
    none of it but the seeded generator, so a failed call can be retried; accept() advances
    it by the token chosen."""

    params: SamplingParams
    generator: torch.Generator | None = None  # seeded requests: their own draws
    counts: TokenCounts | None = None  # penalised requests
    matcher: GrammarMatcher | None = None  # requests under a grammar

    @property
    def penalised(self) -> bool:
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)

    def accept(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.accept(token)
        if self.counts is not None:
            self.counts.add(token)


def apply_penalties(
    logits: torch.Tensor, counts: TokenCounts, presence: float, frequency: float, repetition: float
) -> torch.Tensor:
    """CTRL-style repetition penalty over prompt and generated tokens (divide positive
    logits, multiply negative), then OpenAI frequency and presence penalties over generated
    tokens; the order vLLM uses."""
    generated = counts.output > 0
    if repetition != 1.0:
        seen = counts.in_prompt | generated
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if presence or frequency:
        logits = logits - (presence * generated + frequency * counts.output)
    return logits


def top_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    alternatives: list[tuple[int, float]] = []
    if k:
        values, ids = logprobs.topk(k)
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return (token_id, float(logprobs[token_id]), alternatives)


# Top-k/top-p thresholds come from each row's CANDIDATES largest probabilities; a row whose
# nucleus is wider than that (a near-uniform distribution) falls back to a full sort.
CANDIDATES = 1024


def sampling_thresholds(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per row, the smallest probability a token needs to survive top-k, top-p and min-p.

    top-p is taken over the top-k-renormalised distribution, then min-p applies, as vLLM
    does. Tokens tied with the threshold all survive.
    """
    rows, vocab = probs.shape
    dev = probs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    head = min(vocab, max(CANDIDATES, *(p.top_k for p in params)))
    values = probs.topk(head, dim=-1).values  # sorted, descending
    k = top_k.clamp(max=head)
    kept = torch.arange(head, device=dev)[None, :] < k[:, None]
    in_k = values * kept
    # Rows without top-k keep their whole mass even where it extends past the head.
    mass = torch.where(top_k < vocab, in_k.sum(-1), torch.ones_like(top_p))
    cumulative = in_k.cumsum(-1) / mass[:, None]
    last = (cumulative < top_p[:, None]).sum(-1).clamp(max=head - 1)
    threshold = values.gather(1, (k - 1)[:, None]).squeeze(1)
    nucleus = top_p < 1
    threshold = torch.where(nucleus, values.gather(1, last[:, None]).squeeze(1), threshold)
    wide = torch.nonzero(nucleus & (cumulative[:, -1] < top_p)).flatten()
    if len(wide):
        ordered = probs[wide].sort(dim=-1, descending=True).values
        cut = (ordered.cumsum(-1) < top_p[wide, None]).sum(-1).clamp(max=vocab - 1)
        threshold[wide] = ordered.gather(1, cut[:, None]).squeeze(1)
    return torch.maximum(threshold, min_p * values[:, 0])


def sample(
    states: list[SamplingState], logits: torch.Tensor
) -> list[tuple[int, TokenLogprob | None]]:
    """One token per row of logits [B, vocab] (float32), with its logprobs when asked for.

    Batched: one pass for all greedy rows, one for all sampled rows. A sampled row draws a
    single uniform number from its request's generator (inverse-CDF sampling), so a seeded
    request's draws do not depend on what else shares the batch (its logits still can, in
    the last bits: docs/server.md, "Seeds").

    A request under a grammar has the tokens it forbids masked out first; the other rows are
    untouched. Logprobs are the model's own, before masks and penalties.
    """
    raw = logits
    logits = apply_grammars(states, logits)
    penalised = [i for i, state in enumerate(states) if state.counts is not None]
    if penalised:
        if logits is raw:
            logits = logits.clone()
        for i in penalised:
            p = states[i].params
            logits[i] = apply_penalties(
                logits[i],
                states[i].counts,
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            )
    choices = logits.argmax(-1)
    sampled = [i for i, state in enumerate(states) if not state.params.greedy]
    if sampled:
        params = [states[i].params for i in sampled]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = (logits[sampled] / temperature[:, None]).softmax(-1)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            # The thresholds cost a top-1024 per row: only when some row filters at all.
            probs = probs * (probs >= sampling_thresholds(probs, params)[:, None])
        cdf = probs.cumsum(-1)
        draws = torch.cat([torch.rand(1, generator=states[i].generator) for i in sampled])
        targets = (draws.to(cdf.device) * cdf[:, -1])[:, None]
        picked = torch.searchsorted(cdf, targets, right=True).clamp(max=cdf.shape[1] - 1)
        choices[sampled] = picked.squeeze(1)
    tokens = choices.tolist()
    results: list[tuple[int, TokenLogprob | None]] = []
    for i, state in enumerate(states):
        info = None
        if state.params.logprobs is not None:
            info = top_logprobs(raw[i].log_softmax(-1), tokens[i], state.params.logprobs)
        results.append((tokens[i], info))
    return results


def apply_grammars(states: list[SamplingState], logits: torch.Tensor) -> torch.Tensor:
    """The logits with each constrained row's forbidden tokens at -inf; the same tensor when
    no row is constrained."""
    constrained = [i for i, state in enumerate(states) if state.matcher is not None]
    if not constrained:
        return logits
    logits = logits.clone()
    for i in constrained:
        allowed = states[i].matcher.allowed().to(logits.device)
        logits[i].masked_fill_(~allowed, float("-inf"))
    return logits


def sample_each(
    states: list[SamplingState], logits: torch.Tensor
) -> list[tuple[int, TokenLogprob | None] | Exception]:
    """sample(), with each row's failure its own: every row at once, and if that fails, row by
    row, a row that fails alone getting its exception in its place. Seeded generators are
    rewound first, so the retried rows draw the same numbers they would have drawn in the
    batch."""
    rewind = [s.generator.get_state() if s.generator is not None else None for s in states]
    try:
        return list(sample(states, logits))
    except Exception:
        if len(states) > 1:
            log.exception("sampling %d rows failed: sampling them one at a time", len(states))
    results: list[tuple[int, TokenLogprob | None] | Exception] = []
    for row, (state, generator_state) in enumerate(zip(states, rewind, strict=True)):
        if generator_state is not None:
            state.generator.set_state(generator_state)
        try:
            [result] = sample([state], logits[row : row + 1])
        except Exception as exc:
            result = exc
        results.append(result)
    return results
