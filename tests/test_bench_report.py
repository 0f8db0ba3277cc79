"""`gapless bench report`: the benchmarks page's table and plots from results.json files, on
small fixtures of each kind of file the bench writes (no server runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gapless.bench.cli import add_bench_parser
from gapless.bench.client import RequestRecord
from gapless.bench.pipeline import format_pipeline_table
from gapless.bench.rounds import summarize
from gapless.bench.startup import format_startup_table
from gapless.bench.startup import summarize as startup_medians

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WHERE = {"written": "2026-12-07 16:00 UTC", "cpu": "Test CPU, 2 cores"}


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gapless")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def write(path: Path, data: dict) -> Path:
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(data))
    return path


def decode_results() -> dict:
    # llama's time over gapless's: 20/10 = 2.0x at batch 4, 10/10 at batch 1, 300/150 prefill.
    times = {
        "b1": {"llama": [10.0, 10.0, 10.0], "gapless": [10.0, 10.0, 10.0]},
        "b4": {"llama": [20.0, 20.0, 20.0], "gapless": [10.0, 10.0, 10.0]},
        "pf": {"llama": [300.0, 300.0, 300.0], "gapless": [150.0, 150.0, 150.0]},
    }
    servers = {"llama": {"url": "u", "model": "m"}, "gapless": {"url": "v", "model": "m"}}
    return {
        "bench": "decode",
        "provenance": {**WHERE, "command": "gapless bench decode llama=8090@F gapless=8091@N"},
        "config": {"servers": servers, "shape": {"prefill_tokens": 1024}},
        "times_ms": times,
        "summary": summarize(times),
    }


def capacity_results(qps: float) -> dict:
    trial = {"qps": qps, "tbt_ms_p99": 100.0, "sched_delay_s_p50": 0.1, "fell_behind": False}
    return {
        "provenance": {**WHERE, "command": "gapless bench capacity --url U --model M"},
        "config": {"slo_tbt_ms": [120.0, 600.0]},
        "systems": {
            "default": {"capacity_qps": {"120.0": qps, "600.0": None}, "trials": [trial]},
        },
    }


def stall_results() -> dict:
    def record(rid: int, tag: str, tokens: list[float]) -> dict:
        rec = RequestRecord(rid, tag, 0.0, 16, len(tokens), token_s=tokens)
        return rec.to_dict()

    def run(stall: float) -> dict:
        metrics = {"max_stall_ms": stall, "long_ttft_ms": 2 * stall, "tpot_ms_p50": 10.0}
        requests = [record(0, "stream", [0.1, 0.2, 0.3]), record(1, "long", [0.25])]
        return {"metrics": metrics, "by_share": {}, "requests": requests}

    return {
        "config": {"workload": {"name": "stall"}},
        "configs": {"blocking": run(2000.0), "chunk512": run(200.0)},
    }


def test_report_builds_the_page_table_and_plots_from_results_files(tmp_path, capsys):
    decode = write(tmp_path / "decode", decode_results())
    ours = write(tmp_path / "cap-ours", capacity_results(0.9))
    vllm = write(tmp_path / "cap-vllm", capacity_results(0.45))
    stall = write(tmp_path / "stall", stall_results())
    out = tmp_path / "page"
    rc = bench(
        ["report", str(decode), f"vllm={vllm}", f"gapless={ours}", str(stall), "--out", str(out)]
    )
    assert rc == 0
    table = (out / "table.md").read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    lines = table.splitlines()
    assert (
        lines[0]
        == "| What | Figures | Against the first (above 1x: better) | CPU, date | Command |"
    )
    by_what = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines[2:]}
    b4 = by_what["decode batch 4: time per output token (ms)"]
    assert b4[1:3] == ["llama 20.00; gapless 10.00", "gapless 2.00x llama"]
    assert b4[3] == "Test CPU, 2 cores, 2026-12-07 16:00 UTC"
    assert b4[4] == "`gapless bench decode llama=8090@F gapless=8091@N` |"
    pf = by_what["prefill, 1024-token prompt: TTFT (ms)"]
    assert pf[2] == "gapless 2.00x llama"
    # One system per file: named by its label; a capacity of None (not found) is left out.
    cap = by_what["capacity at P99 TBT ≤ 120 ms (req/s)"]
    assert cap[1:3] == ["vllm 0.45; gapless 0.9", "gapless 2.00x vllm"]
    assert "capacity at P99 TBT ≤ 600 ms (req/s)" not in by_what
    # Two systems in one file keep their names; a file without provenance says so.
    stall_row = by_what["stall: max stall of the streams during a long prefill (ms)"]
    assert stall_row[1:3] == ["blocking 2000; chunk512 200", "chunk512 10.00x blocking"]
    assert stall_row[3].startswith("CPU not recorded, ") and stall_row[4] == "`not recorded` |"
    for plot in ("timeline.png", "decode.png", "capacity.png"):
        data = (out / plot).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, plot


def test_report_reads_pipeline_and_startup_results(tmp_path, capsys):
    pipeline = {
        "bench": "pipeline",
        "config": {"streams": 8, "long_tokens": 4096},
        "medians": {
            "decode_tokens_per_s": {"one rank, 2 threads": 174.1, "half": 80.0, "P=2": 111.1},
            "max_gap_ms": {"one rank, 2 threads": 1752.0, "P=2": 1633.0},
            "long_ttft_s": {"one rank, 2 threads": 5.0, "P=2": 5.1},
        },
        "decode_ratio": 111.1 / 174.1,
        "bubble": 0.31,
        "max_gap_ratio": 1633 / 1752,
    }
    assert "| P=2 against one rank | 0.64x (bubble 31%) | 0.93x | |" in format_pipeline_table(
        pipeline
    )
    runs = [{"port open": 2.0, "first token": 3.0}, {"port open": 4.0, "first token": 5.0}]
    assert list(startup_medians(runs).items())[:2] == [("port open", 3.0), ("first token", 4.0)]
    assert "| port open | 2.00 | 4.00 | 3.00 |" in format_startup_table(runs)
    startup = {"bench": "startup", "medians": startup_medians(runs)}
    rc = bench(
        ["report", str(write(tmp_path / "p", pipeline)), str(write(tmp_path / "s", startup))]
    )
    assert rc == 0
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")
        for line in capsys.readouterr().out.splitlines()[2:]
        if line
    }
    assert rows["pipeline: 8 streams' decode (tok/s)"][2] == "P=2 0.64x one rank, 2 threads"
    assert rows["pipeline: longest gap beside a 4096-token prompt (ms)"][2] == (
        "P=2 1.07x one rank, 2 threads"
    )
    assert rows["start-up: port open, seconds since launch"][1] == "gapless 3.00"


def test_report_refuses_a_file_the_bench_did_not_write(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"something": 1}))
    assert bench(["report", str(tmp_path)]) == 2
    assert "not a results file" in capsys.readouterr().err
