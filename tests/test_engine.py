"""Engine behaviour users rely on: no stalls, cancellation, prefix reuse, exact tokens."""

from __future__ import annotations

import itertools
import logging
import math
import sys

import pytest
import torch
from helpers import greedy, prompt

from gapless import Engine, EngineConfig, SamplingParams
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.engine.observability import stats
from gapless.engine.runner import ModelRunner
from gapless.engine.sampler import TokenCounts, apply_penalties


@pytest.fixture
def make_engine(checkpoint):
    def make(arch: str = "llama", **fields) -> Engine:
        return Engine.from_pretrained(checkpoint(arch), EngineConfig.of(dtype="float32", **fields))

    return make


def run(engine: Engine, log: dict | None = None) -> dict[str, list]:
    """Steps until idle; returns each request's events in order."""
    log = {} if log is None else log
    while engine.has_work:
        for event in engine.step():
            log.setdefault(event.request_id, []).append(event)
    return log


def tokens(events: list) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def finished(events: list) -> FinishedEvent:
    assert isinstance(events[-1], FinishedEvent)
    return events[-1]


def step_counts(engine: Engine) -> tuple[dict[str, int], list]:
    events = engine.step()
    counts: dict[str, int] = {}
    for e in events:
        if isinstance(e, TokenEvent):
            counts[e.request_id] = counts.get(e.request_id, 0) + len(e.token_ids)
    return counts, events


def start_decoding(engine: Engine, *prompts: list[int], max_tokens: int = 60) -> list[str]:
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    engine.step()  # idle budget: both prompts prefill and sample in one step
    assert all(engine.intake.sequences(i)[0].is_decoding for i in ids)
    return ids


def test_decodes_never_stall_while_a_long_prompt_prefills(make_engine):
    engine = make_engine(prefill_chunk=16)
    a, b = start_decoding(engine, prompt(3, 1), prompt(4, 2))
    c = engine.add_request(prompt(8 * 16 + 5, 3), greedy(5))
    progress = []
    while not engine.intake.sequences(c)[0].is_decoding:
        counts, events = step_counts(engine)
        assert counts.get(a) == 1 and counts.get(b) == 1
        progress += [e for e in events if isinstance(e, ProgressEvent)]
    # Each step one chunk, of at most 16 tokens, costing no more than 16 fresh ones: chunks
    # shrink as the prompt's keys grow (ModelConfig.prompt_work).
    work = engine.decoder.config.prompt_work()
    done = [0] + [e.processed for e in progress]
    assert done[-1] == 133 and len(progress) > math.ceil(133 / 16)
    for start, end in itertools.pairwise(done):
        assert 0 < end - start <= 16 and work(end - start, start) <= work(16, 0)
        assert end == 133 or work(end - start + 1, start) > work(16, 0)  # the budget's most
    counts, _ = step_counts(engine)
    assert counts == {a: 1, b: 1, c: 1}


def test_cancel_mid_prefill_frees_blocks_keeps_prefix_and_leaves_others_alone(make_engine):
    pa, pb, pc = prompt(3, 1), prompt(4, 2), prompt(8 * 16, 3)
    solo = make_engine(prefill_chunk=16)
    ids = start_decoding(solo, pa, pb, max_tokens=12)
    reference = run(solo)

    engine = make_engine(prefill_chunk=16)
    log: dict = {}
    a, b = start_decoding(engine, pa, pb, max_tokens=12)
    free_before = engine.kv.pool.num_free
    c = engine.add_request(pc, greedy(5))
    while not log.get(c) or log[c][-1].processed < 32:  # two blocks' worth, or more
        for e in engine.step():
            log.setdefault(e.request_id, []).append(e)
    blocks = log[c][-1].processed // 16
    engine.cancel(c)
    for e in engine.step():
        log.setdefault(e.request_id, []).append(e)
    assert isinstance(log[c][-1], FinishedEvent) and log[c][-1].finish_reason == "cancelled"
    n_events = len(log[c])
    assert engine.kv.pool.num_cached == blocks  # the computed prompt blocks stay reusable
    assert engine.kv.pool.num_free == free_before - blocks
    run(engine, log)
    assert len(log[c]) == n_events  # nothing after the cancelled event
    assert tokens(log[a]) == tokens(reference[ids[0]])
    assert tokens(log[b]) == tokens(reference[ids[1]])
    assert engine.kv.pool.num_used == 0

    # A retry resumes from the cached prefix: only the uncached tail is computed.
    retry = engine.add_request(pc, greedy(5))
    events = run(engine)[retry]
    assert finished(events).cached_prompt_tokens == 16 * blocks
    # Nobody decodes now: the idle budget takes the rest in one chunk.
    assert [e.processed for e in events if isinstance(e, ProgressEvent)] == [len(pc)]


