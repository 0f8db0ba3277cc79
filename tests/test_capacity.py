"""The capacity search against simulated servers whose latencies are known functions of the
rate, the chat workload's length fits, and a trial's figures from hand-built timelines."""

from __future__ import annotations

import numpy as np
import pytest

from gapless.bench.capacity import (
    CapacitySLO,
    TrialError,
    TrialResult,
    find_capacity,
    trial_result,
)
from gapless.bench.client import RequestRecord
from gapless.bench.metrics import sched_delay
from gapless.bench.workloads import WorkloadSpec, build_workload

STEP = 0.05


class SimulatedServer:
    """P99 TBT rises linearly with the rate, the scheduling delay once the rate passes
    `queue_at`, and beyond `falls_behind_at` requests stop finishing."""

    def __init__(
        self, tbt_ms_per_qps: float, queue_at: float = np.inf, falls_behind_at: float = np.inf
    ):
        self.tbt_ms_per_qps = tbt_ms_per_qps
        self.queue_at = queue_at
        self.falls_behind_at = falls_behind_at
        self.tried: list[float] = []

    def __call__(self, qps: float) -> TrialResult:
        self.tried.append(qps)
        return TrialResult(
            qps=qps,
            tbt_ms_p99=50.0 + self.tbt_ms_per_qps * qps,
            sched_delay_s_p50=0.1 + max(0.0, qps - self.queue_at) * 10.0,
            fell_behind=qps > self.falls_behind_at,
        )


def assert_within_step(found: float | None, capacity: float) -> None:
    assert found is not None
    assert capacity / (1 + STEP) <= found <= capacity


# TBT reaches the 250 ms SLO at (250 - 50) / tbt_ms_per_qps.
@pytest.mark.parametrize(
    ("tbt_ms_per_qps", "start", "capacity"),
    [(100.0, 1.0, 2.0), (100.0, 16.0, 2.0), (7.0, 1.0, 200 / 7), (2000.0, 1.0, 0.1)],
)
def test_finds_the_tbt_bound_from_either_side(tbt_ms_per_qps, start, capacity):
    server = SimulatedServer(tbt_ms_per_qps)
    found = find_capacity(server, CapacitySLO(250.0, 2.0), start, 0.01, 100.0, STEP)
    assert_within_step(found, capacity)
    # Doubling or halving to bracket, then about log2(ln 2 / ln 1.05) = 4 bisections.
    assert len(server.tried) <= 12


def test_scheduling_delay_and_falling_behind_bind_too():
    slo = CapacitySLO(250.0, 2.0)
    # TBT alone allows 20 req/s; the median delay passes 2 s at 3 + 1.9 / 10 req/s.
    queueing = SimulatedServer(10.0, queue_at=3.0)
    assert_within_step(find_capacity(queueing, slo, 1.0, 0.01, 100.0, STEP), 3.19)
    behind = SimulatedServer(10.0, falls_behind_at=5.0)
    assert_within_step(find_capacity(behind, slo, 1.0, 0.01, 100.0, STEP), 5.0)


def test_a_stricter_slo_finds_a_lower_capacity_with_the_same_trials():
    server = SimulatedServer(100.0)
    seen: dict[float, TrialResult] = {}

    def cached(qps: float) -> TrialResult:
        if qps not in seen:
            seen[qps] = server(qps)
        return seen[qps]

    strict = find_capacity(cached, CapacitySLO(100.0, 2.0), 1.0, 0.01, 100.0, STEP)
    relaxed = find_capacity(cached, CapacitySLO(1250.0, 2.0), 1.0, 0.01, 100.0, STEP)
    assert_within_step(strict, 0.5)
    assert_within_step(relaxed, 12.0)


def test_range_ends():
    slo = CapacitySLO(250.0, 2.0)
    # Meets the SLO at the top of the range: capacity is the top, after log2(100) doublings.
    fast = SimulatedServer(0.1)
    assert find_capacity(fast, slo, 1.0, 0.01, 100.0, STEP) == 100.0
    assert len(fast.tried) == 8
    # Misses it even at the bottom.
    slow = SimulatedServer(1e6)
    assert find_capacity(slow, slo, 1.0, 0.01, 100.0, STEP) is None
    assert min(slow.tried) == 0.01
    # No trial ever runs outside the range, wherever the search starts.
    assert all(0.01 <= q <= 100.0 for q in fast.tried + slow.tried)


