"""Benchmark metrics as pure functions over timelines (lists of seconds), following the
definitions of `vllm bench serve`:

- TTFT: first token arrival - send time.
- TPOT: (e2e - TTFT) / (n - 1), e2e = last token arrival - send time; 0 for n < 2, as vLLM.
- ITL: every gap between consecutive token arrivals of one stream.
- scheduling delay: send time to the first byte of the response (a prefill-progress comment
  or a token), so it means the same for any server. Ours sends its first progress comment
  after the step that ran the prompt's first chunk: one step later than it was scheduled.
- max stall: the largest ITL gap whose interval overlaps another request's prefill window
  ([send, first token]); `itl_ms_max` is the largest gap with no such condition.
- goodput: completed requests per second that meet every SLO given. As in vLLM's `--goodput`,
  the `itl` SLO is checked against the request's TPOT, not against each ITL gap.

Which requests count: TTFT over every non-failed request that got a token; TPOT and E2EL over
completed requests only (a cancelled request's end is the client's choice); ITL and stalls over
every non-failed stream, cancelled ones included, since their gaps were really seen.
Throughputs divide by the whole benchmark duration; output tokens include those delivered to
cancelled requests, input tokens count requests whose prefill finished (they got a token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from gapless.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft": "ttft", "itl": "tpot", "tpot": "tpot", "e2el": "e2el"}
Window = tuple[float, float]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vLLM)."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(values: Sequence[float], name: str) -> dict[str, float | None]:
    """`{name}_mean`, `_p50`, `_p90`, `_p99`, `_max`; None when there are no values."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if len(values) == 0:
        return {f"{name}_{k}": None for k in keys}
    arr = np.asarray(values, dtype=float)
    stats = [arr.mean(), *(np.percentile(arr, q) for q in PERCENTILES), arr.max()]
    return {f"{name}_{k}": float(v) for k, v in zip(keys, stats, strict=True)}


def itls(token_times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:], strict=False)]


def ttft(send: float, token_times: Sequence[float]) -> float | None:
    return token_times[0] - send if token_times else None


def sched_delay(
    send: float, progress_times: Sequence[float], token_times: Sequence[float]
) -> float | None:
    first = min([*progress_times[:1], *token_times[:1]], default=None)
    return None if first is None else first - send


def tpot(send: float, token_times: Sequence[float]) -> float | None:
    if not token_times:
        return None
    if len(token_times) < 2:
        return 0.0
    e2e = token_times[-1] - send
    return (e2e - (token_times[0] - send)) / (len(token_times) - 1)


def _overlaps(a: float, b: float, window: Window) -> bool:
    # Open intervals: a gap that merely touches a window's edge did not wait on that prefill.
    return a < window[1] and window[0] < b


def gaps_during(token_times: Sequence[float], window: Window) -> list[float]:
    """The ITL gaps of one stream whose interval overlaps `window`."""
    return [
        b - a for a, b in zip(token_times, token_times[1:], strict=False) if _overlaps(a, b, window)
    ]


def max_stall(streams: Sequence[Sequence[float]], windows: Sequence[Window]) -> float | None:
    """Largest gap of stream i overlapping the prefill window of some request j != i.

    `streams[i]` and `windows[i]` belong to the same request."""
    best = None
    for i, times in enumerate(streams):
        others = [w for j, w in enumerate(windows) if j != i]
        for a, b in zip(times, times[1:], strict=False):
            if (best is None or b - a > best) and any(_overlaps(a, b, w) for w in others):
                best = b - a
    return best


def parse_slo(text: str | None) -> dict[str, float]:
    """`"ttft:500,itl:100"` -> `{"ttft": 500.0, "itl": 100.0}` (milliseconds)."""
    out: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        out[key] = float(value)
    return out


def meets_slo(ttft_ms: float, tpot_ms: float, e2el_ms: float, slo: dict[str, float]) -> bool:
    measured = {"ttft": ttft_ms, "tpot": tpot_ms, "e2el": e2el_ms}
    return all(measured[SLO_KEYS[k]] <= limit for k, limit in slo.items())


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def compute_metrics(
    records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict[str, float | int | None]:
    """Every metric, with a fixed set of keys (None where a metric has no data)."""
    live = [r for r in records if r.error is None]
    done = [r for r in live if not r.cancelled]
    started = [r for r in live if r.token_s]
    ttfts = _ms(ttft(r.send_s, r.token_s) for r in started)
    delays = _ms(sched_delay(r.send_s, [p[0] for p in r.progress], r.token_s) for r in live)
    tpots = _ms(tpot(r.send_s, r.token_s) for r in done)
    e2els = _ms(r.token_s[-1] - r.send_s for r in done if r.token_s)
    gaps = _ms(g for r in live for g in itls(r.token_s))
    stall = max_stall([r.token_s for r in live], [r.prefill_window for r in live])

    good = None
    if slo:
        good = sum(
            1
            for r in done
            if r.token_s
            and meets_slo(
                ttft(r.send_s, r.token_s) * 1000,
                tpot(r.send_s, r.token_s) * 1000,
                (r.token_s[-1] - r.send_s) * 1000,
                slo,
            )
        )
    in_tokens = sum(r.prompt_tokens for r in started)
    out_tokens = sum(r.completion_tokens for r in live)
    cached = [r.cached_tokens for r in started if r.cached_tokens is not None]
    dur = max(duration, 1e-9)
    m: dict[str, float | int | None] = {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(live),
        "cancelled": sum(r.cancelled for r in records),
        "cancelled_in_prefill": sum(r.cancel_phase == "prefill" for r in records),
        "cancelled_in_decode": sum(r.cancel_phase == "decode" for r in records),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "goodput": None if good is None else good / dur,
        "cached_prompt_tokens": sum(cached) if cached else None,
        **summarize(ttfts, "ttft_ms"),
        **summarize(delays, "sched_delay_ms"),
        **summarize(tpots, "tpot_ms"),
        **summarize(gaps, "itl_ms"),
        **summarize(e2els, "e2el_ms"),
        "max_stall_ms": None if stall is None else stall * 1000,
    }
    m.update(_long_request_metrics(live))
    return m


def _long_request_metrics(live: Sequence[RequestRecord]) -> dict[str, float | None]:
    """For the stall workload: the long prompt's TTFT, and the other streams' p99 ITL while it
    was prefilling and their longest gap then over their median gap (1: no stall at all)."""
    long = next((r for r in live if r.tag == "long"), None)
    if long is None:
        return {
            "long_ttft_ms": None,
            "long_prefill_itl_ms_p99": None,
            "long_prefill_gap_ratio": None,
        }
    window = long.prefill_window
    during = _ms(g for r in live if r is not long for g in gaps_during(r.token_s, window))
    gaps = _ms(g for r in live if r is not long for g in itls(r.token_s))
    median = percentile(gaps, 50) if gaps else None
    first = ttft(long.send_s, long.token_s)
    return {
        "long_ttft_ms": None if first is None else first * 1000,
        "long_prefill_itl_ms_p99": percentile(during, 99) if during else None,
        "long_prefill_gap_ratio": max(during) / median if during and median else None,
    }