def test_cancel_while_queued_and_while_decoding(make_engine):
    engine = make_engine(max_num_seqs=1)
    first = engine.add_request(prompt(20), greedy(30))
    queued = engine.add_request(prompt(30, 1), greedy(30))
    engine.step()
    engine.step()
    assert engine.cancel(queued)
    assert engine.cancel(first)
    events = run(engine)
    assert [type(e) for e in events[queued]] == [FinishedEvent]
    assert finished(events[first]).finish_reason == "cancelled"
    assert len(tokens(events[first])) == 0  # cancelled before the step that would emit more
    assert not engine.cancel(first)
    assert engine.kv.pool.num_used == 0


class WholePromptRunner(ModelRunner):
    supports_chunked_prefill = False


def test_runner_that_cannot_chunk_is_served_whole(make_engine, checkpoint, caplog):
    prompts = [prompt(n, n) for n in (70, 33, 5)]
    chunked = make_engine(prefill_chunk=16)
    want = run_all(chunked, prompts)

    base = make_engine()
    runner = WholePromptRunner(base.decoder, 64, 16)
    with caplog.at_level(logging.WARNING, logger="gapless.engine"):
        engine = Engine(base.decoder, base.tokenizer, EngineConfig.of(prefill_chunk=16), runner)
    assert "cannot prefill in chunks" in caplog.text
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    events = run(engine)
    for i, rid in enumerate(ids):
        assert tokens(events[rid]) == want[i]
        assert len([e for e in events[rid] if isinstance(e, ProgressEvent)]) == 1


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    events = run(engine)
    return [tokens(events[i]) for i in ids]


# auto: float16 on CPUs with F16C (float32 attention); int8 needs qwen3's and gemma3's head
# size (32); gemma3 keeps its sliding layers in groups of their own.
KV_CACHES = [("llama", "auto"), ("mistral", "auto"), ("qwen3", "int8"), ("gemma3", "int8")]


@pytest.mark.parametrize(("arch", "kv"), KV_CACHES + [("qwen3", "bfloat16")])
def test_same_greedy_tokens_alone_busy_chunked_and_unchunked(make_engine, arch, kv):
    target = prompt(150, 9)
    alone = run_all(make_engine(arch, kv_cache_dtype=kv), [target], 24)[0]
    for fields in ({"prefill_chunk": 16}, {"prefill_chunk": 512}, {"chunked_prefill": False}):
        engine = make_engine(arch, kv_cache_dtype=kv, **fields)
        busy = [
            engine.add_request(prompt(n, n), SamplingParams(max_tokens=30, seed=n))
            for n in (40, 7, 90)
        ]
        engine.step()
        tid = engine.add_request(target, greedy(24))
        events = run(engine)
        assert tokens(events[tid]) == alone, fields
        assert all(finished(events[i]).finish_reason in ("stop", "length") for i in busy)


@pytest.mark.parametrize(("arch", "kv"), [KV_CACHES[0], KV_CACHES[2]])
def test_prefix_cache_prefills_only_the_remainder(make_engine, arch, kv):
    shared = prompt(300, 4)
    first, second = shared + prompt(20, 5), shared + prompt(25, 6)
    cold = run_all(make_engine(arch, kv_cache_dtype=kv, enable_prefix_cache=False), [second], 12)
    engine = make_engine(arch, kv_cache_dtype=kv, prefill_chunk=64, idle_prefill_chunk=64)
    run_all(engine, [first], 4)
    rid = engine.add_request(second, greedy(12))
    events = run(engine)[rid]
    hit = 300 // 16 * 16
    assert finished(events).cached_prompt_tokens == hit
    progress = [e.processed for e in events if isinstance(e, ProgressEvent)]
    assert progress == [hit + 37]  # the uncached 37 tokens in one chunk
    assert tokens(events) == cold[0]
    assert stats(engine)["prefix_cache_hit_tokens_total"] == hit


