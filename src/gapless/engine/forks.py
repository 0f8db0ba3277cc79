"""A request for n choices prefills its prompt once; the other n - 1 fork from it in the step
that completes the prompt: they sample from its last row, share its full KV blocks by
reference, and each copies the partly filled last block into a block of its own (their next
tokens differ). The scheduler plans a step's forks with the step (plan_forks) and starts the
children once the step has computed the prompt (start_forks)."""

from __future__ import annotations

from gapless.engine.plan import Fork, ScheduledChunk
from gapless.engine.request import Request
from gapless.kv.manager import KVManager

# For each KV group, the (source, destination) blocks whose K/V the runner copies.
BlockCopies = list[list[tuple[int, int]]]


def completes_with_forks(chunk: ScheduledChunk) -> bool:
    """Whether the chunk completes a prompt whose other choices then sample from its last
    row."""
    request = chunk.request
    return (
        bool(request.forks)
        and request.num_scheduled + chunk.num_tokens == request.num_tokens
        and request.params.max_tokens > 0
    )


def plan_forks(chunks: list[ScheduledChunk], seats: int, kv: KVManager) -> list[Fork]:
    """The forks of the step's chunks that complete a prompt with other choices, while the
    batch has `seats` more places (the step's earlier forks take theirs first)."""
    forks: list[Fork] = []
    for chunk in chunks:
        if completes_with_forks(chunk):
            forks.append(plan_fork(chunk.request, seats, kv))
            seats -= len(forks[-1].children)
    return forks


def plan_fork(parent: Request, seats: int, kv: KVManager) -> Fork:
    """The parent's other choices that start on its prompt once this step computes it, while
    the batch has `seats` more places; each gets now the block its copy of the prompt's partly
    filled last block goes to (so that it is released with the rest of its KV, however the
    choice ends). A choice that does not fit now (no seat, no free block) waits as an ordinary
    request."""
    partial = parent.num_tokens % kv.block_size > 0
    fork = Fork(parent, [], [])
    for child in parent.forks:
        if len(fork.children) < seats and kv.fork_tail(child.kv, partial):
            fork.children.append(child)
        else:
            fork.waiting.append(child)
    return fork


def start_forks(
    forks: list[Fork], computed: set[Request], finished: set[Request], kv: KVManager
) -> tuple[list[Request], list[Request], BlockCopies]:
    """Books the step's forks once it ran: the children started on their parents' computed
    prompts, the choices to queue as ordinary requests (a fork's waiting ones, where its
    parent's chunk was computed and they have not ended), and the block copies."""
    started: list[Request] = []
    queued: list[Request] = []
    copies: BlockCopies = [[] for _ in kv.groups]
    for fork in forks:
        children, pairs = start_children(fork, fork.parent in computed, finished, kv)
        started += children
        for group, more in zip(copies, pairs, strict=True):
            group += more
        if fork.parent in computed:
            queued += [child for child in fork.waiting if child not in finished]
    return started, queued, copies


def start_children(
    fork: Fork, computed: bool, finished: set[Request], kv: KVManager
) -> tuple[list[Request], BlockCopies]:
    """Starts the fork's children on the parent's computed prompt (kv.fork). A child that
    ended keeps its own block until its request is finished; where the parent's chunk was not
    computed, the block goes back now. Returns the children started and, for each KV group,
    the (source, destination) blocks whose K/V the runner copies."""
    started: list[Request] = []
    copies: BlockCopies = [[] for _ in kv.groups]
    for child in fork.children:
        if child in finished:
            continue
        if not computed:
            kv.free(child.kv)
            continue
        for group, pairs in zip(
            copies, kv.fork(fork.parent.kv, child.kv, fork.parent.num_computed), strict=True
        ):
            group += pairs
        child.num_computed = fork.parent.num_computed
        child.cached_prompt_tokens = fork.parent.cached_prompt_tokens
        started.append(child)
    return started, copies
