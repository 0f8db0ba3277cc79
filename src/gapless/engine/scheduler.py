"""The scheduling policy: who runs in the next forward pass, and with how many tokens.

Each step is one hybrid batch:
1. Every decoding request gets exactly one token. Decodes go first, so an active stream
   never waits for someone else's prompt. If the KV pool cannot hold the next tokens, a
   request is preempted (blocks freed, requeued, recomputed later): one of the least urgent
   service class present, and within it the most recently admitted. A waiting request that
   finds the batch full (`max_num_seqs`) or the KV pool short of its first chunk preempts a
   running request of a less urgent class the same way, before any decode is scheduled.
   Under per-class latency targets (`itl_targets`), the step's target is the strictest of
   its decoding classes'. Where the decodes alone would leave it less than
   `min_prefill_chunk` prompt tokens, decodes of classes with a looser target (or none)
   wait a step, as few as needed and in turns (the ones given a token most recently wait
   first): under overload a batch stream slows down so that an interactive one keeps its
   latency. Without a stricter class decoding, nobody waits.
2. What is left of the token budget goes to prompt chunks. The budget is `prefill_chunk`
   while anyone decodes, and `idle_prefill_chunk` when nobody does, so an idle server
   prefills at full speed. Beside decodes it is counted in the work of a fresh prompt's
   tokens (`prompt_work`, the model's FLOP count): a chunk after a long history gets fewer
   tokens, as many as cost what the budget's tokens cost at a prompt's start, so the last
   chunks of a long prompt stall the decodes beside them no longer than its first. (An idle
   step's budget stays in tokens: it bounds the step's activations.) Under a latency target it is what the cost model predicts fits
   in the target beside the decodes (cost_model.py), but never under `min_prefill_chunk`:
   when decodes alone use the target, prompts still move at a guaranteed rate.
3. Chunks go to prefilling and waiting requests by service class, most urgent first
   (SERVICE_CLASSES: interactive, standard, batch), and within a class in the order of the
   prefill policy (a PrefillPolicy: `fcfs` by arrival, or `shortest` remaining prefill first,
   aged by steps waited so that no prompt starves behind its own class). Classes are strict:
   aging never lifts a prompt past a more urgent class's, so under interactive prompts that
   fill every step's budget, batch prompts wait (their decodes still run every step). That
   is the promise classes make. Within a class, tenants take turns (FairShare): the one
   given the fewest prompt tokens goes first, and the policy orders each tenant's prompts.
   Several prompts may share the budget. Waiting requests are admitted while
   `max_num_seqs` and free KV allow.
   An image the chunk reaches unencoded is encoded a few units at a time (its tower's
   blocks, + 1 for its projector: model/encode_steps.py), before the step's forward. Each
   unit is charged against the budget as the image's encode cost over its units, rounded up
   (the cost: `encode_cost`, the cost model's estimate of its time in prompt tokens, which
   it keeps for a vision-language model with or without a latency target; its placeholder
   tokens until it has timed an encode); the step runs the units the budget leaves
   after the chunk's text before the image. The chunk stops before an image whose encode
   does not complete in the step (a chunk of 0 tokens only encodes), and takes what the
   budget leaves once it completes. A chunk that starts at an image its budget affords no
   unit of still runs one if it is the step's first prompt chunk: such a step exceeds the
   budget by a unit.
4. What the prompts leave of the budget goes to speculation (speculation.py): decodes, by
   class and then in admission order, get proposed tokens to verify in the same forward, at
   most DECODE_ROWS rows of decodes and proposals in all, and only into free KV (no one is
   preempted for a proposal). A draft model's reading of the tokens it has not seen
   (draft.py) comes out of the same share, so a long prompt's catch-up goes in chunks and
   stalls no one. So speculation shrinks before prompt chunks do, and narrows as the batch
   grows: each request proposes fewer (a verified row is worth less beside more decodes),
   and none from DECODE_ROWS decodes on (kernels.DECODE_ROWS: what the decode kernels take).
A request marked whole_prefill (submit(), or chunking off) takes its whole prompt at once.

An image whose tokens attend to each other both ways (Gemma 3) is never cut by a chunk: its
earlier tokens attend to its later ones, which must be in the same forward. A chunk that
would end inside one ends before it instead; when nothing would be left (the chunk starts at
the image, or inside it after a prefix-cache hit), it runs to the image's end, past the
budget, if it is the step's first prompt chunk, and else waits for the next step. (So the
chunk that reaches such an image once its encode is complete takes all of it.)

A request for n choices prefills its prompt once; the other n - 1 then fork from it (fork()).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gapless.engine.options import check, option
from gapless.engine.plan import DraftPlan, Fork, ScheduledChunk, StepOutcome, StepPlan
from gapless.engine.request import Request, RequestState
from gapless.engine.sampling_params import SERVICE_CLASSES
from gapless.kernels import DECODE_ROWS
from gapless.kv.block_pool import BlockPool
from gapless.kv.groups import KVGroup, first_needed_block
from gapless.kv.prefix_cache import block_hashes


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
        waiting = {_share(r) for r in candidates}
        given = {k: n for k, n in self._given.items() if k in waiting}
        for share in waiting - given.keys():
            level = [n for (urgency, _), n in given.items() if urgency == share[0]]
            given[share] = min(level, default=0)
        self._given = given

    def key(self, request: Request) -> int:
        return self._given[_share(request)]

    def give(self, request: Request, tokens: int) -> None:
        self._given[_share(request)] += tokens


def _tokens(tokens: int, start: int) -> float:
    return tokens


def _affordable(work: Callable[[int, int], float], start: int, budget: float, first: bool) -> int:
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


def _share(request: Request) -> tuple[int, str | None]:
    return urgency(request), request.params.tenant


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
        pool: BlockPool,
        prefill_budget: Callable[[list[int], int, float], int] | None = None,
        window: int | None = None,
        max_model_len: int | None = None,
        window_groups: list[KVGroup] | None = None,
        encode_cost: Callable[[int, int], int] | None = None,
        draft_unseen: Callable[[Request], int] | None = None,
        itl_targets: dict[str, float] | None = None,
        micro_batches: int = 1,
        prompt_work: Callable[[int, int], float] | None = None,
    ) -> None:
        """`pool` and `window`: KV group 0's (kv/groups.py), whose blocks are each request's
        block_table; `window_groups`: the sliding-window groups of a hybrid model, whose blocks
        are its window_tables. `draft_unseen`: with a draft model, how many of a request's
        tokens it has yet to read (DraftModel.unseen); None: proposals come by prompt lookup.
        `itl_targets`: seconds between tokens by service class, which prefill_budget sizes a
        step's prompt tokens for (EngineConfig.latency_targets). `micro_batches`: how many
        steps a pipeline keeps in flight; each then plans about that share of the decodes.
        `prompt_work`: what a chunk of n tokens after `start` computed ones costs, in fresh
        prompt tokens (ModelConfig.prompt_work); None: its tokens."""
        self.config = config
        self.policy = PREFILL_POLICIES[config.prefill_policy]
        self.fair_share = FairShare()
        self.pool = pool
        # Every KV group with its window (None: full attention): blocks a group's window has
        # passed are released.
        self.groups = [KVGroup(pool, window), *(window_groups or [])]
        self.max_model_len = max_model_len  # proposals never reach past it
        # A latency target replaces the static chunk budget when decodes run. It is given the
        # decodes' context lengths, where the first prompt chunk starts and the target.
        self.prefill_budget = prefill_budget
        self.itl_targets = itl_targets or {}
        # An encode's charge against the prompt budget, given its placeholder tokens and where
        # the chunk starts (None: its placeholder tokens).
        self.encode_cost = encode_cost
        self.draft_unseen = draft_unseen
        self._preempted: list[Request] = []  # in this step, for its plan
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted: prefilling or decoding
        # A pipeline's steps in flight (launched, landed): how many hold each request. None is
        # preempted, and none but a prompt whose chunks in flight do not complete it is planned
        # another chunk, until they land.
        self.in_flight: collections.Counter[Request] = collections.Counter()
        # Cancelled while in flight: planned nothing more, ended when their last step lands.
        self.cancelled_in_flight: set[Request] = set()
        self.micro_batches = micro_batches
        self.prompt_work = prompt_work or _tokens
        self._admissions = 0
        self.steps = 0
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0
        self.preemptions = 0
        # Prompt chunks launched while the prompt's chunk before was in flight (/metrics): how
        # often a prompt fills the pipeline's stages rather than one micro-batch at a time.
        self.prompt_chunks_overlapped = 0

    @property
    def max_step_tokens(self) -> int:
        return self.config.max_step_tokens(self.prefill_budget is not None)

    def add(self, request: Request) -> None:
        request.arrival_step = self.steps
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a request wherever it is and releases its KV blocks."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._release_blocks(request)

    def schedule(self) -> StepPlan:
        """What the next step runs. Calls no model: a draft model's work is in the plan's
        drafts, and its proposals come back through verify()."""
        self._make_room_for_urgent()
        decodes = self._schedule_decodes()
        self.steps += 1
        candidates = [r for r in self.running if r.state is RequestState.PREFILLING]
        # A prompt with a chunk in flight that does not complete it may run its next chunk
        # now: every stage runs the micro-batches in launch order, so each layer has written
        # the chunk before's K/V when it runs this one.
        candidates = [
            r
            for r in candidates
            if r.num_scheduled < r.num_tokens and r not in self.cancelled_in_flight
        ]
        candidates += self.waiting
        self.fair_share.order(candidates)
        candidates.sort(
            key=lambda r: (urgency(r), self.fair_share.key(r), self.policy.key(r, self.steps))
        )
        target = self._step_target(decodes)
        start = candidates[0].num_scheduled if candidates else 0
        first = candidates[0] if candidates else None
        if target is not None and self.prefill_budget is not None:
            decodes = self._defer_for_target(decodes, target, start, first)
        chunks = list(decodes)
        speculating = any(c.request.speculation is not None for c in decodes)
        # Beside decodes the budget bounds their stall, so it counts fresh prompt tokens' work
        # (prompt_work); a latency target's was sized for the history's keys already, and an
        # idle step's bounds its activations' memory, which grows with its tokens alone.
        work = _tokens
        # A pipeline's P micro-batches share a fixed budget, so that each costs about the same
        # and a cycle of them moves one rank's step of prompt tokens; and a prompt runs in at
        # least P chunks, so that even a lone one keeps every stage busy. A micro-batch whose
        # streams all decode in the other micro-batches is not idle: their tokens wait for it.
        if not chunks and not any(r.is_decoding for r in self.in_flight):
            budget = max(1, self.config.idle_prefill_chunk // self.micro_batches)
        elif self.prefill_budget is not None and target is not None and (candidates or speculating):
            contexts = [c.request.num_computed + 1 for c in chunks]
            budget = self.prefill_budget(contexts, start, target)
        else:
            work = self.prompt_work
            budget = work(max(1, self.config.prefill_chunk // self.micro_batches), 0)
        # Under a latency target a prompt as urgent as every decode of the step moves at least
        # min_prefill_chunk tokens a step; a less urgent one gets what the target leaves (a
        # batch prompt waits while the step's decodes use an interactive stream's target).
        # Speculation gets only what the target leaves after the prompts.
        left = budget
        if chunks and target is not None and first is not None and self._urgent(first, chunks):
            budget = max(budget, self.config.min_prefill_chunk)
        for request in candidates:
            if budget <= 0:
                break
            if request.state is RequestState.WAITING and not self._admit(request):
                if self.policy.head_blocks:
                    break
                continue
            remaining = request.num_tokens - request.num_scheduled
            share = -(-request.num_tokens // self.micro_batches)
            first = len(chunks) == len(decodes)  # no other prompt chunk in the step yet
            start = request.num_scheduled
            tokens = _affordable(work, start, budget, first)
            n = remaining if request.whole_prefill else min(remaining, tokens, share)
            n, encodes, charge = self._encodes(request, n, tokens, first)
            if n:
                n = self._keep_images_whole(request, n, extend=first)
            if n == 0 and not encodes:
                continue
            if n and not self._reserve(request, n):
                n = self._fit(request, n)  # a shrunk chunk encodes its images ahead of it
                if n == 0 and not encodes:
                    continue
            chunks.append(ScheduledChunk(request, n, encodes=encodes))
            self.fair_share.give(request, n + charge)
            spent = work(n, start) + charge
            budget -= spent
            left -= spent
        drafts = (
            self._speculate(decodes, int(left), DECODE_ROWS - len(decodes)) if speculating else []
        )
        preempted, self._preempted = self._preempted, []
        forks: list[Fork] = []
        for chunk in chunks:
            if self._completes_with_forks(chunk):
                starting = sum(len(f.children) for f in forks)  # of the step's earlier forks
                forks.append(self._plan_fork(chunk.request, starting))
        return StepPlan(chunks, drafts, preempted, forks)

    def _step_target(self, decodes: list[ScheduledChunk]) -> float | None:
        """The step's inter-token latency target: the strictest of its decodes' classes' (None
        when none of them has one: the static chunk budget)."""
        classes = {c.request.params.service_class for c in decodes}
        return min((self.itl_targets[c] for c in classes & self.itl_targets.keys()), default=None)

    @staticmethod
    def _urgent(prompt: Request, decodes: list[ScheduledChunk]) -> bool:
        """Whether the prompt is as urgent as every decode: only then does it take a step's
        room from a decode, or the guaranteed min_prefill_chunk beyond the step's target."""
        return all(urgency(prompt) <= urgency(c.request) for c in decodes)

    def _defer_for_target(
        self,
        decodes: list[ScheduledChunk],
        target: float,
        start: int,
        prompt: Request | None,
    ) -> list[ScheduledChunk]:
        """The step's decodes, less those of classes with a looser target than the step's (or
        none) that must wait a step for the step to meet it (the cost model's prediction): as
        few as leave the decodes within the target and, when the first waiting prompt is more
        urgent than some of them, as few of those as leave it min_prefill_chunk tokens beside
        them. A decode never waits for a prompt of its own class or a less urgent one: a batch
        stream does not stop for a batch prompt. The least urgent wait first, and within a
        class those given a token most recently, so that they take turns."""
        deferrable = [
            c
            for c in decodes
            if self.itl_targets.get(c.request.params.service_class, math.inf) > target
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
        assert self.prefill_budget is not None

        def fewest(candidates: int, need: int) -> int:
            """The fewest of deferrable[:candidates] whose wait leaves `need` prompt tokens in
            the target (all of them, if none does)."""
            lo, hi = 0, candidates
            while lo < hi:
                mid = (lo + hi) // 2
                waiting = {id(c) for c in deferrable[:mid]}
                contexts = [c.request.num_computed + 1 for c in decodes if id(c) not in waiting]
                if self.prefill_budget(contexts, start, target) >= need:  # type: ignore[misc]
                    hi = mid
                else:
                    lo = mid + 1
            return lo

        deferred = fewest(len(deferrable), 1)
        if prompt is not None:
            below = sum(urgency(c.request) > urgency(prompt) for c in deferrable)  # a prefix
            deferred = max(deferred, fewest(below, self.config.min_prefill_chunk))
        waiting = {id(c) for c in deferrable[:deferred]}
        return [c for c in decodes if id(c) not in waiting]

    def _encodes(
        self, request: Request, n: int, budget: int, first: bool
    ) -> tuple[int, list[tuple[int, int]], int]:
        """The request's next chunk of at most n tokens beside the encode work of the images it
        reaches unencoded, within `budget` prompt tokens and their charge: (its tokens, the
        (image, units) encoded, their charge). `first`: no other prompt chunk is in the step
        yet. A unit of an image's encode is charged its cost (`encode_cost`, else its
        placeholder tokens) over its units, rounded up; the chunk stops before an image whose
        encode does not complete in the step."""
        start = request.num_scheduled
        encodes: list[tuple[int, int]] = []
        charge = 0
        for i, image in enumerate(request.images):
            offset = image.start - start
            if i in request.image_embeds or image.end <= start:
                continue
            if offset >= n:
                break
            cost = (
                image.length if self.encode_cost is None else self.encode_cost(image.length, start)
            )
            per_unit = max(1, -(-cost // image.units))
            left = request.encode_units_left(i)
            units = left
            if not request.whole_prefill:
                units = min(left, max(0, budget - max(offset, 0) - charge) // per_unit)
                if not units and offset <= 0 and not encodes and first:
                    units = 1  # at the image, a unit past the budget is the only way on
            if units:
                encodes.append((i, units))
                charge += units * per_unit
            if units < left:
                return max(offset, 0), encodes, charge  # the prompt waits for the encode
            if not request.whole_prefill:
                n = min(n, budget - charge)
        return max(n, 0), encodes, charge

    def _speculate(self, decodes: list[ScheduledChunk], tokens: int, rows: int) -> list[DraftPlan]:
        """Gives decodes, in their order (precedence), tokens their proposers propose, while
        the step has `tokens` tokens and `rows` rows left to verify: each no more than its
        request can still emit, and only into free KV. Prompt lookup's proposals go in their chunks
        now. A draft model's are planned: it first reads the tokens it has not seen (a whole
        prompt, at first), in chunks that count against `tokens` as its proposals do; it
        proposes only once it has read them all, in forwards batched over the step's
        requests (the engine runs them, then verify())."""
        plans: list[DraftPlan] = []
        for chunk in decodes:
            request, speculation = chunk.request, chunk.request.speculation
            if min(tokens, rows) <= 0:
                break
            if speculation is None:
                continue
            # A run of k accepted proposals emits k + 1 tokens.
            most = min(tokens, rows, request.params.max_tokens - len(request.output_ids) - 1)
            if self.max_model_len is not None:
                most = min(most, self.max_model_len - request.num_tokens - 1)
            most = min(most, self._room(request) - 1)
            if most <= 0:
                continue
            k = min(most, speculation.limit(len(decodes)))
            if k <= 0:
                continue
            if request.lookup is not None:
                used = self._verify(chunk, request.lookup.propose(request, k))
                tokens, rows = tokens - used, rows - used
                continue
            unseen = self.draft_unseen(request)
            catch_up = min(unseen, tokens)
            k = min(k, tokens - catch_up) if catch_up == unseen else 0
            plans.append(DraftPlan(request, catch_up, k))
            tokens, rows = tokens - catch_up - k, rows - k
        return plans

    def verify(self, plan: StepPlan, proposals: dict[Request, list[int]]) -> None:
        """Puts the draft model's proposals for the plan's decodes in their chunks, where free
        KV holds them."""
        for chunk in plan.decodes:
            self._verify(chunk, proposals.get(chunk.request, []))

    def _verify(self, chunk: ScheduledChunk, draft: list[int]) -> int:
        """Puts a decode's proposed tokens in its chunk, if free KV holds them; returns how
        many it put."""
        if not draft or not self._reserve(chunk.request, 1 + len(draft)):
            return 0
        chunk.draft = draft
        chunk.num_tokens += len(draft)
        return len(draft)

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
        takes the place of a tenant's running more than its share (_over_share)."""
        for request in sorted(self.waiting, key=urgency):
            fair = False
            while not self._has_room(request):
                victim = max(self._preemptible(), key=precedence, default=None)
                if victim is None or urgency(victim) < urgency(request):
                    return
                if urgency(victim) == urgency(request):
                    victim, fair = self._over_share(request), True
                    if victim is None:
                        break
                self.preempt(victim)
            if fair and self._has_room(request):
                # The slot is this request's: the preempted one, first in the queue and of a
                # tenant level in tokens with it, would otherwise take it straight back.
                self._admit(request)

    def _over_share(self, request: Request) -> Request | None:
        """Within a class, decode slots are shared between tenants too: the latest admitted
        request of the tenant running the most of that class, when it runs at least two more
        than the waiting request's tenant (so that the preempted tenant does not take the slot
        straight back). None when no tenant runs more than its share."""
        share = _share(request)
        running = collections.Counter(_share(r) for r in self.running)
        fullest = max(
            (s for s in running if s[0] == share[0]), key=running.__getitem__, default=None
        )
        if fullest is None or running[fullest] < running[share] + 2:
            return None
        mine = [r for r in self._preemptible() if _share(r) == fullest]
        return max(mine, key=precedence, default=None)

    def launched(self, plan: StepPlan, requests: set[Request]) -> None:
        """A pipeline launched the plan's step over these requests (its chunks' and forks'):
        none is preempted or decodes until it lands, and a prompt's next chunk starts past
        this one's tokens."""
        self.in_flight.update(requests)
        for chunk in plan.chunks:
            # Only a prompt's chunk is planned while its request has tokens in flight.
            self.prompt_chunks_overlapped += chunk.request.num_in_flight > 0
            chunk.request.num_in_flight += chunk.num_tokens

    def cancel_in_flight(self, request: Request) -> bool:
        """Whether the cancelled request has a step in flight, which still writes its blocks:
        then it is planned nothing more, and ends when its last step lands (landed)."""
        if request not in self.in_flight:
            return False
        self.cancelled_in_flight.add(request)
        return True

    def landed(self, plan: StepPlan, requests: set[Request]) -> list[Request]:
        """The launched step completed (before its update books it, or dropped). Returns the
        requests cancelled in flight that no step in flight holds any more: they end now."""
        self.in_flight -= collections.Counter(requests)
        for chunk in plan.chunks:
            chunk.request.num_in_flight -= chunk.num_tokens
        ended = [r for r in self.cancelled_in_flight if r not in self.in_flight]
        self.cancelled_in_flight.difference_update(ended)
        return ended

    def _preemptible(self) -> list[Request]:
        """The running requests whose KV no step in flight uses."""
        return [r for r in self.running if r not in self.in_flight]

    def _has_room(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        first = request.num_uncomputed
        if not request.whole_prefill:
            first = min(first, self.config.prefill_chunk)
        return self.pool.num_available > first // self.pool.block_size

    def preempt(self, request: Request) -> None:
        """Frees a running request's KV and requeues it at the front; it recomputes later."""
        self.running.remove(request)
        self._release_blocks(request)
        request.state = RequestState.WAITING
        request.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self._preempted.append(request)
        self.waiting.insert(0, request)

    def _admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        bs = self.pool.block_size
        hashes: list[int] = []
        if self.config.enable_prefix_cache and not request.reads_every_prompt_row:
            # Recompute at least the last token: its logits pick the first output token (an
            # embedding pooled from the last token reads its hidden state).
            hashes = block_hashes(request.hash_tokens(0, request.num_tokens), bs)
            hashes = hashes[: self._reusable(hashes[: (request.num_tokens - 1) // bs])]
        cached = len(hashes)
        tables = []
        for group in self.groups:  # each claims the blocks the next position reads
            first = first_needed_block(cached * bs, group.window, bs)
            tables.append([-1] * first + [group.pool.lookup(h) for h in hashes[first:]])
        request.block_table, *request.window_tables = tables
        request.block_hashes = hashes
        request.num_registered = cached
        request.num_computed = cached * bs
        self._drop_outside_window(request)
        if not self._reserve(request, 1 if not request.whole_prefill else request.num_uncomputed):
            self._release_blocks(request)
            request.num_computed = 0
            return False
        if not request.preemptions:
            request.cached_prompt_tokens = request.num_computed
            self.prefix_hit_tokens += request.num_computed
            self.prefix_queried_tokens += request.num_tokens
        self.waiting.remove(request)
        self._start(request)
        return True

    def _reusable(self, hashes: list[int]) -> int:
        """How many leading blocks of these prefix hashes the cache can serve: group 0 holds
        them all, and each sliding group the ones the first position after them reads."""
        bs, first, *sliding = self.pool.block_size, *self.groups
        n = 0
        while n < len(hashes) and first.pool.holds(hashes[n]):
            n += 1
        while n and not all(
            all(g.pool.holds(h) for h in hashes[first_needed_block(n * bs, g.window, bs) : n])
            for g in sliding
        ):
            n -= 1
        return n

    def _start(self, request: Request) -> None:
        self.running.append(request)
        request.state = RequestState.PREFILLING
        request.admitted_seq = self._admissions
        self._admissions += 1
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    @staticmethod
    def _completes_with_forks(chunk: ScheduledChunk) -> bool:
        """The chunk completes a prompt whose other choices then sample from its last row."""
        request = chunk.request
        return (
            bool(request.forks)
            and request.num_scheduled + chunk.num_tokens == request.num_tokens
            and request.params.max_tokens > 0
        )

    def _plan_fork(self, parent: Request, starting: int) -> Fork:
        """The parent's other choices that start on its prompt once this step computes it,
        beside `starting` others this step forks; each gets, in its own block tables, the
        block its copy of the prompt's partly filled last block goes to (so that it is
        released with the rest of its KV, however the choice ends). A choice that does not
        fit now (sequence cap, no free block) waits as an ordinary request."""
        partial = parent.num_tokens % self.pool.block_size
        fork = Fork(parent, [], [])
        for child in parent.forks:
            starts = len(self.running) + starting + len(fork.children)
            if starts >= self.config.max_num_seqs or (
                partial and not all(g.pool.num_available for g in self.groups)
            ):
                fork.waiting.append(child)
                continue
            fork.children.append(child)
            own = [g.pool.allocate(1) if partial else [] for g in self.groups]
            child.block_table, *child.window_tables = own
        return fork

    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[list[tuple[int, int]]]:
        """Books what a step did, the one place a request's KV state moves: each computed
        chunk's tokens (proposed ones only once accepted), its full blocks offered to the
        prefix cache; the forks of the prompts it completed; the requests that got a token
        decoding; each verified request's accepted proposals, and the blocks of its rejected
        ones released; and the requests that ended, removed. Returns, for each KV group, the
        (source, destination) blocks whose K/V the runner must copy for the forks."""
        for chunk in outcome.computed:
            request = chunk.request
            request.num_computed += chunk.num_tokens - len(chunk.draft)
            request.drop_images_before(request.num_computed)
            self._register_computed_blocks(request)
        computed, finished = {c.request for c in outcome.computed}, set(outcome.finished)
        copies: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for fork in plan.forks:
            self._fork(fork, fork.parent in computed, finished, copies)
        for request in outcome.sampled:
            request.state = RequestState.DECODING
        for request, accepted in outcome.accepted.items():
            if request not in finished:
                request.num_computed += accepted
                self._settle_speculation(request)
        self.finish(outcome.finished)
        return copies

    def _fork(
        self,
        fork: Fork,
        computed: bool,
        finished: set[Request],
        copies: list[list[tuple[int, int]]],
    ) -> None:
        """Starts the fork's children on the parent's computed prompt: its full KV blocks shared
        by reference, the partly filled last one copied into their own (their next tokens
        differ). A child that ended keeps its own block until finish() releases its KV; where
        the parent's chunk was not computed, the block goes back now."""
        parent, bs = fork.parent, self.pool.block_size
        full = parent.num_computed // bs
        for child in fork.children:
            if child in finished:
                continue
            if not computed:
                self._release_blocks(child)
                continue
            tables = []
            for i, (group, table, own) in enumerate(
                zip(self.groups, self._tables(parent), self._tables(child), strict=True)
            ):
                group.pool.share([b for b in table[:full] if b >= 0])
                tables.append(table[:full] + own)
                copies[i] += [(table[full], block) for block in own]
            child.block_table, *child.window_tables = tables
            child.num_computed = parent.num_computed
            child.block_hashes = parent.block_hashes[:full]
            child.num_registered = min(parent.num_registered, full)
            child.cached_prompt_tokens = parent.cached_prompt_tokens
            self._start(child)
        if computed:
            for child in fork.waiting:
                if child not in finished:
                    self.add(child)

    def finish(self, requests: list[Request]) -> None:
        """Ends requests (done, cancelled or failed): each dropped wherever it is, its KV
        released."""
        for request in requests:
            self.remove(request)
            request.state = RequestState.FINISHED

    def _tables(self, request: Request) -> list[list[int]]:
        """The request's block table in each KV group (empty ones before it is admitted)."""
        return [request.block_table, *(request.window_tables or [[] for _ in self.groups[1:]])]

    def _reserve(self, request: Request, n: int) -> bool:
        """Makes room in the request's block tables for its next n tokens."""
        self._drop_outside_window(request)
        need = -(-(request.num_scheduled + n) // self.pool.block_size) - len(request.block_table)
        if need <= 0:
            return True
        if any(need > g.pool.num_available for g in self.groups):
            return False
        for group, table in zip(self.groups, self._tables(request), strict=True):
            table += group.pool.allocate(need)
        return True

    def _fit(self, request: Request, n: int) -> int:
        """The largest chunk of at most n tokens that free KV can hold now."""
        fit = self._keep_images_whole(request, min(n, self._room(request)), extend=False)
        if fit > 0 and self._reserve(request, fit):
            return fit
        return 0

    @staticmethod
    def _keep_images_whole(request: Request, n: int, extend: bool) -> int:
        """How many of the request's next n tokens to take so that the chunk does not end
        inside an image that attends both ways (the module's docstring): fewer, ending
        before it; or, when that leaves none, to its end if `extend`, else none."""
        start = request.num_scheduled
        end = start + n
        for image in request.images:
            if image.bidirectional and image.start < end < image.end:
                if image.start > start:
                    return image.start - start
                return image.end - start if extend else 0
        return n

    def _room(self, request: Request) -> int:
        """How many more tokens the request's blocks and the pools' free ones can hold."""
        spare = len(request.block_table) * self.pool.block_size - request.num_scheduled
        available = min(g.pool.num_available for g in self.groups)
        return spare + available * self.pool.block_size

    def _drop_outside_window(self, request: Request) -> None:
        """Releases the blocks that a group's window has moved past (the rotating cache): none
        is read by the query at num_computed, the first of the next chunk, or any later."""
        for group, table in zip(self.groups, self._tables(request), strict=True):
            first = first_needed_block(request.num_computed, group.window, self.pool.block_size)
            stale = [b for b in table[:first] if b >= 0]
            if stale:
                group.pool.release(stale)
                table[:first] = [-1] * first

    def _release_blocks(self, request: Request) -> None:
        for group, table in zip(self.groups, self._tables(request), strict=True):
            group.pool.release([b for b in table if b >= 0])
        request.block_table = []
        request.window_tables = []
        request.block_hashes = []
        request.num_registered = 0
        request.drop_images()

    def _settle_speculation(self, request: Request) -> None:
        """After a verification moved num_computed past the accepted proposals: offers their
        full blocks to the prefix cache and releases the blocks that held only rejected ones
        (whose K/V, past num_computed, is overwritten before anything reads it)."""
        self._register_computed_blocks(request)
        keep = -(-request.num_tokens // self.pool.block_size)
        for group, table in zip(self.groups, self._tables(request), strict=True):
            group.pool.release([b for b in table[keep:] if b >= 0])
            del table[keep:]

    def _register_computed_blocks(self, request: Request) -> None:
        """Offers the request's newly full blocks to the prefix cache."""
        if not self.config.enable_prefix_cache:
            return
        bs = self.pool.block_size
        full = request.num_computed // bs
        if full <= len(request.block_hashes):
            return
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else 0
        tokens = request.hash_tokens(done * bs, full * bs)
        request.block_hashes += block_hashes(tokens, bs, parent)
        for group, table in zip(self.groups, self._tables(request), strict=True):
            for i in range(request.num_registered, full):
                if table[i] >= 0:
                    group.pool.register(table[i], request.block_hashes[i])
        request.num_registered = full