def test_progress_events_per_chunk(make_engine):
    engine = make_engine(prefill_chunk=16, idle_prefill_chunk=16)
    calls = []
    rid = engine.add_request(prompt(100), greedy(2), progress_callback=calls.append)
    events = run(engine)[rid]
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert [e.processed for e in progress] == [16, 32, 48, 64, 80, 96, 100]
    assert len(progress) == math.ceil(100 / 16)
    assert all(e.total == 100 for e in progress)
    assert calls == progress
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent))
    assert all(isinstance(e, ProgressEvent) for e in events[:first_token])


def test_idle_fast_path_prefills_5000_tokens_in_two_steps(checkpoint):
    path = checkpoint("llama", max_position_embeddings=8192)
    engine = Engine.from_pretrained(path, EngineConfig.of(dtype="float32"))
    rid = engine.add_request(prompt(5000), greedy(1))
    steps = 0
    while (live := engine.intake.sequences(rid)) and not live[0].output_ids:
        engine.step()
        steps += 1
    assert steps == 2


@pytest.mark.parametrize("policy", ["shortest", "fcfs"])
def test_short_prompt_overtakes_long_prefill_only_under_shortest(make_engine, policy):
    engine = make_engine(prefill_chunk=16, idle_prefill_chunk=16, prefill_policy=policy)
    long_id = engine.add_request(prompt(20 * 16, 1), greedy(2))
    engine.step()
    engine.step()
    short_id = engine.add_request(prompt(40, 2), greedy(2))
    order = []
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, TokenEvent) and e.request_id not in order:
                order.append(e.request_id)
            if isinstance(e, ProgressEvent) and e.request_id == long_id and e.processed == e.total:
                order.append("long prefilled")
    if policy == "shortest":
        assert order.index(short_id) < order.index("long prefilled")
    else:
        assert order.index(short_id) > order.index("long prefilled")
    assert long_id in order


def test_kv_exhaustion_preempts_and_still_completes_everything(make_engine):
    prompts = [prompt(30, i) for i in range(4)]
    want = run_all(make_engine(), prompts, 40)
    engine = make_engine(kv_cache_tokens=10 * 16)  # 10 blocks; the four need 20
    ids = [engine.add_request(p, greedy(40)) for p in prompts]
    events = run(engine)
    assert [tokens(events[i]) for i in ids] == want
    assert sum(finished(events[i]).preempted for i in ids) > 0
    assert engine.kv.pool.num_used == 0


def test_prompts_that_fill_the_pool_together_with_none_complete_still_finish(make_engine):
    """Two tenants' long prompts take turns at chunks (FairShare) until the pool is full with
    neither prompt complete and nobody decoding, so no decode's preemption frees a block: the
    scheduler must preempt one of them itself, or both wait forever (a multi-turn bench hung
    so, its prompts loading from the disk tier)."""
    prompts = [prompt(20 * 16, seed=60 + i) for i in range(2)]
    want = run_all(make_engine(), prompts, 4)
    engine = make_engine(kv_cache_tokens=30 * 16, prefill_chunk=64, idle_prefill_chunk=64)
    ids = [engine.add_request(p, greedy(4, tenant=t)) for p, t in zip(prompts, "ab", strict=True)]
    events: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_work:
            break
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    assert not engine.has_work, "both prompts waited for the other's blocks"
    assert [tokens(events[i]) for i in ids] == want
    assert sum(finished(events[i]).preempted for i in ids) == 1
    assert engine.kv.pool.num_used == 0


