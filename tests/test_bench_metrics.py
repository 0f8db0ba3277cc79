"""Benchmark maths on hand-built timelines, SSE parsing, and workload seeding."""

from __future__ import annotations

import pytest

from gapless.bench.client import RequestRecord, parse_sse_line, tokens_in_chunk
from gapless.bench.metrics import (
    compute_metrics,
    gaps_during,
    itls,
    max_stall,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
    tpot,
    ttft,
)
from gapless.bench.workloads import WorkloadSpec, build_workload, parse_shares


def test_percentile_interpolates_between_ranks():
    # Ranks 0..3 hold 10..40; p50 sits halfway between ranks 1 and 2, p90 at rank 2.7.
    assert percentile([40, 10, 30, 20], 50) == pytest.approx(25.0)
    assert percentile([10, 20, 30, 40], 90) == pytest.approx(37.0)
    assert percentile([10, 20, 30, 40], 100) == 40


def test_summarize_keys_and_values():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0], "x")
    assert s == pytest.approx(
        {"x_mean": 4.0, "x_p50": 3.0, "x_p90": 7.6, "x_p99": 9.76, "x_max": 10.0}
    )
    assert summarize([], "x") == dict.fromkeys(["x_mean", "x_p50", "x_p90", "x_p99", "x_max"])


def test_itl_ttft_tpot():
    times = [0.5, 0.6, 0.8, 1.4]
    assert itls(times) == pytest.approx([0.1, 0.2, 0.6])
    assert ttft(0.2, times) == pytest.approx(0.3)
    # e2e 1.2 s, TTFT 0.3 s, 3 later tokens: (1.2 - 0.3) / 3
    assert tpot(0.2, times) == pytest.approx(0.3)
    assert tpot(0.0, [0.4]) == 0.0  # vLLM: one token, no decode time
    assert ttft(0.0, []) is None and tpot(0.0, []) is None


def test_max_stall_only_counts_gaps_over_another_prefill():
    stream = [0.0, 0.1, 0.2, 1.2, 1.3]
    long_window = (0.25, 1.15)
    # Own window [0, 0] is ignored; the 1.0 s gap spans the other request's prefill.
    assert max_stall([stream, []], [(0.0, 0.0), long_window]) == pytest.approx(1.0)
    # The same gap with no one else prefilling is not a stall.
    assert max_stall([stream], [(0.0, 0.0)]) is None
    # A request's own prefill window never makes its own gap a stall.
    assert max_stall([stream], [long_window]) is None
    # Touching the window's edge is not overlapping it.
    assert max_stall([[0.0, 0.25], []], [(0.0, 0.0), (0.25, 0.5)]) is None


def test_gaps_during_window():
    stream = [0.0, 0.1, 0.2, 1.2, 1.3, 1.4]
    assert gaps_during(stream, (0.15, 1.25)) == pytest.approx([0.1, 1.0, 0.1])


def test_slo_parsing_and_check():
    assert parse_slo("ttft:500,itl:100") == {"ttft": 500.0, "itl": 100.0}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError):
        parse_slo("latency:5")
    slo = {"ttft": 500.0, "itl": 100.0}
    assert meets_slo(500.0, 100.0, 9999.0, slo)
    assert not meets_slo(501.0, 50.0, 0.0, slo)
    assert not meets_slo(100.0, 100.5, 0.0, slo)  # itl is checked against TPOT


def _rec(rid, send, times, *, tag="", prompt=10, cancelled=False, error=None):
    rec = RequestRecord(rid, tag, send, prompt, len(times), token_s=list(times))
    rec.completion_tokens = len(times)
    rec.end_s = times[-1] if times else send + 0.5
    rec.cancelled, rec.error = cancelled, error
    if cancelled:
        rec.cancel_phase = "decode" if times else "prefill"
    return rec


