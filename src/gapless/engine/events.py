"""What the engine emits each step, in order, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

# One sampled token's logprob and its top alternatives: (token_id, logprob, [(alt_id, alt_logprob), ...])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class ProgressEvent:
    """Prefill progress after a chunk: `processed` counts prefix-cache hits too."""

    request_id: str
    processed: int
    total: int


@dataclass
class TokenEvent:
    """New output tokens and the text they completed.

    Text can lag its token (half a UTF-8 character, or a possible stop string is held back);
    a request's last TokenEvent carries all remaining text.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's n choices


@dataclass
class FinishedEvent:
    """The last event of one choice (of an embedding request: of one of its prompts, `index`
    its position). finish_reason: stop, length, cancelled or error."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    preempted: int = 0  # times the request was preempted and recomputed
    timings: dict[str, float] = field(default_factory=dict)
    index: int = 0  # which of the request's n choices; the request ends when all n have
    # An embedding request's vector (L2-normalized), when it finished with "stop".
    embedding: list[float] | None = None
    # A score request's relevance score (engine/scoring.py), when it finished with "stop".
    score: float | None = None


Event = ProgressEvent | TokenEvent | FinishedEvent
