"""The scheduler: who runs in the next forward pass, and with how many tokens. It plans a step
(schedule) and books what came of it (update); the policies it applies are policy.py's, and
every request's KV blocks are the KV manager's (kv/manager.py), which it asks.

Each step is one hybrid batch:
1. Every decoding request gets exactly one token. Decodes go first, so an active stream
   never waits for someone else's prompt. If the KV pool cannot hold the next tokens, a
   request is preempted (blocks freed, requeued, recomputed later): one of the least urgent
   service class present, and within it the most recently admitted. A waiting request that
   finds the batch full (`max_num_seqs`) or the KV pool short of its first chunk preempts a
   running request of a less urgent class the same way, before any decode is scheduled.
   Under per-class latency targets, decodes of a looser class may wait a step
   (policy.LatencyTargets).
2. What is left of the token budget goes to prompt chunks. The budget is `prefill_chunk`
   while anyone decodes, and `idle_prefill_chunk` when nobody does, so an idle server
   prefills at full speed. Beside decodes it is counted in the work of a fresh prompt's
   tokens (`prompt_work`, the model's FLOP count): a chunk after a long history gets fewer
   tokens, as many as cost what the budget's tokens cost at a prompt's start, so the last
   chunks of a long prompt stall the decodes beside them no longer than its first. (An idle
   step's budget stays in tokens: it bounds the step's activations.) Under a latency target
   it is what the cost model predicts fits in the target beside the decodes (cost_model.py),
   but never under `min_prefill_chunk`: when decodes alone use the target, prompts still
   move at a guaranteed rate.
3. Chunks go to prefilling and waiting requests by service class, most urgent first, within
   a class by tenant (FairShare) and the prefill policy's order (policy.py). Several prompts
   may share the budget. Waiting requests are admitted while `max_num_seqs` and free KV
   allow. A chunk stops at images as image_chunks.py says, and brings their encode work.
4. What the prompts leave of the budget goes to speculation (proposals.py).
A request marked whole_prefill (submit(), or chunking off) takes its whole prompt at once.
A request for n choices prefills its prompt once; the other n - 1 then fork from it
(forks.py). A prompt admitted on a prefix the KV disk tier holds loads it a chunk's worth a
step before its next chunk (disk_loads.py).

Who moves a request's KV state, and who changes a plan once `schedule` returns (`verify`
alone), is plan.py's rule; the steps in flight (in_flight.py) count a pipeline's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gapless.engine.disk_loads import book_loads, plan_loads
from gapless.engine.forks import BlockCopies, plan_forks, start_forks
from gapless.engine.image_chunks import keep_images_whole, plan_encodes
from gapless.engine.in_flight import StepsInFlight
from gapless.engine.options import check, option
from gapless.engine.plan import ScheduledChunk, StepOutcome, StepPlan
from gapless.engine.policy import (
    PREFILL_POLICIES,
    FairShare,
    LatencyTargets,
    affordable,
    fresh_tokens,
    is_urgent,
    over_share,
    precedence,
    urgency,
)
from gapless.engine.proposals import add_proposals, plan_proposals
from gapless.engine.request import Request, RequestState
from gapless.kernels import DECODE_ROWS
from gapless.kv.manager import KVManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(64, "requests in the batch at once", positive=True)
    prefill_chunk: int = option(
        512,
        "prompt tokens per step while other requests decode; after a long history, as many as"
        " cost what this many fresh ones do",
        positive=True,
    )
    idle_prefill_chunk: int = option(
        4096, "prompt tokens per step while nobody decodes", positive=True
    )
    chunked_prefill: bool = option(
        True,
        "prefill each prompt whole in one step (the stalling baseline)",
        flag="--no-chunked-prefill",
    )
    enable_prefix_cache: bool = option(
        True, "do not reuse KV blocks of shared prompt prefixes", flag="--no-prefix-cache"
    )
    prefill_policy: str = option(
        "shortest", "which prompt prefills first", choices=tuple(PREFILL_POLICIES)
    )
    # An N-token prompt at the front is then done within N / min_prefill_chunk steps.
    min_prefill_chunk: int = option(
        64,
        "under a latency target, prompt tokens every step takes whatever the decodes cost",
        positive=True,
        cli=False,
    )

    def __post_init__(self) -> None:
        check(self)

    def max_step_tokens(self, latency_target: bool) -> int:
        """The most tokens a step of chunked prefill holds: a prompt chunk while nobody
        decodes, or every running request's decode beside a busy chunk (as large as an idle
        one under a latency target)."""
        busy = self.idle_prefill_chunk if latency_target else self.prefill_chunk
        return max(self.idle_prefill_chunk, self.max_num_seqs - 1 + busy)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        *,
        prefill_budget: Callable[[list[int], int, float], int] | None = None,
        itl_targets: dict[str, float] | None = None,
        max_model_len: int | None = None,
        encode_cost: Callable[[int, int], int] | None = None,
        draft_unseen: Callable[[Request], int] | None = None,
        micro_batches: int = 1,
        prompt_work: Callable[[int, int], float] | None = None,
    ) -> None:
        """`kv`: every request's blocks. `itl_targets`: seconds between tokens by service
        class, which `prefill_budget` sizes a step's prompt tokens for (policy.LatencyTargets;
        both or neither). `encode_cost`: an encode's charge against the prompt budget
        (image_chunks.py). `draft_unseen`: with a draft model, how many of a request's tokens
        it has yet to read (DraftModel.unseen); None: proposals come by prompt lookup.
        `micro_batches`: how many steps a pipeline keeps in flight; each then plans about
        that share of the decodes. `prompt_work`: what a chunk of n tokens after `start`
        computed ones costs, in fresh prompt tokens (ModelConfig.prompt_work); None: its
        tokens."""
        self.config = config
        self.kv = kv
        self.policy = PREFILL_POLICIES[config.prefill_policy]
        self.fair_share = FairShare()
        self.targets = None
        if itl_targets and prefill_budget is not None:
            self.targets = LatencyTargets(itl_targets, prefill_budget, config.min_prefill_chunk)
        self.max_model_len = max_model_len  # proposals never reach past it
        self.encode_cost = encode_cost
        self.draft_unseen = draft_unseen
        self.micro_batches = micro_batches
        self.prompt_work = prompt_work or fresh_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted: prefilling or decoding
        self.in_flight = StepsInFlight()
        self._preempted: list[Request] = []  # in this step, for its plan
        self._admissions = 0
        self.steps = 0
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0
        self.preemptions = 0

    @property
    def max_step_tokens(self) -> int:
        return self.config.max_step_tokens(self.targets is not None)

    def add(self, request: Request) -> None:
        request.arrival_step = self.steps
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a request wherever it is and releases its KV blocks."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request.kv)
        request.drop_images()

    # -- planning -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """What the next step runs. Calls no model: a draft model's work is in the plan's
        drafts, and its proposals come back through verify()."""
        self._make_room_for_urgent()
        decodes = self._schedule_decodes()
        self.steps += 1
        load_tokens = self.config.prefill_chunk if decodes else self.config.idle_prefill_chunk
        loads, starved = plan_loads(self.running, self.in_flight, self.kv, load_tokens)
        loading = {load.request for load in loads}
        candidates = [r for r in self._prompt_candidates() if r not in loading]
        head = candidates[0] if candidates else None
        start = head.num_scheduled if head is not None else 0
        target = self.targets.step_target(decodes) if self.targets is not None else None
        if target is not None:
            decodes = self.targets.defer(decodes, target, start, head)
        speculating = any(c.request.speculation is not None for c in decodes)
        work, budget = self._prompt_budget(decodes, target, start, bool(candidates or speculating))
        # Under a latency target a prompt as urgent as every decode of the step moves at least
        # min_prefill_chunk tokens a step; a less urgent one gets what the target leaves (a
        # batch prompt waits while the step's decodes use an interactive stream's target).
        # Speculation gets only what the target leaves after the prompts.
        left = budget
        if decodes and target is not None and head is not None and is_urgent(head, decodes):
            budget = max(budget, self.config.min_prefill_chunk)
        chunks = list(decodes)
        for request in candidates:
            if budget <= 0:
                break
            if request.state is RequestState.WAITING and not self._admit(request):
                if self.policy.head_blocks:
                    break
                continue
            if self.kv.loading(request.kv):
                continue  # admitted on a prefix the disk holds: its chunks follow its load
            planned = self._prompt_chunk(request, work, budget, first=len(chunks) == len(decodes))
            if planned is None:
                starved = True  # a step's first prompt chunk gets nothing only for want of KV
                continue
            chunk, charge = planned
            chunks.append(chunk)
            self.fair_share.give(request, chunk.num_tokens + charge)
            spent = work(chunk.num_tokens, request.num_scheduled) + charge
            budget -= spent
            left -= spent
        if starved and not chunks and not loads:
            self._preempt_for_progress()
        drafts = []
        if speculating:
            rows = DECODE_ROWS - len(decodes)
            drafts = plan_proposals(
                decodes, int(left), rows, self.kv, self.max_model_len, self.draft_unseen
            )
        preempted, self._preempted = self._preempted, []
        forks = plan_forks(chunks, self.config.max_num_seqs - len(self.running), self.kv)
        return StepPlan(chunks, drafts, preempted, forks, loads)

    def _prompt_candidates(self) -> list[Request]:
        """The prompts that may get tokens this step, in the order they get them: admitted
        ones still prefilling, then waiting ones (but a pair waiting for its prefix leader,
        Request.waits_for_prefix), by class, tenant and prefill policy. A
        prompt with a chunk in flight that does not complete it may run its next chunk now:
        every stage runs the micro-batches in launch order, so each layer has written the
        chunk before's K/V when it runs this one."""
        candidates = [
            r
            for r in self.running
            if r.state is RequestState.PREFILLING
            and r.num_scheduled < r.num_tokens
            and not self.kv.loading(r.kv)
            and r not in self.in_flight.cancelled
        ]
        candidates += [r for r in self.waiting if not r.waits_for_prefix]
        self.fair_share.order(candidates)
        candidates.sort(
            key=lambda r: (urgency(r), self.fair_share.key(r), self.policy.key(r, self.steps))
        )
        return candidates

    def _prompt_budget(
        self, decodes: list[ScheduledChunk], target: float | None, start: int, asked: bool
    ) -> tuple[Callable[[int, int], float], float]:
        """How prompt work is counted this step, and how much of it the step takes. Beside
        decodes the budget bounds their stall, so it counts fresh prompt tokens' work
        (prompt_work); a latency target's was sized for the history's keys already, and an
        idle step's bounds its activations' memory, which grows with its tokens alone. A
        pipeline's P micro-batches share a fixed budget, so that each costs about the same
        and a cycle of them moves one rank's step of prompt tokens; and a prompt runs in at
        least P chunks, so that even a lone one keeps every stage busy. A micro-batch whose
        streams all decode in the other micro-batches is not idle: their tokens wait for it.
        `asked`: whether a prompt or a proposal wants any of it."""
        if not decodes and not self.in_flight.any_decoding():
            return fresh_tokens, max(1, self.config.idle_prefill_chunk // self.micro_batches)
        if self.targets is not None and target is not None and asked:
            contexts = [c.request.num_computed + 1 for c in decodes]
            return fresh_tokens, self.targets.prefill_budget(contexts, start, target)
        work = self.prompt_work
        return work, work(max(1, self.config.prefill_chunk // self.micro_batches), 0)

    def _prompt_chunk(
        self, request: Request, work: Callable[[int, int], float], budget: float, first: bool
    ) -> tuple[ScheduledChunk, int] | None:
        """The admitted request's next prompt chunk within `budget`, its blocks reserved, and
        its encodes' charge; None when it gets nothing this step. `first`: no other prompt
        chunk is in the step yet."""
        remaining = request.num_tokens - request.num_scheduled
        share = -(-request.num_tokens // self.micro_batches)
        tokens = affordable(work, request.num_scheduled, budget, first)
        n = remaining if request.whole_prefill else min(remaining, tokens, share)
        n, encodes, charge = plan_encodes(request, n, tokens, first, self.encode_cost)
        if n:
            n = keep_images_whole(request, n, extend=first)
        if n and not self._reserve(request, n):
            n = self._fit(request, n)  # a shrunk chunk encodes its images ahead of it
        if n == 0 and not encodes:
            return None
        return ScheduledChunk(request, n, encodes=encodes), charge

    def _fit(self, request: Request, n: int) -> int:
        """The largest chunk of at most n tokens that free KV can hold now."""
        room = self.kv.room(request.kv, request.num_scheduled)
        fit = keep_images_whole(request, min(n, room), extend=False)
        if fit > 0 and self._reserve(request, fit):
            return fit
        return 0

    def _reserve(self, request: Request, n: int) -> bool:
        """Makes room in the request's blocks for its next n tokens."""
        end = request.num_scheduled + n
        return self.kv.reserve(request.kv, request.num_computed, end)

    def verify(self, plan: StepPlan, proposals: dict[Request, list[int]]) -> None:
        """Puts the draft model's proposals for the plan's decodes in their chunks, where free
        KV holds them."""
        for chunk in plan.decodes:
            add_proposals(chunk, proposals.get(chunk.request, []), self.kv)

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        """A token for each decode, in precedence order, so that a victim of preemption (the
        last by precedence) is never one already given its token this step. With steps in
        flight, only the decodes of none, and a micro-batch's share of all decodes at most:
        the others make the next micro-batch."""
        decoding = [r for r in self.running if r.state is RequestState.DECODING]
        share = -(-len(decoding) // self.micro_batches)
        chunks = []
        for request in sorted(decoding, key=precedence):
            if len(chunks) == share:
                break
            if request not in self.running or request in self.in_flight:
                continue
            while not self._reserve(request, 1):
                victim = max(self._preemptible(), key=precedence)
                self.preempt(victim)
                if victim is request:
                    break
            if request in self.running:
                chunks.append(ScheduledChunk(request, 1))
        return chunks

    def _make_room_for_urgent(self) -> None:
        """A waiting request that admission would refuse (the batch full at max_num_seqs, or
        the KV pool short of its first chunk) takes the place of a running request of a less
        urgent class: the least urgent is preempted, as under KV pressure. So a chat arriving
        at a server full of batch work waits for no batch request to end. Within its class it
        takes the place of a tenant's running more than its share (policy.over_share)."""
        for request in sorted(self.waiting, key=urgency):
            fair = False
            while not self._has_room(request):
                victim = max(self._preemptible(), key=precedence, default=None)
                if victim is None or urgency(victim) < urgency(request):
                    return
                if urgency(victim) == urgency(request):
                    victim = over_share(request, self.running, self._preemptible())
                    fair = True
                    if victim is None:
                        break
                self.preempt(victim)
            if fair and self._has_room(request):
                # The slot is this request's: the preempted one, first in the queue and of a
                # tenant level in tokens with it, would otherwise take it straight back.
                self._admit(request)

    def _preempt_for_progress(self) -> None:
        """Prompts holding the pool, none complete nor decoding, would wait on each other
        forever: the last by precedence gives way (once no step in flight may free blocks)."""
        if len(self.running) > 1 and not self.in_flight.held:
            self.preempt(max(self._preemptible(), key=precedence))

    def _preemptible(self) -> list[Request]:
        """The running requests whose KV no step in flight uses."""
        return [r for r in self.running if r not in self.in_flight]

    def _has_room(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        first = request.num_uncomputed
        if not request.whole_prefill:
            first = min(first, self.config.prefill_chunk)
        return self.kv.can_start(first)

    def preempt(self, request: Request) -> None:
        """Frees a running request's KV and requeues it at the front; it recomputes later."""
        self.remove(request)
        request.state = RequestState.WAITING
        request.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self._preempted.append(request)
        self.waiting.insert(0, request)

    def _admit(self, request: Request) -> bool:
        """Admits a waiting request to the batch, on its cached prefix, if the batch has a
        seat and its first chunk (its whole prompt, prefilled whole) fits."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        keyed = None
        if self.kv.prefix_cache and not request.reads_every_prompt_row:
            keyed = request.hash_tokens(0, request.num_tokens)
        request.num_computed = self.kv.admit(request.kv, keyed)
        if not self._reserve(request, 1 if not request.whole_prefill else request.num_uncomputed):
            self.kv.free(request.kv)
            request.num_computed = 0
            return False
        if not request.preemptions:
            request.cached_prompt_tokens = request.num_computed
            self.prefix_hit_tokens += request.num_computed
            self.prefix_queried_tokens += request.num_tokens
        self.waiting.remove(request)
        self._start(request)
        return True

    def _start(self, request: Request) -> None:
        self.running.append(request)
        request.state = RequestState.PREFILLING
        request.admitted_seq = self._admissions
        self._admissions += 1
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    # -- booking ------------------------------------------------------------------------------

    def update(self, plan: StepPlan, outcome: StepOutcome) -> BlockCopies:
        """Books what a step computed: each computed chunk's tokens (proposed ones only once
        accepted), its full blocks offered to the prefix cache; the forks of the prompts it
        completed; the requests that got a token decoding; each verified request's accepted
        proposals, and the blocks of its rejected ones released; and the requests that
        ended, removed. Returns, for each KV group, the (source, destination) blocks whose
        K/V the runner must copy for the forks."""
        self.prefix_hit_tokens += book_loads(plan.loads, self.kv)
        for chunk in outcome.computed:
            request = chunk.request
            request.num_computed += chunk.num_tokens - len(chunk.draft)
            request.drop_images_before(request.num_computed)
            self.kv.register(request.kv, request.num_computed, request.hash_tokens)
        computed, finished = {c.request for c in outcome.computed}, set(outcome.finished)
        started, queued, copies = start_forks(plan.forks, computed, finished, self.kv)
        for child in started:
            self._start(child)
        for child in queued:
            self.add(child)
        for request in outcome.sampled:
            request.state = RequestState.DECODING
        for request, accepted in outcome.accepted.items():
            if request not in finished:
                request.num_computed += accepted
                self.kv.register(request.kv, request.num_computed, request.hash_tokens)
                self.kv.truncate(request.kv, request.num_tokens)
        self.finish(outcome.finished)
        return copies

    def finish(self, requests: list[Request]) -> None:
        """Ends requests (done, cancelled or failed): each dropped wherever it is, its KV
        released."""
        for request in requests:
            self.remove(request)
            request.state = RequestState.FINISHED
