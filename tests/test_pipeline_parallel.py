"""Pipeline parallelism: two stages compute what one rank computes (and what transformers
computes; also with each stage split over two tensor-parallel ranks), each loading and holding
about half the weights, and a stage that dies fails the server cleanly.

The in-process checks run on test_tensor_parallel's group of two ranks (this process and one
worker): what rank 0 tells them to load (LoadModel.pipeline_layers) makes them stages.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import ARCHS, MOE_ARCHS
from gguf import GGMLQuantizationType as QType
from helpers import greedy
from test_model import Seq, hf_model, prompt, run_chunks
from test_speculation import check_speculation_ran, oracle  # noqa: F401 - a fixture
from test_tensor_parallel import (  # noqa: F401 - tp2 is a fixture
    check_a_failed_rank_fails_the_server,
    tp2,
)

from gapless import LLM, SamplingParams
from gapless.bench.gguf_files import write_gguf
from gapless.engine import distributed
from gapless.engine.builder import kv_runner, what_ranks_load
from gapless.engine.config import EngineConfig
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.observability import stats
from gapless.engine.plan import StepOutcome
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager
from gapless.model.checkpoint import load_model, read_model_config
from gapless.model.decoder import Decoder
from gapless.model.parallel import ShardError, TensorParallel
from gapless.model.pipeline import split_by_bytes

GREEDY = greedy(30)


def staged_runner(parallel: TensorParallel, path: Path, num_blocks: int) -> ModelRunner:
    """Rank 0's runner of stage 0 of `path` split in two by bytes; the worker runs stage 1."""
    config = EngineConfig(dtype="float32", pipeline_parallel_size=2)
    load = what_ranks_load(path, config)
    parallel.broadcast(load)
    decoder, _ = load.load(parallel)
    parallel.broadcast(distributed.AllocateKV(num_blocks, 16))
    return ModelRunner(decoder, num_blocks, 16)


# Every family's tiny checkpoint. Among them gemma3: sliding-window layers on both sides of a
# global one, tied embeddings (the last stage holds a copy); qwen3_moe: a mixture with a dense
# layer between sparse ones. (One rank's logits are transformers': test_model, test_moe.)
@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_two_stages_give_one_ranks_logits_however_chunked(checkpoint, tp2, arch):  # noqa: F811
    path, ids = checkpoint(arch), prompt(80)  # longer than the 24-token windows
    one = run_chunks(ModelRunner(load_model(path, "float32")[0], 16, 16), Seq(ids, 0), [80])
    runner = staged_runner(tp2, path, 16)
    assert len(runner.kv_cache) == len(runner.decoder.layers) < runner.decoder.config.num_layers
    for sizes in ([80], [7] * 11 + [3]):  # whole, and in 7-token chunks
        two = run_chunks(runner, Seq(ids, 0), sizes)
        assert (one - two).abs().max().item() < 1e-4


# (arch, prompt tokens per chunk or None: unchunked, ranks per stage). qwen2 x 2: each stage
# split by tensor parallelism too (4 ranks), its tied lm_head cut from the last stage's copy.
@pytest.mark.parametrize(
    "arch, chunk, tp",
    [
        ("llama", 7, 1),
        ("llama", None, 1),
        ("gemma3", 7, 1),
        ("gemma3", None, 1),
        ("qwen2", 7, 2),
    ],
)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(checkpoint, arch, chunk, tp):
    path, ids = checkpoint(arch), prompt(60, seed=5)
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        greedy = hf.generate(
            torch.tensor([ids[:30]]), max_new_tokens=30, min_new_tokens=30, do_sample=False
        )[0, 30:].tolist()
    chunking = {"prefill_chunk": chunk} if chunk else {"chunked_prefill": False}
    split = {"pipeline_parallel_size": 2, "tensor_parallel_size": tp}
    exact = {"dtype": "float32", "kv_cache_dtype": "float32"}  # transformers' float32
    with LLM(path, **exact, **split, **chunking) as llm:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True)
        out = llm.generate([ids], params)[0]
        greedy_out = llm.generate([ids[:30]], GREEDY)[0].token_ids
    diff = max(
        abs(out.prompt_logprobs[pos][1] - ref[pos - 1, ids[pos]].item())
        for pos in range(1, len(ids))
    )
    assert diff < 1e-4
    assert greedy_out == greedy


