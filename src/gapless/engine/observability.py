"""The engine at a glance: counters for /metrics (stats) and each live sequence's state for
the live view (summary). Counts only: never a prompt's or an output's text or tokens."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gapless.engine.request import RequestState

if TYPE_CHECKING:
    from gapless.engine.engine import Engine

# summary() shows a request by the start of its id: enough to tell requests apart and to find
# one in the logs or in its response's id, not enough to cancel it by.
SUMMARY_ID_CHARS = 8


def stats(engine: Engine) -> dict[str, int]:
    scheduler, pool, metrics = engine.scheduler, engine.kv.pool, engine.metrics
    running = scheduler.running
    disk = engine.kv.disk
    on_disk = {} if disk is None else {f"kv_disk_{k}_total": v for k, v in vars(disk.stats).items()}
    return {
        "requests_running": len(running),
        "requests_waiting": len(scheduler.waiting) + len(engine.queued()),
        "requests_prefilling": sum(r.state is RequestState.PREFILLING for r in running),
        "kv_blocks_used": pool.num_used,
        "kv_blocks_cached": pool.num_cached,
        "kv_blocks_free": pool.num_free,
        "kv_blocks_total": pool.num_blocks,
        "prefix_cache_hit_tokens_total": scheduler.prefix_hit_tokens,
        "prefix_cache_queried_tokens_total": scheduler.prefix_queried_tokens,
        "preemptions_total": scheduler.preemptions,
        "prompt_chunks_overlapped_total": scheduler.in_flight.prompt_chunks_overlapped,
        "speculative_proposed_tokens_total": metrics.speculative_proposed_tokens,
        "speculative_accepted_tokens_total": metrics.speculative_accepted_tokens,
        "steps_in_flight": engine.steps_in_flight,
        "steps_overlapped_total": engine.steps_overlapped,
        **on_disk,
    }


def summary(engine: Engine, max_rows: int = 100) -> dict[str, Any]:
    """For the live view (server/live.py): each live sequence's short id, state, service
    class, tenant (None without --api-keys), counts and timings (running ones first, then the queue, at most max_rows), the
    last step's token counts and the KV blocks in use. Call it on the engine thread, between
    steps."""
    now = time.monotonic()
    incoming = engine.queued()
    running, waiting = engine.scheduler.running, engine.scheduler.waiting
    rows = []
    for req in [*running, *waiting, *incoming][:max_rows]:
        prompt = len(req.prompt_ids)
        first = req.first_token_time
        rows.append(
            {
                "id": req.request_id[:SUMMARY_ID_CHARS],
                "index": req.index,
                "state": req.state.value,
                "class": req.params.service_class,
                "tenant": req.params.tenant,
                "prompt_tokens": prompt,
                "computed": min(req.num_computed, prompt),
                "reloaded": req.disk_prompt_tokens,
                "generated": len(req.output_ids),
                "age_s": round(now - req.arrival_time, 3),
                "ttft_s": None if first is None else round(first - req.arrival_time, 3),
            }
        )
    decode, prefill, seconds = engine.last_step
    pool = engine.kv.pool
    return {
        "steps": engine.num_steps,
        "last_step": {
            "decode_tokens": decode,
            "prefill_tokens": prefill,
            "ms": round(seconds * 1000, 2),
        },
        "kv_blocks": {"used": pool.num_used, "cached": pool.num_cached, "total": pool.num_blocks},
        "running": len(running),
        "waiting": len(waiting) + len(incoming),
        "requests": rows,
    }
