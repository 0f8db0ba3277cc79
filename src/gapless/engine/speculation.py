"""Speculative decoding: tokens proposed for a request, verified in the step's one forward.

A decoding request with k proposed tokens runs as one span of k + 1 query tokens (its last
sampled token, then the proposals) beside the step's other decodes and prompt chunks
(proposals.py picks k; a draft model's proposals are made by the engine between the
plan and the forward), and its k + 1 rows of logits are sampled in order
(sample_runs.py): row j's token is drawn exactly as a plain decode would draw it, with
the request's own generator, grammar mask, penalties and logprobs, after the tokens before
it were accepted. If that token is proposal j, the proposal is accepted and row j + 1 is
sampled; otherwise the token drawn ends the run. The proposals' rows only ever show the
target model's own distribution p, so the output is distributed exactly as without
speculation, and greedy output is the same tokens.

This is the standard rule (accept a proposal d with probability min(1, p(d) / q(d)); after a
rejection, draw from max(0, p - q) normalized) for a proposal distribution q that is a point
mass on d, as prompt lookup's is: d is accepted with probability p(d), and a rejection's token
is drawn from p with d's mass removed, renormalized. Drawing that token from p by the same
single uniform number a plain decode uses (inverse CDF, sampler.sample) and accepting d when
the draw lands on it realizes both at once: a seeded request draws the same numbers, one per
token, with speculation or without. The draft model (draft.py) proposes greedily, its argmax
given the context, so its q is a point mass too and the same rule is exact for it; a draft
that sampled its proposals would need the two-draw form of the rule.

How many tokens a request proposes follows how its proposals have fared (Speculation.limit).
"""

from __future__ import annotations

import math

# What verifying one more row costs, as a share of a decode step at batch 1: on this
# project's CPU, SmolLM2's Q4_1 file on one thread took 7.4 ms a decode and about 1.5 ms more
# a verified row (CPU time), so a row is no free ride even where the weights' bytes dominate.
ROW_COST = 0.2
# Accepted and rejected counts decay by this at each verification: about the last four
# verifications decide.
DECAY = 0.75
# A request whose proposals have stopped being worth verifying proposes one token again
# after this many decode steps without any, times the batch, in case its text has become
# predictable: so a batch as a whole probes about once in this many steps. (Per request, at
# batch 8 the probes alone put a proposal in almost every step, and sampled free generation
# ran at 0.93x.)
PROBE_EVERY = 8


class Speculation:
    """The record of one request's proposals' fate, which sets how many it proposes (its
    prompt lookup, or the engine's draft model, proposes them)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens  # the most tokens it proposes in a step
        self.accepted = 0.0  # decayed counts over recent verifications
        self.rejected = 0.0
        self._idle_steps = 0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a proposal is accepted when those before it were: the
        accepted proposals over those that were put to the test (a run ends at its first
        rejection), with one of each assumed beforehand."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def limit(self, batch: int) -> int:
        """How many tokens to propose now, beside `batch` decodes: the longest run whose last
        token is still worth its row, acceptance ** k >= worth; at 0, one token every
        PROBE_EVERY * batch steps. A step of b decodes costs about 1 + ROW_COST * (b - 1) decode
        steps at batch 1, so a row costs ROW_COST * b / (1 + ROW_COST * (b - 1)) of what the
        step's tokens cost each: a fifth at batch 1, half at batch 4, four fifths at 16."""
        worth = ROW_COST * batch / (1 + ROW_COST * (batch - 1))
        k = math.floor(math.log(worth) / math.log(self.acceptance))
        k = min(k, self.max_tokens)
        if k > 0:
            return k
        self._idle_steps += 1
        if self._idle_steps >= PROBE_EVERY * batch:
            self._idle_steps = 0
            return 1
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        """Books a verification: `accepted` of `proposed` tokens, in order."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < proposed)
