"""Loading cached prefixes from the KV disk tier into a step. A prompt admitted on a prefix
that the disk holds (kv/manager.py: KVManager.admit) waits while the tier reads its blocks;
each step loads those read so far into its blocks, before the forward (plan.DiskLoad), and
the step's update counts them computed. The scheduler plans a step's loads (plan_loads) and
books them (book_loads)."""

from __future__ import annotations

from gapless.engine.in_flight import StepsInFlight
from gapless.engine.plan import DiskLoad
from gapless.engine.request import Request
from gapless.kv.manager import KVManager


def plan_loads(
    running: list[Request], in_flight: StepsInFlight, kv: KVManager, chunk: int
) -> tuple[list[DiskLoad], bool]:
    """The blocks the disk tier has read, loaded this step: as many as `chunk` prompt tokens
    fill (the step's prompt chunk), so that a long prefix's load costs the decodes beside it
    no more than a chunk would; each load's blocks reserved, as many as the pool holds. A
    prompt still loading gets no chunk: its next one starts after the loaded prefix. Also
    returns whether a load that was read found no free block."""
    budget = max(1, chunk // kv.block_size)
    loads, refused = [], False
    for request in running:
        if budget <= 0:
            break
        if not kv.loading(request.kv) or request in in_flight:
            continue
        ready = kv.ready(request.kv, budget)
        n = min(ready, kv.room(request.kv, request.num_scheduled) // kv.block_size)
        end = request.num_scheduled + n * kv.block_size
        if n and kv.reserve(request.kv, request.num_computed, end):
            loads.append(DiskLoad(request, n))
            budget -= n
        refused |= ready > n
    return loads, refused


def book_loads(loads: list[DiskLoad], kv: KVManager) -> int:
    """Counts the loaded blocks' tokens computed, their blocks offered to the prefix cache.
    Returns the tokens that were prefix cache hits: those of requests on their first
    admission (a preempted request's were counted the first time)."""
    hits = 0
    for load in loads:
        request, tokens = load.request, load.num_blocks * kv.block_size
        request.num_computed += tokens
        kv.register(request.kv, request.num_computed, request.hash_tokens)
        request.disk_prompt_tokens += tokens
        if not request.preemptions:
            request.cached_prompt_tokens += tokens
            hits += tokens
    return hits