def test_prompt_that_can_never_fit_is_rejected(make_engine):
    from gapless.engine.engine import RequestError

    engine = make_engine(kv_cache_tokens=64)
    with pytest.raises(RequestError, match="has 100 tokens.*context is 64"):
        engine.add_request(prompt(100), greedy(1))
    engine = make_engine()
    with pytest.raises(RequestError, match="has 2048 tokens.*context is 2048"):
        engine.add_request(prompt(2048), greedy(1))


def test_sliding_window_releases_blocks_behind_the_window(make_engine):
    engine = make_engine("mistral", prefill_chunk=16)  # window 24
    rid = engine.add_request(prompt(40), greedy(200))
    peak = 0
    while engine.has_work:
        engine.step()
        [req] = engine.intake.sequences(rid) or [None]
        if req is not None:
            peak = max(peak, sum(b >= 0 for b in req.kv.block_table))
    assert peak <= 3  # a 24-token window plus the block being written spans at most 3
    assert engine.kv.pool.num_used == 0


def test_seeded_sampling_is_the_same_in_any_batch(make_engine):
    params = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True
    )
    alone = make_engine()
    rid = alone.add_request(prompt(12), params)
    want = tokens(run(alone)[rid])
    busy = make_engine()
    for n in (30, 5):
        busy.add_request(prompt(n, n), SamplingParams(max_tokens=25, seed=n, ignore_eos=True))
    rid = busy.add_request(prompt(12), params)
    assert tokens(run(busy)[rid]) == want
    unseeded = make_engine()
    rid = unseeded.add_request(prompt(12), SamplingParams(max_tokens=20, seed=8, ignore_eos=True))
    assert tokens(run(unseeded)[rid]) != want


def test_stop_string_across_tokens_is_caught_and_never_streamed(make_engine):
    engine = make_engine()
    rid = engine.add_request(prompt(10), greedy(40))
    events = run(engine)[rid]
    pieces = [e.text for e in events if isinstance(e, TokenEvent)]
    # A stop string made of the end of one token's text and the start of the next.
    i = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    full = "".join(pieces)
    engine = make_engine()
    rid = engine.add_request(prompt(10), greedy(40, stop=[stop]))
    events = run(engine)[rid]
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert streamed == full[: full.index(stop)]
    assert finished(events).finish_reason == "stop"
    assert all(stop not in e.text for e in events if isinstance(e, TokenEvent))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    counts = TokenCounts(prompt_ids=[4], output_ids=[0, 0, 2], vocab=5, device=logits.device)
    out = apply_penalties(logits, counts, presence=0.5, frequency=0.25, repetition=2.0)
    # Repetition first (positive / 2, negative * 2), then frequency * count and presence.
    # token 0: seen twice in output -> 2 / 2 - 0.25 * 2 - 0.5 = 0.0
    # token 2: once -> 0.5 / 2 - 0.25 - 0.5 = -0.5
    # token 4: only in the prompt -> repetition only: -2 * 2 = -4
    assert out.tolist() == [0.0, -1.0, -0.5, 3.0, -4.0]


def test_sampling_thresholds_follow_top_k_top_p_min_p():
    from gapless.engine.sampler import sampling_thresholds

    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.65),  # 0.5 alone is short of 0.65; 0.5 + 0.2 reaches it
        SamplingParams(top_k=3, top_p=0.8),  # over the top 3 renormalised: .59, .82 -> 2 kept
        SamplingParams(min_p=0.3),  # 0.3 * 0.5
    ]
    assert sampling_thresholds(probs, params).tolist() == pytest.approx([0.2, 0.2, 0.2, 0.15])


def test_top_p_wider_than_the_candidate_head_matches_a_full_sort():
    from gapless.engine.sampler import CANDIDATES, sampling_thresholds

    vocab = 3 * CANDIDATES
    probs = torch.linspace(2.0, 1.0, vocab)[torch.randperm(vocab)]
    probs = (probs / probs.sum())[None]
    ordered = probs[0].sort(descending=True).values
    want = ordered[int((ordered.cumsum(0) < 0.9).sum())]
    assert sampling_thresholds(probs, [SamplingParams(top_p=0.9)]).item() == want.item()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prefill_chunk", 0, "prefill_chunk must be positive"),
        ("max_num_seqs", -1, "max_num_seqs must be positive"),
        ("prefill_policy", "lifo", "prefill_policy must be 'fcfs' or 'shortest'"),
        ("kv_cache_tokens", 0, "kv_cache_tokens must be positive"),
    ],
)
def test_bad_engine_config_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.of(**{field: value})


