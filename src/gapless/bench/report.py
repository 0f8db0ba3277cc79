"""Comparison table (markdown) and PNG plots: token timelines, the ITL CDF, capacity."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from gapless.bench.capacity import TrialResult
from gapless.bench.client import RequestRecord
from gapless.bench.metrics import itls

# (metric key, row label, format); rows where every config has no value are left out.
TABLE_ROWS = [
    ("completed", "completed requests", "d"),
    ("failed", "failed requests", "d"),
    ("cancelled", "cancelled (prefill/decode)", "cancel"),
    ("duration_s", "duration (s)", ".2f"),
    ("request_throughput", "request throughput (req/s)", ".3f"),
    ("output_throughput", "output throughput (tok/s)", ".1f"),
    ("speculative_proposed", "speculative tokens proposed", "d"),
    ("speculative_acceptance", "speculative acceptance (accepted/proposed)", ".3f"),
    ("total_token_throughput", "total throughput (tok/s)", ".1f"),
    ("goodput", "goodput (req/s)", ".3f"),
    ("cached_prompt_tokens", "prompt tokens cached (usage)", "d"),
    ("ttft_ms_p50", "TTFT p50 (ms)", ".1f"),
    ("ttft_ms_p99", "TTFT p99 (ms)", ".1f"),
    ("sched_delay_ms_p50", "scheduling delay p50 (ms)", ".1f"),
    ("tpot_ms_p50", "TPOT p50 (ms)", ".1f"),
    ("tpot_ms_p99", "TPOT p99 (ms)", ".1f"),
    ("itl_ms_p50", "ITL p50 (ms)", ".1f"),
    ("itl_ms_p90", "ITL p90 (ms)", ".1f"),
    ("itl_ms_p99", "ITL p99 (ms)", ".1f"),
    ("max_stall_ms", "max stall during a prefill (ms)", ".1f"),
    ("itl_ms_max", "max ITL, any (ms)", ".1f"),
    ("long_ttft_ms", "long prompt TTFT (ms)", ".1f"),
    ("long_prefill_itl_ms_p99", "ITL p99 during long prefill (ms)", ".1f"),
    ("long_prefill_gap_ratio", "longest gap during long prefill / median gap", ".2f"),
]


def _cell(metrics: Mapping, key: str, fmt: str) -> str:
    if fmt == "cancel":
        if not metrics.get("cancelled"):
            return "0"
        return (
            f"{metrics['cancelled']} ({metrics['cancelled_in_prefill']}/"
            f"{metrics['cancelled_in_decode']})"
        )
    value = metrics.get(key)
    return "-" if value is None else format(value, fmt)


def format_table(metrics_by_config: Mapping[str, Mapping]) -> str:
    """A markdown table: one row per metric, one column per configuration."""
    names = list(metrics_by_config)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key, label, fmt in TABLE_ROWS:
        if all(m.get(key) is None for m in metrics_by_config.values()):
            continue
        cells = [_cell(metrics_by_config[n], key, fmt) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _save(fig: Figure, path: Path) -> None:
    # A bare Figure with an Agg canvas: no pyplot global state, no display needed.
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)


def plot_timeline(records_by_config: Mapping[str, Sequence[RequestRecord]], path: Path) -> None:
    """One panel per config; a row per request with a tick per token arrival, its prefill
    window shaded, prefill-progress events as dots and client disconnects as red crosses."""
    n_panels = len(records_by_config)
    rows = max(len(r) for r in records_by_config.values()) if records_by_config else 1
    panel_h = min(6.0, 1.0 + 0.3 * rows)
    fig = Figure(figsize=(11, panel_h * n_panels + 0.6), layout="constrained")
    axes = fig.subplots(n_panels, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, records) in zip(axes, records_by_config.items(), strict=True):
        for y, rec in enumerate(records):
            start, end = rec.prefill_window
            ax.broken_barh(
                [(start, max(end - start, 1e-4))],
                (y - 0.4, 0.8),
                color="tab:orange",
                alpha=0.3,
                linewidth=0,
            )
            if rec.progress:
                ax.plot(
                    [p[0] for p in rec.progress],
                    [y] * len(rec.progress),
                    ".",
                    color="tab:orange",
                    markersize=3,
                )
            if rec.cancelled and rec.end_s is not None:
                ax.plot([rec.end_s], [y], "x", color="tab:red")
        ax.eventplot(
            [rec.token_s for rec in records],
            lineoffsets=list(range(len(records))),
            linelengths=0.7,
            linewidths=0.6,
            colors="tab:blue",
        )
        ax.set_yticks(
            range(len(records)),
            [f"{r.rid}{' ' + r.tag if r.tag else ''}" for r in records],
            fontsize=7,
        )
        ax.set_ylim(-0.7, len(records) - 0.3)
        ax.invert_yaxis()
        ax.set_title(f"{name}: token arrivals (ticks), prefill windows (shaded)", fontsize=9)
    axes[-1].set_xlabel("seconds since bench start")
    _save(fig, path)


def plot_itl_cdf(records_by_config: Mapping[str, Sequence[RequestRecord]], path: Path) -> None:
    """One ITL CDF curve per config; symlog x so both typical gaps and stalls are readable
    (zero gaps from multi-token chunks would not fit a plain log axis)."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, records in records_by_config.items():
        gaps = np.sort([g * 1000 for r in records if r.error is None for g in itls(r.token_s)])
        if len(gaps):
            ax.step(gaps, np.arange(1, len(gaps) + 1) / len(gaps), where="post", label=name)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps <= x")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    _save(fig, path)