def test_compute_metrics_on_a_stall_timeline():
    stream = _rec(0, 0.0, [0.0, 0.1, 0.2, 1.2, 1.3])
    long = _rec(1, 0.25, [1.15, 1.25], tag="long", prompt=100)
    cancelled = _rec(2, 0.0, [], cancelled=True)
    failed = _rec(3, 0.0, [], error="HTTP 500")
    m = compute_metrics(
        [stream, long, cancelled, failed], duration=2.0, slo={"ttft": 1000.0, "itl": 400.0}
    )
    assert m["completed"] == 2 and m["failed"] == 1 and m["cancelled"] == 1
    assert m["cancelled_in_prefill"] == 1 and m["cancelled_in_decode"] == 0
    assert m["max_stall_ms"] == pytest.approx(1000.0)
    assert m["itl_ms_max"] == pytest.approx(1000.0)
    assert m["long_ttft_ms"] == pytest.approx(900.0)
    # Only the stream's 1.0 s gap overlaps the long prompt's prefill [0.25, 1.15].
    assert m["long_prefill_itl_ms_p99"] == pytest.approx(1000.0)
    assert m["ttft_ms_max"] == pytest.approx(900.0)
    # Stream TPOT: (1.3 - 0.0) / 4 = 325 ms; long: 100 ms.
    assert m["tpot_ms_max"] == pytest.approx(325.0)
    assert m["total_output_tokens"] == 7
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx((110 + 7) / 2.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    # Both completed requests meet TTFT <= 1 s and TPOT <= 400 ms.
    assert m["goodput"] == pytest.approx(1.0)
    tight = compute_metrics([stream, long], 2.0, slo={"itl": 200.0})
    assert tight["goodput"] == pytest.approx(0.5)
    assert compute_metrics([stream], 2.0)["goodput"] is None


def test_sse_lines():
    assert parse_sse_line('data: {"a": 1}') == ("data", {"a": 1})
    assert parse_sse_line("data: [DONE]") == ("done", None)
    assert parse_sse_line(': prefill_progress {"processed": 16, "total": 256}') == (
        "progress",
        (16, 256),
    )
    assert parse_sse_line(": keep-alive") == ("comment", "keep-alive")
    assert parse_sse_line("") == ("skip", None)


def test_tokens_in_chunk():
    assert tokens_in_chunk({"choices": [{"text": "ab", "finish_reason": None}]}) == 1
    assert tokens_in_chunk({"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]}) == 3
    assert tokens_in_chunk({"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    # An incomplete UTF-8 piece still is a token; a bare finish marker is not.
    assert tokens_in_chunk({"choices": [{"text": "", "finish_reason": None}]}) == 1
    assert tokens_in_chunk({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert tokens_in_chunk({"choices": [], "usage": {"completion_tokens": 5}}) == 0


def test_workloads_are_seeded():
    spec = WorkloadSpec("mixed", seed=3, num_requests=20, rate=2.0)
    a, b = build_workload(spec), build_workload(spec)
    assert a == b
    assert a != build_workload(WorkloadSpec("mixed", seed=4, num_requests=20, rate=2.0))
    assert all(16 <= len(r.prompt) <= 8192 and 32 <= r.max_tokens <= 256 for r in a)
    assert all(100 <= t < 32000 for r in a for t in r.prompt)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_the_mix_draws_classes_and_tenants_by_weight_and_shapes_by_class():
    spec = WorkloadSpec("mix", num_requests=400, rate=10.0, tenants=(("light", 1), ("heavy", 10)))
    reqs = build_workload(spec)
    assert reqs == build_workload(spec)
    batch = [r for r in reqs if r.service_class == "batch"]
    chat = [r for r in reqs if r.service_class == "interactive"]
    assert 0.7 < len(batch) / len(reqs) < 0.9  # interactive=0.2, batch=0.8 by default
    assert 0.03 < sum(r.tenant == "light" for r in reqs) / len(reqs) < 0.15
    median = lambda rs, f: sorted(map(f, rs))[len(rs) // 2]  # noqa: E731
    assert 800 < median(batch, lambda r: len(r.prompt)) < 1300
    assert 200 < median(chat, lambda r: len(r.prompt)) < 320
    assert median(batch, lambda r: r.max_tokens) > 2 * median(chat, lambda r: r.max_tokens)
    short = build_workload(WorkloadSpec("mix", num_requests=50, max_model_len=512))
    assert all(len(r.prompt) + r.max_tokens <= 512 for r in short)
    with pytest.raises(ValueError, match="unknown service classes"):
        build_workload(WorkloadSpec("mix", mix=(("urgent", 1),)))
    assert parse_shares("interactive=0.2, batch=0.8") == (("interactive", 0.2), ("batch", 0.8))
    for bad in ("interactive", "a=0", ""):
        with pytest.raises(ValueError):
            parse_shares(bad)


def test_stall_context_and_prefix_shapes():
    stall = build_workload(
        WorkloadSpec(
            "stall", num_streams=2, stream_tokens=16, long_tokens=256, long_at=0.5, vocab_size=512
        )
    )
    assert [(r.arrival_s, len(r.prompt), r.max_tokens, r.tag) for r in stall] == [
        (0.0, 64, 16, ""),
        (0.0, 64, 16, ""),
        (0.5, 256, 16, "long"),
    ]
    context = build_workload(
        WorkloadSpec("context", num_streams=3, stream_tokens=32, long_tokens=700, vocab_size=512)
    )
    assert [(r.arrival_s, len(r.prompt), r.max_tokens) for r in context] == [(0.0, 700, 32)] * 3
    # distinct prompts: no stream's history is another's cached prefix
    assert len({tuple(r.prompt[:16]) for r in context}) == 3
    prefix = build_workload(WorkloadSpec("prefix", num_requests=3))
    assert all(r.prompt[:2000] == prefix[0].prompt[:2000] and len(r.prompt) == 2064 for r in prefix)
    assert prefix[0].prompt[2000:] != prefix[1].prompt[2000:]
    cancel = build_workload(WorkloadSpec("cancel", num_requests=40))
    assert any(r.cancel_after_s is not None for r in cancel)
    assert any(r.cancel_after_tokens is not None for r in cancel)
    assert all((r.cancel_after_s is None) != (r.cancel_after_tokens is None) for r in cancel)


def test_text_workloads_are_distinct_and_seeded():
    # grounded: each request copies a module of its own, so no prefix cache serves another's;
    # story: free generation from different openings.
    for name in ("grounded", "story"):
        spec = WorkloadSpec(name, seed=5, num_streams=4, stream_tokens=32)
        reqs = build_workload(spec)
        assert reqs == build_workload(spec)
        assert [(r.arrival_s, r.max_tokens) for r in reqs] == [(0.0, 32)] * 4
        assert all(isinstance(r.prompt, str) for r in reqs)
    copies = build_workload(WorkloadSpec("grounded", num_streams=3))
    assert len({r.prompt.split("```python\n")[1][:80] for r in copies}) == 3


def test_multiturn_turns_extend_their_conversation_and_wait_for_the_turn_before():
    spec = WorkloadSpec(
        "multiturn", conversations=3, turns=4, prefix_tokens=100, suffix_tokens=10, answer_tokens=5
    )
    reqs = {r.rid: r for r in build_workload(spec)}
    assert reqs == {r.rid: r for r in build_workload(spec)} and len(reqs) == 12
    firsts = [r for r in reqs.values() if r.after is None]
    assert len(firsts) == 3 and sorted(len(r.prompt) for r in firsts) == [110] * 3
    for r in reqs.values():
        if r.after is not None:
            before = reqs[r.after]
            # the turn before's prompt, its reply (5 tokens) and a new question (10)
            assert r.prompt[: len(before.prompt)] == before.prompt
            assert len(r.prompt) == len(before.prompt) + 15 and r.max_tokens == 5
    assert len({tuple(r.prompt[:100]) for r in firsts}) == 3  # a document each
