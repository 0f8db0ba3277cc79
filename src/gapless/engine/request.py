"""A request's state as the engine runs it, grouped by who writes it:
- the scheduler owns its KV state: state, num_computed, its tokens in a pipeline's steps in
  flight, admission and preemption counts, and its blocks (`kv`), which it moves only
  through the KV manager (kv/manager.py);
- sampling state (`sampling`: seeded generator, penalty counts, grammar) is made with it,
  and so is its proposer of speculative tokens (`speculation`, None when it speculates not);
- the engine's output path owns `output` (detokenizer, stop strings) and the timings of its
  tokens (the first scheduling is the scheduler's).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gapless.engine.events import ProgressEvent, TokenLogprob
from gapless.engine.sampler import SamplingState
from gapless.engine.sampling_params import SamplingParams
from gapless.kv.manager import SeqBlocks
from gapless.kv.prefix_cache import adapter_root

if TYPE_CHECKING:
    import torch

    from gapless.engine.admission import PromptImage
    from gapless.engine.output import OutputStream
    from gapless.engine.prompt_lookup import PromptLookup
    from gapless.engine.speculation import Speculation
    from gapless.model.encode_steps import EncodeSteps

# How an embedding request pools its prompt's hidden states after the final norm into one
# vector, which is then L2-normalized: `last`, the last token's (decoder embedding models such
# as Qwen3-Embedding are trained for it), or `mean`, the average over every prompt token.
POOLINGS = ("last", "mean")


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
    index: int = 0  # which of the request's n choices
    sampling: SamplingState | None = None  # None: plain SamplingState(params)
    output: OutputStream | None = None  # None: no text is rendered (runner-level use)
    speculation: Speculation | None = None  # None: decodes one token a step
    lookup: PromptLookup | None = None  # its proposer, with --speculate ngram
    # An embedding request's pooling (POOLINGS): it samples no token and ends with its prompt.
    pooling: str | None = None
    # A score request's pair (engine/scoring.py): it ends with the score its scorer reads
    # from its last token's row (a classifier's, pooled `last`; the yes/no recipe's, logits).
    scores: bool = False
    # A pair whose first `shared_prefix` tokens are those of an earlier pair of its request,
    # `prefix_leader`: it waits to be admitted until that one has computed them, so that the
    # prefix cache serves them (a query is prefilled once for all of its documents).
    prefix_leader: Request | None = None
    shared_prefix: int = 0
    # The prompt's images, in order (admission.py), and for M-RoPE (Qwen2.5-VL) its tokens'
    # (t, h, w) positions [3, prompt length]; None: each token's index.
    images: tuple[PromptImage, ...] = ()
    rope_positions: torch.Tensor | None = None

    # The scheduler's.
    state: RequestState = RequestState.WAITING
    arrival_step: int = 0  # the scheduler's step count when it was queued, for aging
    num_computed: int = 0  # leading tokens (prompt, then output) whose K/V is in the cache
    # Tokens of its chunks in pipeline steps launched and not yet completed: a prompt's next
    # chunk may run in the next micro-batch (Scheduler.launched), starting after them.
    num_in_flight: int = 0
    kv: SeqBlocks = field(default_factory=SeqBlocks)  # its block table in each KV group
    # Served by the prefix cache at its first admission, from RAM or from disk.
    cached_prompt_tokens: int = 0
    disk_prompt_tokens: int = 0  # loaded from the disk tier (kv/disk.py)
    preemptions: int = 0
    admitted_seq: int = -1  # admission order: within a class, the last admitted is preempted
    first_scheduled_time: float | None = None  # its first admission

    # The runner's: an image's embeddings by its index in `images`, from the step whose chunk
    # first reaches it until the prompt is computed past it (or the request is preempted),
    # and before that its encode in progress, which the scheduler cuts across steps.
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    image_encodes: dict[int, EncodeSteps] = field(default_factory=dict)

    # The engine's.
    output_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # An embedding request's: the last token's hidden state, or (mean) the sum so far.
    pooled: torch.Tensor | None = None
    # The other choices, until this one's prompt is computed and they share its KV blocks.
    forks: list[Request] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = SamplingState(self.params)
        self.kv.root = adapter_root(self.params.adapter)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_scheduled(self) -> int:
        """Where its next chunk starts: past its computed tokens and those in flight."""
        return self.num_computed + self.num_in_flight

    @property
    def reads_every_prompt_row(self) -> bool:
        """Whether the output of every prompt token is read (prompt logprobs, mean pooling):
        then the prefix cache may serve none of the prompt, as cached tokens have no output."""
        return self.params.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def waits_for_prefix(self) -> bool:
        """Whether its prefix leader is still to compute the prefix they share."""
        leader = self.prefix_leader
        return (
            leader is not None
            and leader.state is not RequestState.FINISHED
            and leader.num_computed < self.shared_prefix
        )

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

    def hash_tokens(self, start: int, end: int) -> list[int | tuple[str, int]]:
        """tokens(start, end) as the prefix cache keys them: an image's rows by (its content
        key, the offset into it), so that blocks match only where they hold the same image."""
        keyed: list[int | tuple[str, int]] = list(self.tokens(start, end))
        for image in self.images:
            for p in range(max(start, image.start), min(end, image.end)):
                keyed[p - start] = (image.key, p - image.start)
        return keyed

    def encode_units_left(self, i: int) -> int:
        """Units of image i's encode still to run."""
        if i in self.image_embeds:
            return 0
        encode = self.image_encodes.get(i)
        return self.images[i].units - (encode.done if encode is not None else 0)

    def drop_images(self) -> None:
        """Frees every image's embeddings and encode in progress (the request is preempted or
        ends): they are recomputed with its blocks if it runs again."""
        self.image_embeds.clear()
        self.image_encodes.clear()

    def drop_images_before(self, position: int) -> None:
        """Frees the embeddings of the images that end at or before position."""
        for i in [i for i in self.image_embeds if self.images[i].end <= position]:
            del self.image_embeds[i]

    def is_stop_token(self, token: int, eos_ids: set[int]) -> bool:
        """Whether `token`, just appended, ends the request as a stop token (it shows no
        text): one of its stop_token_ids, or an end-of-sequence id unless ignore_eos, once
        min_tokens are out."""
        p = self.params
        if len(self.output_ids) < p.min_tokens:
            return False
        return token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos)

    def finish_reason(self, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
        """Why the request ends with `token`, just appended, stop strings aside (the output
        stream finds those): "stop" for a stop token or a grammar that allows nothing more,
        "length" at max_tokens or the end of the context; None when it goes on. Reads the
        request and the token only."""
        if self.is_stop_token(token, eos_ids):
            return "stop"
        matcher = self.sampling.matcher
        if matcher is not None and matcher.complete:
            return "stop"
        if len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
