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


class ShareMetrics:
    """One service class's, or one tenant's, share of the request metrics; with a latency
    target, how many of its tokens missed it."""

    def __init__(self, ttft_target: float | None = None, itl_target: float | None = None) -> None:
        self.time_to_first_token = Histogram(_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(_LATENCY_BUCKETS)
        self.requests_finished = 0
        self.ttft_target, self.itl_target = ttft_target, itl_target
        self.ttft_missed = 0  # first tokens later than ttft_target
        self.itl_missed = 0  # next tokens later than itl_target after the one before

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.ttft_missed += self.ttft_target is not None and seconds > self.ttft_target

    def next_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self.itl_missed += self.itl_target is not None and seconds > self.itl_target


class EngineMetrics:
    def __init__(
        self,
        ttft_targets: dict[str, float] | None = None,
        itl_targets: dict[str, float] | None = None,
    ) -> None:
        """ttft_targets, itl_targets: seconds, by service class (EngineConfig.latency_targets)."""
        self.time_to_first_token = Histogram(_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(_LATENCY_BUCKETS)
        self.step_time = Histogram(_LATENCY_BUCKETS)
        self.generation_tokens = 0
        # Speculative decoding: tokens proposed and verified, and those of them accepted.
        self.speculative_proposed_tokens = 0
        self.speculative_accepted_tokens = 0
        self.requests_finished: dict[str, int] = {}
        # Every class from the start, so that the label set is fixed and each series exists.
        ttft, itl = ttft_targets or {}, itl_targets or {}
        self.by_class = {c: ShareMetrics(ttft.get(c), itl.get(c)) for c in SERVICE_CLASSES}
        # Tenants as they come (SamplingParams.tenant: the server's come from its key file,
        # which bounds them; it exports only the file's current tenants).
        self.by_tenant: dict[str, ShareMetrics] = {}

    def _shares(self, service_class: str, tenant: str | None) -> list[ShareMetrics]:
        shares = [self.by_class[service_class]]
        if tenant is not None:
            shares.append(self.by_tenant.setdefault(tenant, ShareMetrics()))
        return shares

    def first_token(self, service_class: str, tenant: str | None, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        for share in self._shares(service_class, tenant):
            share.first_token(seconds)

    def next_token(self, service_class: str, tenant: str | None, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        for share in self._shares(service_class, tenant):
            share.next_token(seconds)

    def finished(self, service_class: str, tenant: str | None, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        for share in self._shares(service_class, tenant):
            share.requests_finished += 1
