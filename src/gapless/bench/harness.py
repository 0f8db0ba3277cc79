"""Steps of chosen chunks on a ModelRunner, for the in-process measurements
(bench/roofline.py, bench/kv_accuracy.py), which time the model forward without a
scheduler. Not the engine's path: there Scheduler.schedule plans each step and
Scheduler.update books it.

A Harness stands in for the scheduler: it asks a KV manager of the runner's size for each
request's blocks as its chunks need them (as the scheduler does), and advances the requests'
num_computed after each step it books. A timing loop that
reruns one step at a fixed context passes book=False: the step writes the same K/V slots
again, and its requests stay where they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gapless.engine.plan import ScheduledChunk
from gapless.engine.request import Request
from gapless.engine.sampling_params import SamplingParams
from gapless.kv.block_pool import BlockPool, OutOfBlocks
from gapless.kv.manager import KVManager

if TYPE_CHECKING:
    import torch

    from gapless.engine.runner import ModelRunner


class Harness:
    def __init__(self, runner: ModelRunner) -> None:
        if runner.window_blocks:
            raise ValueError("the harness keeps one block table: no sliding-window KV groups")
        self.runner = runner
        self.kv = KVManager(BlockPool(runner.num_blocks, runner.block_size), prefix_cache=False)
        self._made = 0

    def request(self, prompt_ids: list[int], cached: int = 0) -> Request:
        """A request of these tokens. Its first `cached` tokens count as computed, as a prefix
        cache hit's do, but their K/V is whatever their blocks hold: a step after them times
        as at that context, and its logits are not the prompt's."""
        request = Request(f"harness-{self._made}", prompt_ids, SamplingParams())
        self._made += 1
        if cached:
            self._reserve(request, cached)
            self._book([(request, cached)])
        return request

    def step(
        self,
        chunks: Sequence[tuple[Request, int]],
        all_logits: bool = False,
        book: bool = True,
    ) -> list[torch.Tensor]:
        """Runs each request's next n tokens, for each (request, n), in one forward, and
        returns each chunk's logits: its last token's, or every token's with all_logits.
        book=False leaves the requests where they were, to run the same step again."""
        for request, n in chunks:
            self._reserve(request, n)
        batch = [ScheduledChunk(request, n) for request, n in chunks]
        logits = self.runner.execute(batch, set(range(len(batch))) if all_logits else set())
        if book:
            self._book(chunks)
        return logits

    def release(self, request: Request) -> None:
        """Gives the request's blocks back to the pool; it starts again from its first token."""
        self.kv.free(request.kv)
        request.num_computed = 0

    def _reserve(self, request: Request, n: int) -> None:
        """Blocks for the request's next n tokens, which it must have."""
        end = request.num_computed + n
        if n < 1 or end > request.num_tokens:
            raise ValueError(
                f"{request.request_id}: {n} tokens after {request.num_computed}"
                f" of its {request.num_tokens}"
            )
        if not self.kv.reserve(request.kv, request.num_computed, end):
            raise OutOfBlocks(f"{request.request_id}: no KV blocks for {end} tokens")

    @staticmethod
    def _book(chunks: Sequence[tuple[Request, int]]) -> None:
        for request, n in chunks:
            request.num_computed += n