def plot_capacity(
    trials_by_system: Mapping[str, Sequence[TrialResult]],
    capacity_by_system: Mapping[str, Mapping[float, float | None]],
    path: Path,
) -> None:
    """P99 TBT against the arrival rate, one curve per system (log-log: the search doubles and
    halves). Trials that fell behind are crosses; each SLO is a dashed line and each system's
    capacity under it a dotted vertical in the system's colour."""
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    slos = sorted({slo for caps in capacity_by_system.values() for slo in caps})
    for slo in slos:
        ax.axhline(slo, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"SLO {slo:g} ms", (0.01, slo), xycoords=("axes fraction", "data"), fontsize=8)
    for name, trials in trials_by_system.items():
        points = sorted((t.qps, t.tbt_ms_p99, t.fell_behind) for t in trials if t.tbt_ms_p99)
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=name)
        behind = [p for p in points if p[2]]
        if behind:
            ax.plot([p[0] for p in behind], [p[1] for p in behind], "x", color="tab:red")
        for slo, qps in capacity_by_system[name].items():
            if qps is not None:
                ax.axvline(qps, color=line.get_color(), linestyle=":", linewidth=1.2)
                ax.annotate(
                    f"{qps:.3g}/s @ {slo:g}",
                    (qps, 0.02),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize=7,
                    color=line.get_color(),
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        # Plain numbers: the rates span one or two decades, where 2x10^0 only gets in the way.
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("P99 time between tokens (ms)")
    ax.set_title("capacity: P99 TBT by rate (x: fell behind)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if trials_by_system:
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_tradeoff(metrics_by_config: Mapping[str, Mapping], path: Path) -> None:
    """Stall workload: the long prompt's TTFT against the streams' P99 ITL while it prefills,
    one labelled point per config; HTTP runs are dots, engine-only runs (NAME/engine) crosses."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, m in metrics_by_config.items():
        ttft, itl = m.get("long_ttft_ms"), m.get("long_prefill_itl_ms_p99")
        if ttft is None or itl is None:
            continue
        ax.plot(itl, ttft / 1000, "x" if name.endswith("/engine") else "o", color="tab:blue")
        ax.annotate(name, (itl, ttft / 1000), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("streams' P99 ITL during the long prefill (ms)")
    ax.set_ylabel("long prompt TTFT (s)")
    ax.set_title("latency target trade-off (o: through HTTP, x: engine only)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)


def plot_decode(rates_by_server: Mapping[str, Mapping[int, float]], path: Path) -> None:
    """`gapless bench decode`: output tokens/s (all streams together) against the batch size,
    one line per server."""
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, rates in rates_by_server.items():
        sizes = sorted(rates)
        ax.plot(sizes, [rates[n] for n in sizes], "o-", label=name)
    sizes = sorted({n for rates in rates_by_server.values() for n in rates})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("streams decoding at once (batch size)")
    ax.set_ylabel("output tokens/s, all streams")
    ax.set_title("decode rate by batch size (medians of alternating rounds)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if rates_by_server:
        ax.legend(fontsize=8)
    _save(fig, path)