def test_every_choice_of_a_prompt_continues_it_on_every_stage(checkpoint):
    # 20 tokens: each choice's copy of the prompt's partly filled last block must be made in
    # every stage's cache, not only rank 0's, or the later choices read zeros there.
    path, ids = checkpoint("llama"), prompt(20)
    expected = LLM(path, dtype="float32").generate([ids], greedy(8))[0].token_ids
    got: dict[int, list[int]] = {}
    with LLM(path, dtype="float32", pipeline_parallel_size=2) as llm:
        llm.engine.add_request(ids, greedy(8, n=3))
        while llm.engine.has_work:
            for event in llm.engine.step():
                if isinstance(event, TokenEvent):
                    got.setdefault(event.index, []).extend(event.token_ids)
    assert got == {0: expected, 1: expected, 2: expected}


def test_prefix_cache_speculation_and_embeddings_run_as_on_one_rank(
    checkpoint,
    oracle,  # noqa: F811
):
    # The oracle proposes the expected tokens, every other proposal's last one wrong: the
    # steps verify runs of proposals, accepting some and rejecting others.
    path, ids = checkpoint("llama"), prompt(70, seed=2)
    one = LLM(path, dtype="float32", prefill_chunk=16, speculate="none")
    expected = one.generate([ids], greedy(24))[0].token_ids
    vectors = one.embed([ids[:40], ids[:9]], pooling="mean")
    oracle[tuple(ids)] = expected
    with LLM(path, dtype="float32", prefill_chunk=16, pipeline_parallel_size=2) as llm:
        first = llm.generate([ids], greedy(24))[0]
        again = llm.generate([ids], greedy(24))[0]  # its full blocks from the prefix cache
        got = llm.embed([ids[:40], ids[:9]], pooling="mean")
        check_speculation_ran(llm.engine)
    assert first.token_ids == again.token_ids == expected
    assert again.cached_prompt_tokens == 64
    assert torch.allclose(torch.tensor(got), torch.tensor(vectors), atol=1e-5)


def test_gguf_stages_give_one_ranks_logits(checkpoint, tp2, tmp_path):  # noqa: F811
    path, ids = write_gguf(checkpoint("qwen2"), tmp_path / "q8.gguf", QType.Q8_0), prompt(40)
    one = run_chunks(ModelRunner(load_model(path, "float32")[0], 16, 16), Seq(ids, 0), [40])
    # One chunk, as the reference: a quantized model's prompt chunks may run in bf16 here.
    two = run_chunks(staged_runner(tp2, path, 16), Seq(ids, 0), [40])
    assert (one - two).abs().max().item() < 1e-4 * one.abs().max().item()