def test_shortest_policy_ages_a_long_prompt_so_it_does_not_starve(make_engine):
    engine = make_engine(prefill_chunk=16, idle_prefill_chunk=16)
    long_id = engine.add_request(prompt(10 * 16, 1), greedy(1))
    for step in range(40):
        # A short prompt arrives every step: without aging it would always go first.
        engine.add_request(prompt(20, 100 + step), greedy(1))
        events = engine.step()
        if any(isinstance(e, FinishedEvent) and e.request_id == long_id for e in events):
            break
    else:
        pytest.fail("the long prompt starved behind a stream of short ones")


def test_submit_prefills_the_whole_prompt_in_one_step_then_decodes_with_the_batch(make_engine):
    engine = make_engine(prefill_chunk=16)
    (a,) = start_decoding(engine, prompt(3, 1))
    rid = engine.submit(prompt(100, 2), greedy(3))
    counts, events = step_counts(engine)
    progress = [e for e in events if isinstance(e, ProgressEvent) and e.request_id == rid]
    assert [(e.processed, e.total) for e in progress] == [(100, 100)]  # 100 > the 16 budget
    assert counts == {a: 1, rid: 1}
    counts, _ = step_counts(engine)
    assert counts == {a: 1, rid: 1}


def test_fail_all_ends_every_live_request_and_frees_its_blocks(make_engine):
    engine = make_engine(max_num_seqs=1)
    running = engine.add_request(prompt(40), greedy(20))
    engine.step()
    queued = engine.add_request(prompt(30, 1), greedy(20))
    events = engine.fail_all("boom")
    assert {e.request_id: (e.finish_reason, e.error) for e in events} == {
        running: ("error", "boom"),
        queued: ("error", "boom"),
    }
    assert engine.kv.pool.num_used == 0 and not engine.has_work


def test_server_engine_steps_on_the_thread_that_loaded_it(checkpoint):
    """The server loads its engine on engine_thread() and steps it there: a second thread
    running torch ops beside the loader made every op ~5x slower here (libgomp)."""
    import asyncio
    import threading

    from gapless.engine.async_engine import AsyncEngine, engine_thread

    thread = engine_thread()
    engine = thread.submit(Engine.from_pretrained, checkpoint("llama")).result()
    loaded_on = thread.submit(threading.get_ident).result()
    stepped_on = set()
    step = engine.step

    def recorded_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recorded_step
    async_engine = AsyncEngine(engine, thread)
    async_engine.start()

    async def generate() -> list[object]:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        return [event async for event in async_engine.stream([5, 6, 7], params)]

    events = asyncio.run(generate())
    async_engine.stop()
    assert isinstance(events[-1], FinishedEvent) and events[-1].finish_reason == "length"
    assert stepped_on == {loaded_on}


def resident_mib() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_reserved_kv_memory_is_resident_only_once_written(make_engine):
    # Reserving KV memory costs no resident memory until sequences write it, and the
    # start-up largest step gives back what it wrote: a server's memory is what it holds.
    fields = {"idle_prefill_chunk": 256}
    small = make_engine(kv_cache_tokens=1024, **fields)  # imports, checkpoint, op caches
    small.reserve_peak_memory()
    before = resident_mib()
    engine = make_engine(kv_cache_tokens=2**21, **fields)
    engine.reserve_peak_memory()
    reserved = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_cache) / 2**20
    assert reserved >= 512
    assert resident_mib() - before < 64
    engine.add_request(prompt(40), greedy(8), request_id="r")
    assert len(tokens(run(engine)["r"])) == 8


