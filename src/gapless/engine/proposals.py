"""Where a step's speculative tokens go (speculation.py says how they are verified).

What the prompts leave of the step's budget goes to speculation: decodes, by class and then
in admission order, get proposed tokens to verify in the same forward, at most DECODE_ROWS
rows of decodes and proposals in all, and only into free KV (no one is preempted for a
proposal). A draft model's reading of the tokens it has not seen (draft.py) comes out of the
same share, so a long prompt's catch-up goes in chunks and stalls no one. So speculation
shrinks before prompt chunks do, and narrows as the batch grows: each request proposes fewer
(a verified row is worth less beside more decodes), and none from DECODE_ROWS decodes on
(kernels.DECODE_ROWS: what the decode kernels take).
"""

from __future__ import annotations

from collections.abc import Callable

from gapless.engine.plan import DraftPlan, ScheduledChunk
from gapless.engine.request import Request
from gapless.kv.manager import KVManager


def plan_proposals(
    decodes: list[ScheduledChunk],
    tokens: int,
    rows: int,
    kv: KVManager,
    max_model_len: int | None,
    draft_unseen: Callable[[Request], int] | None,
) -> list[DraftPlan]:
    """Gives decodes, in their order, tokens their proposers propose, while the step has
    `tokens` tokens and `rows` rows left to verify: each no more than its request can still
    emit, and only into free KV. Prompt lookup's proposals go in their chunks now. A draft
    model's are planned: it first reads the tokens it has not seen (`draft_unseen`; a whole
    prompt, at first), in chunks that count against `tokens` as its proposals do; it proposes
    only once it has read them all, in forwards batched over the step's requests (the engine
    runs them, then Scheduler.verify)."""
    plans: list[DraftPlan] = []
    for chunk in decodes:
        request, speculation = chunk.request, chunk.request.speculation
        if min(tokens, rows) <= 0:
            break
        if speculation is None:
            continue
        # A run of k accepted proposals emits k + 1 tokens.
        most = min(tokens, rows, request.params.max_tokens - len(request.output_ids) - 1)
        if max_model_len is not None:
            most = min(most, max_model_len - request.num_tokens - 1)
        most = min(most, kv.room(request.kv, request.num_scheduled) - 1)
        if most <= 0:
            continue  # before limit(), which counts the steps a request proposed nothing
        k = min(most, speculation.limit(len(decodes)))
        if k <= 0:
            continue
        if request.lookup is not None:
            used = add_proposals(chunk, request.lookup.propose(request, k), kv)
            tokens, rows = tokens - used, rows - used
            continue
        assert draft_unseen is not None, "a proposer is either prompt lookup or a draft model"
        unseen = draft_unseen(request)
        catch_up = min(unseen, tokens)
        k = min(k, tokens - catch_up) if catch_up == unseen else 0
        plans.append(DraftPlan(request, catch_up, k))
        tokens, rows = tokens - catch_up - k, rows - k
    return plans


def add_proposals(chunk: ScheduledChunk, draft: list[int], kv: KVManager) -> int:
    """Puts a decode's proposed tokens in its chunk, if free KV holds them; returns how many
    it put."""
    request = chunk.request
    end = request.num_scheduled + 1 + len(draft)
    if not draft or not kv.reserve(request.kv, request.num_computed, end):
        return 0
    chunk.draft = draft
    chunk.num_tokens += len(draft)
    return len(draft)
