"""The messages of a step. The scheduler plans what a step runs (Scheduler.schedule) and
calls no model; the engine carries the plan out (the draft model's proposals, the disk loads,
the encodes, the forward, the sampling) and hands back what came of it (Scheduler.update).
The runner reads the plan's chunks and nothing of the scheduler's.

Who changes a plan after schedule returns: Scheduler.verify alone, before the forward, which
puts the draft model's proposals in the decodes' chunks (their `draft`, and `num_tokens`
counting it; proposals.add_proposals). The engine, the runner and update only read it.

Who moves a request's KV state (its `kv` blocks, `state`, `num_computed`): the scheduler,
always through the KV manager, in schedule (admitting, reserving the step's blocks,
preempting), verify (the proposals' blocks), update (booking the step, starting forks,
releasing rejected proposals' blocks) and finish, and in the functions of forks.py and
disk_loads.py those call. The one move outside it: the engine, running a plan's loads, takes
the loaded blocks out of the request's `kv.loading` (KVManager.take_loads) for update to
book."""

from __future__ import annotations

from dataclasses import dataclass, field

from gapless.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int
    # A decode's proposed tokens, verified after its last sampled token (num_tokens counts
    # them).
    draft: list[int] = field(default_factory=list)
    # (index into request.images, units of its encode) run in this step, before its forward.
    # A chunk of 0 tokens only encodes: its prompt waits for the image's encode to complete.
    encodes: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class DraftPlan:
    """What the draft model does for a request in a step (the scheduler decides)."""

    request: Request
    catch_up: int  # its unseen tokens to read (DraftModel.unseen), at most the step affords
    k: int  # the tokens to propose once it has read them all


@dataclass
class Fork:
    """The other choices of a request whose prompt this step completes: each starts on its
    computed prompt (Scheduler.update), sharing its full blocks and taking its own copy of the
    partly filled last one, whose block the plan put in its tables. Those that do not fit now
    queue as requests."""

    parent: Request
    children: list[Request]  # sample from the parent's last row this step
    waiting: list[Request]  # the rest


@dataclass
class DiskLoad:
    """Blocks of a request's cached prefix that the step loads from the disk tier into its
    KV blocks (kv/manager.py: KVManager.ready), after its computed tokens."""

    request: Request
    num_blocks: int


@dataclass
class StepPlan:
    # Decodes first, by class then admission (scheduler.precedence), then prompt chunks by
    # class then in the prefill policy's order.
    chunks: list[ScheduledChunk]
    # The draft model's work before the forward: the engine runs it, and Scheduler.verify
    # puts its proposals in the decodes' chunks.
    drafts: list[DraftPlan] = field(default_factory=list)
    # Requests preempted to make room for this step: their KV is gone, the draft's too.
    preempted: list[Request] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    loads: list[DiskLoad] = field(default_factory=list)  # before the forward

    @property
    def decodes(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.request.is_decoding]


@dataclass
class StepOutcome:
    """What came of a plan, for Scheduler.update."""

    computed: list[ScheduledChunk] = field(default_factory=list)  # whose forward ran
    sampled: list[Request] = field(default_factory=list)  # got a token (forked choices too)
    accepted: dict[Request, int] = field(default_factory=dict)  # of its verified proposals
    finished: list[Request] = field(default_factory=list)  # ended in the step
