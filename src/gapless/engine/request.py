"""A request's state as the engine runs it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gapless.engine.events import ProgressEvent, TokenLogprob
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.stopping import StopStringFilter

if TYPE_CHECKING:
    from gapless.engine.sampler import TokenCounts
    from gapless.engine.structured import GrammarMatcher


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    PREFILLING = "prefilling"  # admitted, part of its tokens computed
    DECODING = "decoding"  # one uncomputed token: the last one sampled
    FINISHED = "finished"


# eq=False: requests are compared by identity; two requests are never the same by value.
@dataclass(eq=False)
class Request:
    request_id: str  # shared by a request's n choices
    prompt_ids: list[int]
    params: SamplingParams
    progress_callback: Callable[[ProgressEvent], None] | None = None
    # submit() and the no-chunking baseline: prefill the whole prompt in one step.
    whole_prefill: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0  # the scheduler's step count when it was queued, for aging
    index: int = 0  # which of the request's n choices

    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens (prompt, then output) whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)  # -1: released, outside the window
    block_hashes: list[int] = field(default_factory=list)  # of full computed blocks
    num_registered: int = 0  # blocks of block_table already offered to the prefix cache
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    admitted_seq: int = -1  # admission order, for choosing preemption victims
    generator: torch.Generator | None = None
    token_counts: TokenCounts | None = None  # made by the sampler for penalised requests
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    detokenizer: object | None = None
    stop_filter: StopStringFilter | None = None
    matcher: GrammarMatcher | None = None
    # The other choices, until this one's prompt is computed and they share its KV blocks.
    forks: list[Request] = field(default_factory=list)

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.state is RequestState.DECODING

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start .. end of prompt + output, without copying either whole."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]
