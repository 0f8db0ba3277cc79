"""`gapless bench report`: the benchmarks page's main table and plots, built from the
results.json files that the bench's runs wrote.

Each file is read by what wrote it: a workload run (`gapless bench --workload ...`), a capacity
search (`gapless bench capacity`), alternating rounds (`gapless bench decode`), a pipeline run
(`gapless bench pipeline`) or a start-up run (`gapless bench startup`). A file may be given as
LABEL=PATH: its one system (a `--url` run's "default") is then named LABEL, or each of its
systems LABEL/NAME, so that runs of different servers sit side by side. A row's ratio sets each
later system against the row's first: how many times its rate (or 1 / its time) that is.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gapless.bench.capacity import TrialResult
from gapless.bench.client import RequestRecord
from gapless.bench.report import plot_capacity, plot_decode, plot_timeline
from gapless.bench.rounds import batch_size, decode_rates


def provenance() -> dict[str, Any]:
    """What every results.json records of its run: when, on what CPU, and the command."""
    from gapless.kernels.machine import machine

    return {
        "written": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{machine().cpu_name}, {len(os.sched_getaffinity(0))} cores",
        "command": shlex.join(["gapless", *sys.argv[1:]]),
    }


@dataclass
class Results:
    label: str | None
    path: Path
    data: dict[str, Any]

    def name(self, system: str, alone: bool) -> str:
        """A system's name in the table: the label alone for a file's one system."""
        if self.label is None:
            return system
        return self.label if alone else f"{self.label}/{system}"

    @property
    def kind(self) -> str:
        if "bench" in self.data:
            return self.data["bench"]
        if "systems" in self.data:
            return "capacity"
        if "configs" in self.data:
            return "workload"
        raise ValueError(f"{self.path}: not a results file of gapless bench")

    @property
    def where(self) -> str:
        """CPU and date, as the run recorded them (the file's time where it did not)."""
        p = self.data.get("provenance", {})
        written = p.get("written") or datetime.fromtimestamp(
            self.path.stat().st_mtime, UTC
        ).strftime("%Y-%m-%d %H:%M UTC (file time)")
        return f"{p.get('cpu', 'CPU not recorded')}, {written}"

    @property
    def command(self) -> str:
        return self.data.get("provenance", {}).get("command", "not recorded")


def load(spec: str) -> Results:
    """LABEL=PATH or PATH; PATH a results.json or the directory holding one."""
    label, eq, path = spec.partition("=")
    if not eq:
        label, path = "", spec
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    return Results(label or None, p, json.loads(p.read_text()))


def _ratio_cell(values: list[tuple[str, float]], higher_is_better: bool) -> str:
    if len(values) < 2 or not values[0][1]:
        return "-"
    first, ref = values[0]
    cells = []
    for name, v in values[1:]:
        if not v:
            continue
        ratio = v / ref if higher_is_better else ref / v
        cells.append(f"{name} {ratio:.2f}x {first}")
    return "; ".join(cells) or "-"


@dataclass
class Row:
    """One line of the table: a figure of every system that measured it, from any files."""

    fmt: str
    higher_is_better: bool
    values: list[tuple[str, float]]
    wheres: list[str]
    commands: list[str]

    def cells(self, what: str) -> list[str]:
        figures = "; ".join(f"{n} {format(v, self.fmt)}" for n, v in self.values)
        ratio = _ratio_cell(self.values, self.higher_is_better)
        where = "; ".join(dict.fromkeys(self.wheres))
        commands = "; ".join(f"`{c}`" for c in dict.fromkeys(self.commands))
        return [what, figures, ratio, where, commands]


def rows(results: Iterable[Results]) -> list[list[str]]:
    """The table's rows: what, figures, ratio, CPU and date, command. Files that measured the
    same thing (a capacity search of each server, say) share its row, in the files' order."""
    table: dict[str, Row] = {}

    def add(what: str, values: list[tuple[str, float]], fmt: str, higher: bool, r: Results):
        row = table.setdefault(what, Row(fmt, higher, [], [], []))
        row.values += values
        row.wheres.append(r.where)
        row.commands.append(r.command)

    for r in results:
        d = r.data
        if r.kind == "workload":
            configs = d["configs"]
            alone = len(configs) == 1
            metrics = {r.name(n, alone): c["metrics"] for n, c in configs.items()}
            workload = d["config"]["workload"]["name"]
            for key, label, fmt in (
                ("max_stall_ms", "max stall of the streams during a long prefill (ms)", ".0f"),
                ("long_ttft_ms", "long prompt TTFT (ms)", ".0f"),
                ("long_prefill_gap_ratio", "longest gap in a long prefill / median gap", ".2f"),
                ("tpot_ms_p50", "TPOT p50 (ms)", ".1f"),
                ("output_throughput", "output throughput (tok/s)", ".1f"),
            ):
                values = [(n, m[key]) for n, m in metrics.items() if m.get(key) is not None]
                if values:
                    higher = key == "output_throughput"
                    add(f"{workload}: {label}", values, fmt, higher, r)
        elif r.kind == "capacity":
            systems = d["systems"]
            alone = len(systems) == 1
            for slo in d["config"]["slo_tbt_ms"]:
                values = [
                    (r.name(n, alone), s["capacity_qps"].get(str(float(slo))))
                    for n, s in systems.items()
                ]
                values = [(n, v) for n, v in values if v is not None]
                if values:
                    what = f"capacity at P99 TBT ≤ {slo:g} ms (req/s)"
                    add(what, values, ".3g", True, r)
        elif r.kind == "decode":
            names = list(d["config"]["servers"])
            alone = len(names) == 1
            for kind, s in d["summary"].items():
                values = [(r.name(n, alone), s["median_ms"][n]) for n in names]
                if (n := batch_size(kind)) is None:
                    what = (
                        f"prefill, {d['config']['shape']['prefill_tokens']}-token prompt: TTFT (ms)"
                    )
                else:
                    what = f"decode batch {n}: time per output token (ms)"
                add(what, values, ".2f", False, r)
        elif r.kind == "pipeline":
            m = d["medians"]
            rates = list(m["decode_tokens_per_s"].items())
            streams = d["config"]["streams"]
            what = f"pipeline: {streams} streams' decode (tok/s)"
            add(what, [rates[0], rates[-1]], ".1f", True, r)
            gaps = list(m["max_gap_ms"].items())
            what = f"pipeline: longest gap beside a {d['config']['long_tokens']}-token prompt (ms)"
            add(what, gaps, ".0f", False, r)
        elif r.kind == "startup":
            medians = d["medians"]
            for mark in ("port open", "first token"):
                if medians.get(mark) is not None:
                    what = f"start-up: {mark}, seconds since launch"
                    add(what, [(r.label or "gapless", medians[mark])], ".2f", False, r)
    return [row.cells(what) for what, row in table.items()]


def format_page_table(table_rows: list[list[str]]) -> str:
    lines = [
        "| What | Figures | Against the first (above 1x: better) | CPU, date | Command |",
        "|---|---|---|---|---|",
    ]
    lines += [
        "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows
    ]
    return "\n".join(lines) + "\n"


def write_plots(results: list[Results], out: Path) -> list[str]:
    """timeline.png (stall runs' token timelines), decode.png (decode rate by batch size),
    capacity.png (P99 TBT by rate): each where some file has its data."""
    written = []
    timelines: dict[str, list[RequestRecord]] = {}
    rates: dict[str, dict[int, float]] = {}
    trials: dict[str, list[TrialResult]] = {}
    capacities: dict[str, dict[float, float | None]] = {}
    for r in results:
        if r.kind == "workload" and r.data["config"]["workload"]["name"] == "stall":
            configs = r.data["configs"]
            for n, c in configs.items():
                records = [RequestRecord.from_dict(q) for q in c["requests"]]
                timelines[r.name(n, len(configs) == 1)] = records
        elif r.kind == "decode":
            names = r.data["config"]["servers"]
            for n, by_batch in decode_rates(r.data["summary"]).items():
                rates[r.name(n, len(names) == 1)] = by_batch
        elif r.kind == "capacity":
            systems = r.data["systems"]
            for n, s in systems.items():
                name = r.name(n, len(systems) == 1)
                trials[name] = [TrialResult(**t) for t in s["trials"]]
                capacities[name] = {float(k): v for k, v in s["capacity_qps"].items()}
    if timelines:
        plot_timeline(timelines, out / "timeline.png")
        written.append("timeline.png")
    if rates:
        plot_decode(rates, out / "decode.png")
        written.append("decode.png")
    if trials:
        plot_capacity(trials, capacities, out / "capacity.png")
        written.append("capacity.png")
    return written
