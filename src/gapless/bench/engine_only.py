"""`gapless bench --compare ... --engine-only`: the same workload driven into the engine in this
process, with no server, HTTP or client. What a configuration loses through HTTP is the
difference between its two rows."""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

from gapless.bench.client import RequestRecord
from gapless.bench.workloads import BenchRequest
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.engine.sampling_params import SamplingParams


def engine_for(model_dir: Path, flags: list[str]) -> Engine:
    """The engine `gapless serve MODEL_DIR FLAGS` would run, after its start-up step."""
    from gapless.server.cli import add_serve_parser, engine_config

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", str(model_dir), *flags])
    engine = Engine.from_pretrained(model_dir, engine_config(args))
    engine.reserve_peak_memory()
    return engine


def run_engine(
    engine: Engine, requests: list[BenchRequest], temperature: float = 0.0
) -> tuple[list[RequestRecord], float]:
    """Adds each request at its arrival time (between steps) and stamps its tokens when the
    step that made them returns. Cancelling workloads are not supported."""
    if any(r.cancel_after_tokens is not None or r.cancel_after_s is not None for r in requests):
        raise ValueError("--engine-only does not replay client cancellations")
    if any(r.after is not None for r in requests):
        raise ValueError("--engine-only does not replay conversations")
    records = {
        str(r.rid): RequestRecord(
            r.rid,
            r.tag,
            r.arrival_s,
            len(r.prompt),
            r.max_tokens,
            service_class=r.service_class,
            tenant=r.tenant,
        )
        for r in requests
    }
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    start = time.perf_counter()
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            params = SamplingParams(
                max_tokens=r.max_tokens,
                temperature=temperature,
                seed=r.rid,
                ignore_eos=True,
                service_class=r.service_class,
                tenant=r.tenant,
            )
            engine.add_request(r.prompt, params, str(r.rid))
        if not engine.has_work:
            time.sleep(pending[0].arrival_s - now)
            continue
        events = engine.step()
        t = time.perf_counter() - start
        for event in events:
            record = records[event.request_id]
            if isinstance(event, TokenEvent):
                record.token_s += [t] * len(event.token_ids)
            elif isinstance(event, ProgressEvent):
                record.progress.append((t, event.processed, event.total))
            elif isinstance(event, FinishedEvent):
                record.prompt_tokens = event.prompt_tokens  # a text prompt's counted as tokens
                record.completion_tokens = event.completion_tokens
                if event.finish_reason == "error":
                    record.error = event.error
    return list(records.values()), time.perf_counter() - start
