"""Counters and histograms the engine updates and the server exports (Prometheus text)."""

from __future__ import annotations

import bisect
import threading


class Histogram:
    """Cumulative-bucket histogram, Prometheus style."""

    def __init__(self, buckets: list[float]) -> None:
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        with self._lock:
            lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            cumulative = 0
            for bound, n in zip(self.buckets, self.counts, strict=False):
                cumulative += n
                lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
            lines.append(f"{name}_sum {self.sum:.6f}")
            lines.append(f"{name}_count {self.count}")
            return lines


_LATENCY_BUCKETS = [
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
]


class EngineMetrics:
    def __init__(self) -> None:
        self.time_to_first_token = Histogram(_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(_LATENCY_BUCKETS)
        self.step_time = Histogram(_LATENCY_BUCKETS)
        self.generation_tokens = 0
        # Speculative decoding: tokens proposed and verified, and those of them accepted.
        self.speculative_proposed_tokens = 0
        self.speculative_accepted_tokens = 0
        self.requests_finished: dict[str, int] = {}
