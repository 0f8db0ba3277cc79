"""Counters and histograms the engine updates and the server exports (Prometheus text)."""

from __future__ import annotations

import bisect
import threading

from gapless.engine.sampling_params import SERVICE_CLASSES


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
        return [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *self.samples(name)]

    def samples(self, name: str, labels: str = "") -> list[str]:
        """Its sample lines; `labels` (`class="batch"`) go on each."""
        each = f"{labels}," if labels else ""
        own = f"{{{labels}}}" if labels else ""
        with self._lock:
            lines = []
            cumulative = 0
            for bound, n in zip(self.buckets, self.counts, strict=False):
                cumulative += n
                lines.append(f'{name}_bucket{{{each}le="{bound:g}"}} {cumulative}')
            lines.append(f'{name}_bucket{{{each}le="+Inf"}} {self.count}')
            lines.append(f"{name}_sum{own} {self.sum:.6f}")
            lines.append(f"{name}_count{own} {self.count}")
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


class ClassMetrics:
    """One service class's share of the request metrics."""

    def __init__(self) -> None:
        self.time_to_first_token = Histogram(_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(_LATENCY_BUCKETS)
        self.requests_finished = 0


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
        # Every class from the start, so that the label set is fixed and each series exists.
        self.by_class = {name: ClassMetrics() for name in SERVICE_CLASSES}

    def first_token(self, service_class: str, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.by_class[service_class].time_to_first_token.observe(seconds)

    def next_token(self, service_class: str, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self.by_class[service_class].inter_token_latency.observe(seconds)

    def finished(self, service_class: str, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        self.by_class[service_class].requests_finished += 1