def weight_bytes(decoder: Decoder) -> int:
    """The bytes of every tensor the decoder's embeddings, layers, norm and lm_head hold."""
    seen: dict[int, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            seen[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            walk(list(obj.values()))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):  # layers, linears
            walk(list(vars(obj).values()))

    walk([decoder.embed, decoder.layers, decoder.final_norm, decoder.lm_head])
    return sum(seen.values())


@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_each_stage_loads_and_holds_its_share_of_the_weights(checkpoint, tmp_path, form):
    path = checkpoint("qwen3", num_hidden_layers=8)  # untied: lm_head weighs as embeddings
    if form == "gguf":
        path = write_gguf(path, tmp_path / "q8.gguf", QType.Q8_0)
    whole = weight_bytes(load_model(path, "float32")[0])
    load = what_ranks_load(path, EngineConfig(dtype="float32", pipeline_parallel_size=2))
    tied = read_model_config(path).tie_word_embeddings
    assert not tied and load.pipeline_layers == (4, 4)
    stages = []
    for rank in range(2):  # loading needs no peer: built here one after the other
        ranks = TensorParallel(rank, 2, None, None, "cpu")  # type: ignore[arg-type]
        stages.append(load.load(ranks)[0])
    first, last = stages
    assert first.lm_head is None and last.embed is None
    assert (len(first.layers), len(last.layers)) == (4, 4)
    for stage in stages:
        assert abs(weight_bytes(stage) - whole / 2) < 0.05 * whole


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_memory_is_each_stages_budget(checkpoint, arch):
    # gemma3: its sliding and global layers, each a KV group, fall unevenly on the stages.
    path, budget = checkpoint(arch), 2**20
    config = EngineConfig(dtype="float32", kv_memory_gib=budget / 2**30, pipeline_parallel_size=2)
    load = what_ranks_load(path, config)
    stages = [load.load(TensorParallel(r, 2, None, None, "cpu"))[0] for r in range(2)]  # type: ignore[arg-type]
    sized = kv_runner(stages[0], config)  # rank 0 sizes the cache every stage allocates
    held = []
    for decoder in stages:
        runner = ModelRunner(
            decoder,
            sized.num_blocks,
            16,
            window_blocks=sized.window_blocks,
            kv_cache_dtype=sized.kv_cache_dtype,
        )
        held.append(sum(k.nbytes + v.nbytes for k, v in runner.kv_cache))
    assert max(held) <= budget
    whole = kv_runner(
        load_model(path, "float32")[0], dataclasses.replace(config, pipeline_parallel_size=1)
    )
    if arch == "llama":  # one layer a stage: twice the tokens in each stage's budget
        assert sized.num_blocks >= 2 * whole.num_blocks - 1
    assert sized.num_blocks > whole.num_blocks


def test_layers_split_by_their_bytes_unless_chosen(checkpoint):
    # A heavy first layer (e.g. the embeddings counted to it) pulls the first cut forward.
    assert split_by_bytes([10] * 8, 0, 0, 2) == (4, 4)
    assert split_by_bytes([10] * 8, 40, 0, 2) == (2, 6)
    assert split_by_bytes([10] * 8, 0, 0, 3) == (3, 2, 3)
    assert split_by_bytes([10] * 3, 1000, 0, 3) == (1, 1, 1)  # each stage keeps a layer
    path = checkpoint("gemma3")  # 7 layers
    chosen = EngineConfig(pipeline_parallel_size=2, pipeline_layers="3,4")
    assert what_ranks_load(path, chosen).pipeline_layers == (3, 4)
    for bad in ("3,3", "0,7", "7", "a,b"):
        config = EngineConfig(pipeline_parallel_size=2, pipeline_layers=bad)
        with pytest.raises(ShardError, match="--pipeline-layers"):
            what_ranks_load(path, config)


def test_what_pipeline_parallelism_refuses_is_named():
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(pipeline_parallel_size=2, speculate="draft", draft_model="x")
    with pytest.raises(ValueError, match="needs --pipeline-parallel-size"):
        EngineConfig(pipeline_layers="1,1")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_stage_that_fails_ends_streams_with_an_error_then_503_then_exit(checkpoint, fault):
    check_a_failed_rank_fails_the_server(checkpoint("llama"), fault, "--pipeline-parallel-size")


def run_engine(
    engine,
    arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
    each_step: Callable[[int], object] = lambda step: None,
) -> dict:
    """Steps the engine until it has no work, adding each of `arrivals`' requests at its step
    and calling `each_step` with the step after it; returns each request's tokens and finish
    reason, by the order of its arrival."""
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while engine.has_work or step <= max(arrivals):
        for ids_prompt, params in arrivals.get(step, []):
            ids.append(engine.add_request(ids_prompt, params))
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens.setdefault(event.request_id, []).extend(event.token_ids)
            elif isinstance(event, FinishedEvent):
                reasons[event.request_id] = event.finish_reason
        each_step(step)
        step += 1
    return {i: (tokens.get(rid, []), reasons[rid]) for i, rid in enumerate(ids)}


def test_steps_in_flight_give_one_ranks_tokens_as_requests_arrive(checkpoint):
    # Requests arrive while others decode and prefill: micro-batches of the requests with no
    # step in flight overlap, and each request's tokens are what one rank gives it.
    path = checkpoint("llama")
    arrivals = {
        0: [(prompt(20, seed=s), greedy(12)) for s in range(3)],
        4: [(prompt(45, seed=3), greedy(10)), (prompt(9, seed=4), greedy(14))],
        9: [(prompt(30, seed=5), greedy(8))],
    }
    one = run_engine(LLM(path, dtype="float32", prefill_chunk=16).engine, arrivals)
    with LLM(path, dtype="float32", prefill_chunk=16, pipeline_parallel_size=2) as llm:
        two = run_engine(llm.engine, arrivals)
        counters = stats(llm.engine)
    assert two == one
    assert all(reason == "length" for _, reason in two.values())
    assert counters["steps_overlapped_total"] > 0 and counters["steps_in_flight"] == 0


def test_a_request_cancelled_in_flight_ends_cancelled_and_frees_its_blocks(checkpoint):
    path = checkpoint("llama")
    with LLM(path, dtype="float32", pipeline_parallel_size=2) as llm:
        engine = llm.engine
        ids = [engine.add_request(prompt(20, seed=s), greedy(30)) for s in range(4)]
        while not engine.scheduler.in_flight.held:
            engine.step()
        victim = next(iter(engine.scheduler.in_flight.held)).request_id
        assert engine.cancel(victim)
        reasons, tokens_after = {}, 0
        while engine.has_work:
            for event in engine.step():
                if isinstance(event, FinishedEvent):
                    reasons[event.request_id] = event.finish_reason
                elif isinstance(event, TokenEvent) and event.request_id == victim:
                    tokens_after += len(event.token_ids)
        assert reasons == {rid: "cancelled" if rid == victim else "length" for rid in ids}
        assert tokens_after == 0
        assert engine.kv.pool.num_used == 0 and not engine.scheduler.in_flight.held


def test_preemption_with_steps_in_flight_gives_one_ranks_tokens(checkpoint):
    # Each stage's KV holds 10 blocks; the four requests need 20: requests with no step in
    # flight are preempted and recomputed, as on one rank.
    path = checkpoint("llama")
    prompts = [prompt(30, seed=s) for s in range(4)]
    expected = [out.token_ids for out in LLM(path, dtype="float32").generate(prompts, greedy(40))]
    decoder = load_model(path, "float32")[0]
    per_stage = decoder.config.num_layers // 2
    budget = 10 * 16 * per_stage * ModelRunner.kv_bytes_per_layer_token(decoder)
    small = {"kv_memory_gib": budget / 2**30, "pipeline_parallel_size": 2}
    with LLM(path, dtype="float32", kv_cache_dtype="float32", **small) as llm:
        assert llm.engine.kv.pool.num_blocks == 10
        got = llm.generate(prompts, greedy(40))
        counters = stats(llm.engine)
    assert [out.token_ids for out in got] == expected
    assert counters["preemptions_total"] > 0 and counters["steps_overlapped_total"] > 0


def test_a_long_prompt_beside_decodes_at_two_stages_gives_one_ranks_tokens(checkpoint):
    # A 60-token prompt arrives at step 4 while three streams decode: its chunks run in
    # consecutive micro-batches, two in flight at once, and every request's tokens are one
    # rank's.
    path = checkpoint("llama")
    arrivals = {
        0: [(prompt(12, seed=s), greedy(20)) for s in range(3)],
        4: [(prompt(60, seed=9), greedy(6))],
    }
    one = run_engine(LLM(path, dtype="float32", prefill_chunk=16).engine, arrivals)
    overlapped: dict[int, int] = {}  # prompt chunks launched beside the one before, by step
    with LLM(path, dtype="float32", prefill_chunk=16, pipeline_parallel_size=2) as llm:

        def count(step: int) -> None:
            overlapped[step] = stats(llm.engine)["prompt_chunks_overlapped_total"]

        assert run_engine(llm.engine, arrivals, count) == one
    # The streams' prompts were computed by step 3: what follows is the long prompt's.
    assert overlapped[max(overlapped)] > overlapped[3]


def test_prompt_logprobs_of_a_prompt_in_overlapping_chunks_are_one_ranks(checkpoint):
    # Two stages share the idle budget of 16: the 60-token prompt runs in chunks of 8, each
    # launched while the one before is in flight (one rank runs chunks of 16).
    path, ids = checkpoint("llama"), prompt(60, seed=9)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    chunked = {"prefill_chunk": 16, "idle_prefill_chunk": 16}
    exact = {"dtype": "float32", "kv_cache_dtype": "float32"}
    one = LLM(path, **exact, **chunked).generate([ids], params)[0].prompt_logprobs
    with LLM(path, **exact, **chunked, pipeline_parallel_size=2) as llm:
        two = llm.generate([ids], params)[0].prompt_logprobs
        overlapped = stats(llm.engine)["prompt_chunks_overlapped_total"]
    assert overlapped == 7  # of its 8 chunks, all but the first
    assert one[0] is None and two[0] is None
    assert [p[0] for p in two[1:]] == [p[0] for p in one[1:]] == ids[1:]
    assert max(abs(p[1] - q[1]) for p, q in zip(one[1:], two[1:], strict=True)) < 1e-4


def test_a_prompts_next_chunk_runs_in_the_next_micro_batch_and_its_last_waits():
    # Two micro-batches share the idle budget of 16: chunks of 8, each launched while the one
    # before is in flight, starting where it ends; once the chunk that completes the prompt
    # (and samples its first token) is in flight, the request waits for it to land.
    config = SchedulerConfig(prefill_chunk=16, idle_prefill_chunk=16, enable_prefix_cache=False)
    scheduler = Scheduler(config, KVManager(BlockPool(16, 16)), micro_batches=2)
    req = Request("long", prompt(20, seed=1), greedy(4))
    scheduler.add(req)
    starts, plans = [], []
    for _ in range(4):
        plan = scheduler.schedule()
        starts += [(req.num_scheduled, c.num_tokens) for c in plan.chunks]
        if plan.chunks:
            scheduler.in_flight.launched(plan, {req})
            plans.append(plan)
    # 20 tokens cut in at least two chunks (10 a micro-batch), of at most 8: 8, 8, 4.
    assert starts == [(0, 8), (8, 8), (16, 4)]
    assert scheduler.in_flight.held[req] == 3 and req.num_scheduled == 20
    for plan in plans:
        scheduler.in_flight.landed(plan, {req})
        scheduler.update(plan, StepOutcome(computed=plan.chunks))
    assert not scheduler.in_flight.held and req.num_computed == 20


def test_a_prompt_cancelled_with_two_chunks_in_flight_runs_no_more_and_frees_its_blocks(
    checkpoint,
):
    # Three stages: between steps two are in flight, both with a chunk of the long prompt
    # (a cancel takes effect at a step's start; at two stages one step is in flight then).
    path, stream_ids = checkpoint("llama", num_hidden_layers=3), prompt(12, seed=1)
    expected = LLM(path, dtype="float32").generate([stream_ids], greedy(30))[0].token_ids
    with LLM(path, dtype="float32", prefill_chunk=16, pipeline_parallel_size=3) as llm:
        engine = llm.engine
        available = engine.kv.pool.num_available
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}

        def step() -> None:
            for event in engine.step():
                if isinstance(event, TokenEvent):
                    tokens.setdefault(event.request_id, []).extend(event.token_ids)
                elif isinstance(event, FinishedEvent):
                    reasons[event.request_id] = event.finish_reason

        def held() -> int:  # the long prompt's steps in flight
            return sum(
                n for r, n in engine.scheduler.in_flight.held.items() if r.request_id == long
            )

        stream = engine.add_request(stream_ids, greedy(30))
        for _ in range(4):
            step()
        long = engine.add_request(prompt(60, seed=9), greedy(4))
        for _ in range(10):
            step()
            if held() == 2:
                break
        req = next(r for r in engine.scheduler.running if r.request_id == long)
        assert held() == 2 and req.num_scheduled < 60
        assert engine.cancel(long)
        launched = req.num_scheduled  # its tokens launched, which no later chunk moves
        while engine.has_work:
            step()
            assert req.num_scheduled <= launched
            assert req.kv.block_table or not held()  # its chunks in flight write its blocks
        assert reasons == {stream: "length", long: "cancelled"}
        assert tokens == {stream: expected}  # and none for the long prompt
        assert engine.kv.pool.num_used == 0 and engine.kv.pool.num_available == available
        assert not engine.scheduler.in_flight.held and not engine.scheduler.in_flight.cancelled
