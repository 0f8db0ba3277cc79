"""End-to-end runs of `gapless bench`: against a fake SSE server (client, CLI, outputs, a trial
cut at its deadline), and `--compare` and `capacity` against our real server on a tiny random
checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from safetensors import safe_open
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gapless.bench.capacity import CapacitySLO, run_trial
from gapless.bench.cli import add_bench_parser
from gapless.bench.compare import free_port
from gapless.bench.make_model import model_config, tensor_shapes, write_random_safetensors
from gapless.bench.metrics import compute_metrics
from gapless.bench.report import TABLE_ROWS
from gapless.bench.workloads import WorkloadSpec, build_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Every metric the stall workload must produce (goodput because the tests pass --slo).
STALL_METRICS = [
    "duration_s",
    "completed",
    "failed",
    "cancelled",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "max_stall_ms",
    "long_ttft_ms",
    "long_prefill_itl_ms_p99",
    *(
        f"{m}_ms_{s}"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "p50", "p90", "p99", "max")
    ),
]
FAKE_TOKEN_S = 0.01
FAKE_PREFILL_CHUNK = 64


# What the fake server was sent: each request's service_class and Authorization header.
SENT: list[tuple[str | None, str | None]] = []


async def _fake_completions(request: Request) -> StreamingResponse:
    """A server that prefills in chunks (progress comments) and streams one token per chunk."""
    body = await request.json()
    prompt, n = body["prompt"], body["max_tokens"]
    SENT.append((body.get("service_class"), request.headers.get("authorization")))

    async def events():
        for done in range(FAKE_PREFILL_CHUNK, len(prompt) + FAKE_PREFILL_CHUNK, FAKE_PREFILL_CHUNK):
            await asyncio.sleep(0.005)
            total = len(prompt)
            yield f': prefill_progress {{"processed": {min(done, total)}, "total": {total}}}\n\n'
        for i in range(n):
            await asyncio.sleep(FAKE_TOKEN_S)
            choice = {
                "index": 0,
                "text": f" t{i}",
                "finish_reason": None if i < n - 1 else "length",
            }
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake_server():
    app = Starlette(
        routes=[
            Route("/v1/completions", _fake_completions, methods=["POST"]),
            Route("/health", lambda _: PlainTextResponse("ok")),
        ]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def bench(argv: list[str]) -> int:
    # Our own parser, not gapless.cli.main: this must not depend on the server package.
    parser = argparse.ArgumentParser(prog="gapless")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path


# The streams decode long enough to still be running when the long prompt arrives, even on a
# fast machine: the stall metrics need that overlap.
STREAM_TOKENS = 128
TINY_STALL = [
    *("--workload", "stall", "--num-streams", "2", "--stream-tokens", str(STREAM_TOKENS)),
    *("--long-tokens", "256", "--long-at", "0.1", "--slo", "ttft:2000,itl:500"),
]


def test_bench_against_fake_server(fake_server, tmp_path):
    out = tmp_path / "out"
    rc = bench(
        [
            "--url",
            fake_server,
            "--model",
            "fake",
            "--vocab-size",
            "512",
            *TINY_STALL,
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["workload"]["long_tokens"] == 256
    run = results["configs"]["default"]
    assert set(STALL_METRICS) <= set(run["metrics"])
    assert all(run["metrics"][k] is not None for k in STALL_METRICS)
    assert run["metrics"]["completed"] == 3 and run["metrics"]["failed"] == 0
    assert run["metrics"]["total_output_tokens"] == 2 * STREAM_TOKENS + 16
    reqs = {r["rid"]: r for r in run["requests"]}
    long = reqs[2]
    assert long["tag"] == "long" and long["prompt_tokens"] == 256
    # 256 tokens in 64-token chunks: four progress comments, the last one complete.
    assert [p[1:] for p in long["progress"]] == [[64, 256], [128, 256], [192, 256], [256, 256]]
    assert long["prefill_window"][1] == long["token_s"][0]
    assert [len(r["token_s"]) for r in reqs.values()] == [STREAM_TOKENS, STREAM_TOKENS, 16]
    # The stored timelines reproduce the stored metrics.
    from gapless.bench.client import RequestRecord

    records = [RequestRecord.from_dict(r) for r in run["requests"]]
    again = compute_metrics(records, run["metrics"]["duration_s"], {"ttft": 2000, "itl": 500})
    assert again == run["metrics"]
    table = (out / "table.md").read_text()
    assert "| metric | default |" in table and "TTFT p50 (ms)" in table
    _assert_png(out / "timeline.png")
    _assert_png(out / "itl_cdf.png")
    # The run's provenance, and `gapless bench report` reading what the run wrote.
    assert results["provenance"]["command"].startswith("gapless ")
    assert results["provenance"]["cpu"] and results["provenance"]["written"].endswith(" UTC")
    page = tmp_path / "page"
    assert bench(["report", f"fake={out}", "--out", str(page)]) == 0
    rows = (page / "table.md").read_text().splitlines()
    stall = next(r for r in rows if r.startswith("| stall: max stall of the streams"))
    assert f"fake {run['metrics']['max_stall_ms']:.0f}" in stall
    assert results["provenance"]["cpu"] in stall
    _assert_png(page / "timeline.png")


def test_the_mix_sends_each_requests_class_and_tenants_key_and_reports_each(
    fake_server, tmp_path, capsys
):
    out = tmp_path / "out"
    SENT.clear()
    argv = ["--url", fake_server, "--model", "fake", "--vocab-size", "512", "--out", str(out)]
    mix = ["--workload", "mix", "--mix", "interactive=1,batch=1", "--tenants", "a=1,b=3"]
    assert bench([*argv, *mix, "--num-requests", "12", "--rate", "100"]) == 0
    run = json.loads((out / "results.json").read_text())["configs"]["default"]
    requests = run["requests"]
    assert {r["service_class"] for r in requests} == {"interactive", "batch"}
    assert {r["tenant"] for r in requests} == {"a", "b"}
    sent = sorted(SENT[1:], key=str)  # after the warm-up request, the first one's copy
    assert sent == sorted(
        ((r["service_class"], f"Bearer bench-{r['tenant']}") for r in requests), key=str
    )
    shares = run["by_share"]
    assert list(shares) == ["batch", "interactive", "tenant a", "tenant b"]
    assert shares["batch"]["num_requests"] + shares["interactive"]["num_requests"] == 12
    assert shares["tenant a"]["num_requests"] + shares["tenant b"]["num_requests"] == 12
    batch = [r for r in requests if r["service_class"] == "batch"]
    assert shares["batch"]["total_output_tokens"] == sum(r["max_tokens"] for r in batch)
    assert (
        "| metric | default | default batch | default interactive |"
        in (out / "table.md").read_text()
    )
    # --no-classes: the same requests, naming no class.
    SENT.clear()
    unclassed = tmp_path / "unclassed"
    argv[-1] = str(unclassed)
    assert bench([*argv, *mix, "--num-requests", "12", "--rate", "100", "--no-classes"]) == 0
    assert {cls for cls, _ in SENT} == {None}
    again = json.loads((unclassed / "results.json").read_text())["configs"]["default"]
    assert list(again["by_share"]) == list(shares)
    # --only-class: the same batch requests, at the same times, alone.
    alone = tmp_path / "alone"
    argv[-1] = str(alone)
    assert (
        bench([*argv, *mix, "--num-requests", "12", "--rate", "100", "--only-class", "batch"]) == 0
    )
    only = json.loads((alone / "results.json").read_text())["configs"]["default"]["requests"]
    assert [(r["rid"], r["max_tokens"]) for r in only] == [
        (r["rid"], r["max_tokens"]) for r in batch
    ]
    # --only-tenant: tenant a's requests, at the same times, alone.
    argv[-1] = str(tmp_path / "tenant")
    assert bench([*argv, *mix, "--num-requests", "12", "--rate", "100", "--only-tenant", "a"]) == 0
    only = json.loads((tmp_path / "tenant" / "results.json").read_text())["configs"]["default"]
    light = [r for r in requests if r["tenant"] == "a"]
    assert [(r["rid"], r["max_tokens"]) for r in only["requests"]] == [
        (r["rid"], r["max_tokens"]) for r in light
    ]
    assert bench([*argv, *mix, "--num-requests", "12", "--only-tenant", "c"]) == 2
    assert "'c' is none of --tenants" in capsys.readouterr().err


def test_a_conversations_next_turn_is_sent_only_after_the_turn_before_ended(fake_server, tmp_path):
    out = tmp_path / "out"
    argv = ["--url", fake_server, "--model", "fake", "--vocab-size", "512", "--out", str(out)]
    conversation = ["--workload", "multiturn", "--conversations", "2", "--turns", "3"]
    shape = ["--prefix-tokens", "64", "--suffix-tokens", "8", "--answer-tokens", "4"]
    assert bench([*argv, *conversation, *shape, "--think-s", "0.05", "--rate", "100"]) == 0
    records = json.loads((out / "results.json").read_text())["configs"]["default"]["requests"]
    by_rid = {r["rid"]: r for r in records}
    spec = WorkloadSpec(
        "multiturn",
        vocab_size=512,
        conversations=2,
        turns=3,
        prefix_tokens=64,
        suffix_tokens=8,
        answer_tokens=4,
        think_s=0.05,
        rate=100,
    )
    follow_ups = [r for r in build_workload(spec) if r.after is not None]
    assert len(follow_ups) == 4 and len(records) == 6
    for r in follow_ups:
        assert by_rid[r.rid]["send_s"] >= by_rid[r.after]["end_s"]
        assert by_rid[r.rid]["prompt_tokens"] == by_rid[r.after]["prompt_tokens"] + 12


def test_cancel_workload_disconnects(fake_server, tmp_path):
    out = tmp_path / "out"
    rc = bench(
        [
            "--url",
            fake_server,
            "--model",
            "fake",
            "--workload",
            "cancel",
            "--rate",
            "50",
            "--num-requests",
            "12",
            "--seed",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["configs"]["default"]
    assert run["metrics"]["cancelled"] == 12 and run["metrics"]["completed"] == 0
    reqs = run["requests"]
    assert {r["cancel_phase"] for r in reqs} <= {"prefill", "decode"}
    # Token-count cancels stop exactly at their count, well short of max_tokens.
    decode = [r for r in reqs if r["cancel_phase"] == "decode"]
    assert decode and all(len(r["token_s"]) < r["max_tokens"] for r in decode)


def test_random_safetensors_names_and_seed(tmp_path):
    cfg = model_config("tiny")
    shapes = tensor_shapes(cfg)
    names = [n for n, _ in shapes]
    assert len(names) == 1 + 12 * 2 + 1 and len(set(names)) == len(names)
    assert "model.layers.1.self_attn.k_proj.bias" in names and "lm_head.weight" not in names
    write_random_safetensors(tmp_path / "a.safetensors", shapes, seed=0)
    write_random_safetensors(tmp_path / "b.safetensors", shapes, seed=0)
    write_random_safetensors(tmp_path / "c.safetensors", shapes, seed=1)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert (tmp_path / "a.safetensors").read_bytes() != (tmp_path / "c.safetensors").read_bytes()
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == sorted(names)
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.dtype == torch.bfloat16 and tuple(emb.shape) == (512, 64)
        assert 0.015 < emb.float().std().item() < 0.025
        assert tuple(f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape) == (32, 64)
        assert torch.all(f.get_tensor("model.norm.weight") == 1)


def test_compare_on_tiny_checkpoint(tmp_path):
    ckpt = tmp_path / "tiny"
    assert bench(["make-model", str(ckpt), "--preset", "tiny", "--seed", "0"]) == 0
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] == 512
    out = tmp_path / "out"
    # Without speculation: the random model's greedy output repeats, so prompt lookup would
    # finish the streams before the long prompt arrives, and there would be no stall to see.
    rc = bench(
        [
            "--compare",
            "blocking=--no-chunked-prefill --speculate none",
            "chunk16=--prefill-chunk 16 --speculate none",
            "--engine-only",
            "--model-dir",
            str(ckpt),
            "--model",
            "tiny",
            "--server-timeout",
            "60",
            *TINY_STALL,
            # Soon after the streams: alone, the engine decodes a stream's tokens on this tiny
            # model in about 0.1 s, which would leave no decode to stall at a later arrival.
            *("--long-at", "0.01"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    # Each configuration through HTTP, then its engine alone on the same requests.
    assert list(results["configs"]) == [
        "blocking",
        "blocking/engine",
        "chunk16",
        "chunk16/engine",
    ]
    assert results["configs"]["chunk16"]["server_flags"] == "--prefill-chunk 16 --speculate none"
    for name, run in results["configs"].items():
        metrics = run["metrics"]
        # The streams' ITL during the long prefill exists only if a stream was still decoding
        # then, which a loaded machine does not guarantee (test_bench_metrics checks the sum).
        missing = [
            k for k in STALL_METRICS if k != "long_prefill_itl_ms_p99" and metrics.get(k) is None
        ]
        assert not missing, (name, missing)
        assert metrics["completed"] == 3 and metrics["failed"] == 0
        assert metrics["total_output_tokens"] == 2 * STREAM_TOKENS + 16
        assert [len(r["token_s"]) for r in run["requests"]] == [STREAM_TOKENS] * 2 + [16]
    table = (out / "table.md").read_text()
    assert "| metric | blocking | blocking/engine | chunk16 | chunk16/engine |" in table
    assert sum(label in table for _, label, _ in TABLE_ROWS) >= 15
    _assert_png(out / "timeline.png")
    _assert_png(out / "itl_cdf.png")
    _assert_png(out / "tradeoff.png")


def test_a_restart_on_the_kv_disk_tier_serves_the_prefix_with_the_same_output(tmp_path):
    """The restart benchmark (docs/benchmarks.md): two configurations on one --kv-disk
    directory are two servers one after the other, the second a restart of the first."""
    ckpt = tmp_path / "tiny"
    assert bench(["make-model", str(ckpt), "--preset", "tiny", "--seed", "0"]) == 0
    out, disk = tmp_path / "out", tmp_path / "kv"
    flags = f"--kv-disk {disk} --speculate none"
    argv = [
        *("--compare", f"cold={flags}", f"restarted={flags}", "--model-dir", str(ckpt)),
        *("--model", "tiny", "--server-timeout", "60", "--workload", "prefix"),
        *("--num-requests", "1", "--prefix-tokens", "300", "--suffix-tokens", "10"),
        *("--answer-tokens", "8", "--out", str(out)),
    ]
    assert bench(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["same_outputs"] is True
    cached = {n: r["metrics"]["cached_prompt_tokens"] for n, r in results["configs"].items()}
    assert cached["cold"] == 0 and cached["restarted"] >= 300


def test_capacity_on_tiny_checkpoint(tmp_path):
    ckpt = tmp_path / "tiny"
    assert bench(["make-model", str(ckpt), "--preset", "tiny", "--seed", "0"]) == 0
    out = tmp_path / "out"
    # A 1 ms SLO no server meets and a 60 s one every server does: both searches run to an end
    # of the rate range, and the test asserts no timing.
    argv = [
        *("capacity", "--compare", "chunk16=--prefill-chunk 16", "--model-dir", str(ckpt)),
        *("--model", "tiny", "--server-timeout", "60", "--length-scale", "0.02"),
        *("--requests-per-trial", "8", "--trial-timeout-s", "20", "--slo-tbt-ms", "60000,1"),
        *("--max-sched-delay-s", "60", "--start-qps", "4", "--min-qps", "2", "--max-qps", "8"),
        *("--out", str(out)),
    ]
    assert bench(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["slo_tbt_ms"] == [1.0, 60000.0]
    system = results["systems"]["chunk16"]
    assert system["server_flags"] == "--prefill-chunk 16"
    # Read from the server's /v1/models: the checkpoint's own context.
    context = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    assert system["max_model_len"] == context
    assert set(system["capacity_qps"]) == {"1.0", "60000.0"}
    assert system["capacity_qps"]["1.0"] is None
    assert system["capacity_qps"]["60000.0"] == 8.0
    # Searches share trials: 4 first, then up to 8 and down to 2, one trial each.
    trials = system["trials"]
    assert [t["qps"] for t in trials] == [2.0, 4.0, 8.0]
    for t in trials:
        assert not t["fell_behind"] and t["tbt_ms_p99"] is not None
        assert t["metrics"]["completed"] == t["metrics"]["num_requests"] > 0
        assert set(t["metrics"]["goodput_by_slo_tbt_ms"]) == {"1.0", "60000.0"}
        assert t["metrics"]["sched_delay_ms_p50"] is not None
    table = (out / "table.md").read_text()
    assert "| chunk16 | - | 8 |" in table
    _assert_png(out / "capacity.png")


def test_a_trial_ends_at_its_deadline_when_the_server_falls_behind(fake_server):
    # Outputs of ~1,200 tokens at 10 ms each take the fake server ~12 s; the trial ends at 1 s.
    spec = WorkloadSpec("chat", vocab_size=512, rate=8.0, num_requests=4, length_scale=3.0)
    start = time.perf_counter()
    result = run_trial(fake_server, "fake", spec, 1.0, [CapacitySLO(1e9, 1e9)])
    assert time.perf_counter() - start < 6.0
    assert result.fell_behind and not result.meets(CapacitySLO(1e9, 1e9))
    assert result.metrics["cancelled"] == result.metrics["num_requests"] > 0


def test_decode_alternates_rounds_and_reads_time_per_token(fake_server, tmp_path, capsys):
    """`gapless bench decode`, the method of the decode and AVX2 rows of docs/benchmarks.md:
    every server measured every round, in turn, as the bench's TPOT (the fake server's ~10 ms
    a token) and TTFT, with each later server's median ratio against the first."""
    out = tmp_path / "decode"
    port = fake_server.rsplit(":", 1)[1]
    argv = ["decode", f"a={port}@fake", f"b={fake_server}@fake", "--kinds", "b1,b2,pf"]
    rc = bench([*argv, "--rounds", "2", "--vocab-size", "4096", "--out", str(out)])
    assert rc == 0
    rounds = [line.split(":")[0] for line in capsys.readouterr().err.splitlines()]
    assert [r for r in rounds if " round " in r] == [
        f"{kind} round {r}" for kind in ("b1", "b2", "pf") for r in (1, 2)
    ]
    results = json.loads((out / "results.json").read_text())
    assert results["bench"] == "decode"
    assert set(results["times_ms"]) == {"b1", "b2", "pf"}
    for kind in ("b1", "b2"):
        medians = results["summary"][kind]["median_ms"]
        assert set(medians) == {"a", "b"}
        assert all(FAKE_TOKEN_S * 1e3 <= ms < 20 * FAKE_TOKEN_S * 1e3 for ms in medians.values())
    assert results["summary"]["pf"]["reference"] == "a"
    assert set(results["summary"]["pf"]["ratio"]) == {"b"}
    table = (out / "table.md").read_text()
    assert "| decode batch 2 (TPOT) |" in table and "| prefill (TTFT) |" in table
    _assert_png(out / "decode.png")


def test_decode_refuses_a_malformed_server_or_kind():
    with pytest.raises(SystemExit):
        bench(["decode", "nameonly", "--vocab-size", "100"])
    with pytest.raises(SystemExit):
        bench(["decode", "a=8000", "--kinds", "b0", "--vocab-size", "100"])


def test_decode_step_counts_each_paths_ops_and_times_them(checkpoint, tmp_path):
    from gguf import GGMLQuantizationType

    from gapless.bench.gguf_files import write_gguf

    plain_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    ckpt = checkpoint("llama", **plain_rope)
    path = write_gguf(ckpt, tmp_path / "m.gguf", GGMLQuantizationType.Q8_0)
    out = tmp_path / "out"
    rc = bench(["decode-step", str(path), "--streams", "1,3", "--steps", "4", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["streams"] for r in rows] == [1, 3]
    for row in rows:
        # the call replaces every layer's ops: a tiny model's 2 layers made ~60 of them
        assert 0 < row["ops"]["call"] < row["ops"]["ops"] - 40
        assert row["median_ms"]["call"] > 0 and row["ratio"] > 0
    assert "| 3 |" in (out / "table.md").read_text()