def test_chat_lengths_follow_the_fits():
    spec = WorkloadSpec("chat", num_requests=4000, vocab_size=512)
    reqs = build_workload(spec)
    prompts = np.array([len(r.prompt) for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    assert np.median(prompts) == pytest.approx(1730, rel=0.05)
    assert np.percentile(prompts, 90) == pytest.approx(5696, rel=0.05)
    assert np.median(outputs) == pytest.approx(415, rel=0.05)
    assert np.percentile(outputs, 90) == pytest.approx(834, rel=0.05)


def test_chat_scales_clips_and_keeps_requests_across_rates():
    spec = WorkloadSpec(
        "chat", num_requests=200, vocab_size=512, length_scale=0.25, max_model_len=1024
    )
    slow = build_workload(spec)
    assert all(len(r.prompt) + r.max_tokens <= 1024 and r.max_tokens >= 2 for r in slow)
    assert np.median([r.max_tokens for r in slow]) == pytest.approx(415 / 4, rel=0.15)
    # At 4x the rate the same lengths arrive 4x sooner; a duration cap only drops the tail.
    # The prompts' tokens differ, so no prefix cache carries one trial into the next.
    fast = build_workload(WorkloadSpec(**{**spec.__dict__, "rate": 4.0, "duration": 10.0}))
    assert 0 < len(fast) < len(slow)
    for a, b in zip(slow, fast, strict=False):
        assert (len(a.prompt), a.max_tokens) == (len(b.prompt), b.max_tokens)
        assert a.prompt != b.prompt
        assert b.arrival_s == pytest.approx(a.arrival_s / 4)
    assert [r.prompt for r in build_workload(spec)] == [r.prompt for r in slow]


def _rec(rid: int, send: float, tokens: list[float], **kw) -> RequestRecord:
    return RequestRecord(rid, "", send, 10, len(tokens), token_s=tokens, **kw)


def test_sched_delay_is_the_first_byte():
    assert sched_delay(1.0, [1.5, 1.7], [2.0]) == pytest.approx(0.5)
    assert sched_delay(1.0, [], [2.0]) == pytest.approx(1.0)
    assert sched_delay(1.0, [], []) is None


def test_trial_result_from_timelines():
    done = _rec(0, 0.0, [0.5, 0.6, 0.7], progress=[(0.2, 10, 10)])
    slow = _rec(1, 0.0, [1.0, 1.5])
    cut = _rec(2, 0.5, [], cancelled=True, cancel_phase="prefill")
    slos = [CapacitySLO(100.0, 2.0), CapacitySLO(1000.0, 2.0)]
    ok = trial_result(2.0, [done, slow], 2.0, slos)
    assert not ok.fell_behind
    assert ok.tbt_ms_p99 == pytest.approx(np.percentile([100, 100, 500], 99))
    assert ok.sched_delay_s_p50 == pytest.approx(0.6)  # median of 0.2 and 1.0
    # TPOTs are 100 and 500 ms: one request per 2 s meets 100 ms, both meet 1 s.
    assert ok.metrics["goodput_by_slo_tbt_ms"] == {"100.0": 0.5, "1000.0": 1.0}
    assert ok.meets(CapacitySLO(1000.0, 2.0)) and not ok.meets(CapacitySLO(100.0, 2.0))
    assert not ok.meets(CapacitySLO(1000.0, 0.5))
    behind = trial_result(2.0, [done, slow, cut], 2.0, slos)
    assert behind.fell_behind and not behind.meets(CapacitySLO(1e9, 1e9))
    with pytest.raises(TrialError, match="HTTP 503"):
        trial_result(2.0, [_rec(0, 0.0, [], error="HTTP 503")], 1.0, slos)