def test_the_largest_step_run_before_serving_leaves_no_trace(make_engine):
    # `gapless serve` runs it once at start so that resident memory starts at its peak.
    fields = {
        "kv_cache_tokens": 256,
        "idle_prefill_chunk": 64,
        "prefill_chunk": 16,
        "max_num_seqs": 4,
    }
    fresh, reserved = make_engine(**fields), make_engine(**fields)
    assert reserved.scheduler.max_step_tokens == 64
    reserved.reserve_peak_memory()
    assert all(not k.any() and not v.any() for k, v in reserved.runner.kv_cache)
    assert reserved.kv.pool.num_free == fresh.kv.pool.num_free
    for engine in (fresh, reserved):
        engine.add_request(prompt(40), greedy(8), request_id="r")
    assert tokens(run(reserved)["r"]) == tokens(run(fresh)["r"])


@pytest.mark.parametrize(
    "arch, kinds",
    [
        ("llama", [0]),  # one kind of layer
        ("gemma3", [0, 5]),  # a sliding layer, then the first global one
        ("qwen3_moe", [0, 1]),  # a sparse layer, then the dense one (mlp_only_layers)
    ],
)
def test_the_largest_step_runs_one_layer_of_each_kind(make_engine, arch, kinds, monkeypatch):
    # Layers free what they allocate: one of each kind (window, MLP) reaches the whole step's
    # high-water mark at a fraction of its time.
    engine = make_engine(arch, kv_cache_tokens=256, idle_prefill_chunk=64)
    ran: list[list[int]] = []
    run_layers = engine.runner.decoder.run_layers
    monkeypatch.setattr(
        engine.runner.decoder,
        "run_layers",
        lambda batch, cache, which: (ran.append(which), run_layers(batch, cache, which)),
    )
    engine.reserve_peak_memory()
    assert ran == [kinds]


def test_choices_forked_in_one_step_stay_within_the_sequence_cap(make_engine):
    """Two requests for 3 choices whose prompts complete in the same step: their forks
    together start no more sequences than max_num_seqs; the rest wait, and every choice still
    ends with its tokens and every block back."""
    engine = make_engine(max_num_seqs=4)
    ids = [engine.add_request(prompt(20, i), greedy(6, n=3)) for i in range(2)]
    log: dict[str, list] = {}
    while engine.has_work:
        for event in engine.step():
            log.setdefault(event.request_id, []).append(event)
        assert len(engine.scheduler.running) <= 4
    for request_id in ids:
        done = [e for e in log[request_id] if isinstance(e, FinishedEvent)]
        assert sorted(e.index for e in done) == [0, 1, 2]
        assert all(e.completion_tokens == 6 for e in done)
    assert engine.kv.pool.num_used == 0


def test_a_step_that_raises_as_its_prompt_forks_leaves_no_block_behind(make_engine, monkeypatch):
    """The block each choice of an n-choice request gets for its copy of the prompt's last
    block is reserved when the step is planned; a step that then raises (an engine bug, which
    fail_all answers) must not leave it held."""
    engine = make_engine()
    engine.add_request(prompt(20), greedy(4, n=3))  # 20 tokens: a partly filled last block

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in sampling")

    monkeypatch.setattr("gapless.engine.engine.sample_runs", broken)
    with pytest.raises(RuntimeError, match="a bug in sampling"):
        engine.step()
    engine.fail_all("the step failed")
    assert engine.kv.pool.num_used == 0 and not engine.has_work


def test_llm_sets_its_process_up_as_gapless_serve_does(checkpoint, monkeypatch):
    """LLM builds through engine/builder.py as the server does: the thread count it is given,
    and the largest step the engine can schedule run once before the first request."""
    from gapless import LLM

    largest: list[tuple[int, int]] = []
    monkeypatch.setattr(
        ModelRunner, "run_largest_step", lambda self, n, context: largest.append((n, context))
    )
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(checkpoint("llama")), num_threads=1, kv_cache_tokens=1024)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    engine = llm.engine
    context = min(engine.max_model_len, engine.kv.pool.num_blocks * engine.kv.pool.block_size)
    assert largest == [(min(engine.scheduler.max_step_tokens, context), context)]
