"""Capacity under a latency SLO, as Sarathi-Serve measures it: the highest Poisson arrival rate
at which the P99 time between tokens stays within an SLO and the median scheduling delay stays
within a bound.

The search is a pure function over a `trial(qps) -> TrialResult` callable, so it can be
checked against a simulated server; `run_trial` is the real one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gapless.bench.client import RequestRecord, run_requests
from gapless.bench.metrics import compute_metrics
from gapless.bench.workloads import WorkloadSpec, build_workload


class TrialError(RuntimeError):
    """A trial in which no request got through: the server is down, not over capacity."""


@dataclass(frozen=True)
class CapacitySLO:
    tbt_ms: float  # P99 time between tokens, over every gap of every stream
    sched_delay_s: float  # median scheduling delay


@dataclass(frozen=True)
class TrialResult:
    qps: float
    tbt_ms_p99: float | None
    sched_delay_s_p50: float | None
    # Some request failed or was still unfinished at the trial's deadline: the server did not
    # keep up with the rate, whatever its latencies were for the requests it served.
    fell_behind: bool
    metrics: dict[str, Any] = field(default_factory=dict)

    def meets(self, slo: CapacitySLO) -> bool:
        return (
            not self.fell_behind
            and self.tbt_ms_p99 is not None
            and self.tbt_ms_p99 <= slo.tbt_ms
            and self.sched_delay_s_p50 is not None
            and self.sched_delay_s_p50 <= slo.sched_delay_s
        )


def find_capacity(
    trial: Callable[[float], TrialResult],
    slo: CapacitySLO,
    start_qps: float,
    min_qps: float,
    max_qps: float,
    step: float = 0.05,
) -> float | None:
    """The largest rate in [min_qps, max_qps] found to meet `slo`, within `step` (relative) of
    the lowest rate found to miss it; None if even `min_qps` misses.

    Assumes that a rate that misses the SLO is not followed by a higher one that meets it.
    Doubles or halves from `start_qps` until the two sides are bracketed, then bisects
    geometrically, since rates are compared by ratio.
    """
    qps = min(max(start_qps, min_qps), max_qps)
    if trial(qps).meets(slo):
        lo = qps
        while True:
            if lo >= max_qps:
                return lo
            hi = min(2 * lo, max_qps)
            if not trial(hi).meets(slo):
                break
            lo = hi
    else:
        hi = qps
        while True:
            if hi <= min_qps:
                return None
            lo = max(hi / 2, min_qps)
            if trial(lo).meets(slo):
                break
            hi = lo
    while hi > lo * (1 + step):
        mid = math.sqrt(lo * hi)
        if trial(mid).meets(slo):
            lo = mid
        else:
            hi = mid
    return lo


def trial_result(
    qps: float, records: Sequence[RequestRecord], duration: float, slos: Sequence[CapacitySLO]
) -> TrialResult:
    """A trial's figures from its timelines; goodput counts requests whose TPOT meets each
    SLO's TBT bound (vLLM's definition), per SLO."""
    metrics = compute_metrics(records, duration)
    if metrics["failed"] == len(records):
        error = next(r.error for r in records if r.error)
        raise TrialError(f"every request of the {qps:.3g} req/s trial failed: {error}")
    metrics["goodput_by_slo_tbt_ms"] = {
        str(slo.tbt_ms): compute_metrics(records, duration, {"itl": slo.tbt_ms})["goodput"]
        for slo in slos
    }
    p50_ms = metrics["sched_delay_ms_p50"]
    return TrialResult(
        qps=qps,
        tbt_ms_p99=metrics["itl_ms_p99"],
        sched_delay_s_p50=None if p50_ms is None else p50_ms / 1000,
        fell_behind=metrics["completed"] < len(records),
        metrics=metrics,
    )


def run_trial(
    url: str,
    model: str,
    spec: WorkloadSpec,
    deadline_s: float,
    slos: Sequence[CapacitySLO],
    **client_options: Any,
) -> TrialResult:
    """Send `spec`'s requests; each disconnects at `deadline_s` after the trial's start, so a
    server that falls behind ends the trial instead of hanging it. Arrivals stop at half the
    deadline, which leaves the other half for the last requests to finish."""
    arrivals = replace(spec, duration=deadline_s / 2)
    requests = [
        replace(r, cancel_after_s=deadline_s - r.arrival_s) for r in build_workload(arrivals)
    ]
    records, duration = asyncio.run(
        run_requests(url, model, requests, desc=f"{spec.rate:.3g} req/s", **client_options)
    )
    return trial_result(spec.rate, records, duration, slos)
