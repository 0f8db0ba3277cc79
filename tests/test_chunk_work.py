"""The prompt budget counts work, not tokens: a chunk after a long history gets as many tokens
as cost what the budget's tokens cost at a prompt's start (ModelConfig.prompt_work), so the
last chunk of a long prompt stalls the decodes beside it no longer than the first."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from helpers import run_step

from gapless.engine.request import Request, RequestState
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager
from gapless.model.families import model_config

# SmolLM2-135M's config.json, the default model's shape.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
}


def test_a_key_costs_what_its_scores_and_values_cost_against_a_tokens_matmuls():
    work = model_config(SMOLLM2).prompt_work()
    assert work(1, 0) == pytest.approx(1 + 1 / 3072)  # a token sees itself
    # 512 tokens after 7,680 keys: each sees 7,936 on average.
    assert work(512, 7680) / work(512, 0) == pytest.approx(3.307, abs=1e-3)


def test_a_window_caps_the_keys_a_layer_counts():
    full = model_config(SMOLLM2)
    windowed = dataclasses.replace(full, layer_windows=(7, None) * 15)
    work, keys_per_token = windowed.prompt_work(), 2 * 9 * 64 / 106_168_320
    for tokens, start in itertools.product(range(1, 12), range(0, 20)):
        positions = range(start, start + tokens)
        seen = 15 * sum(min(p + 1, 7) + p + 1 for p in positions)
        assert work(tokens, start) == pytest.approx(tokens + seen * keys_per_token)


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100))


def decoding(scheduler: Scheduler, streams: int) -> None:
    for i in range(streams):
        scheduler.add(request(f"s{i}", 8))
    run_step(scheduler)


def scheduler(**options) -> Scheduler:
    config = SchedulerConfig(prefill_chunk=512, idle_prefill_chunk=4096, **options)
    return Scheduler(
        config, KVManager(BlockPool(4096, 16)), prompt_work=model_config(SMOLLM2).prompt_work()
    )


def test_chunks_of_a_long_prompt_shrink_to_a_fresh_chunks_work():
    sched, work = scheduler(), model_config(SMOLLM2).prompt_work()
    decoding(sched, streams=4)
    long = request("long", 8192)
    sched.add(long)
    starts, sizes = [0], []
    while long.state is not RequestState.DECODING:
        sizes.append(run_step(sched)["long"])
        starts.append(starts[-1] + sizes[-1])
    assert sizes[0] == 512 and starts[-1] == 8192
    assert sizes == sorted(sizes, reverse=True) and sizes[-2] < 512 / 3
    # Each chunk the most that fits; the last what is left.
    for start, n in zip(starts[:-2], sizes[:-1], strict=True):
        assert work(n, start) <= work(512, 0) < work(n + 1, start)


def test_prompts_sharing_a_step_share_its_work():
    sched, work = scheduler(prefill_policy="fcfs"), model_config(SMOLLM2).prompt_work()
    decoding(sched, streams=1)
    deep = request("deep", 6000)
    sched.add(deep)
    while deep.num_computed < 4096:
        run_step(sched)
    sched.add(request("fresh", 1000))
    start = deep.num_computed
    sizes = run_step(sched)
    assert 0 < sizes["deep"] < 512 and 0 < sizes["fresh"] < 512 - sizes["deep"]
    spent = work(sizes["deep"], start) + work(sizes["fresh"], 0)
    assert spent <= work(512, 0) < spent + 1 + 1 / 3072


def test_a_history_too_long_for_the_budget_still_moves_a_token_a_step():
    config = SchedulerConfig(prefill_chunk=512, idle_prefill_chunk=512)
    # A token after `start` ones costs 1 + start: past 511, one alone is over the budget.
    sched = Scheduler(
        config, KVManager(BlockPool(4096, 16)), prompt_work=lambda n, start: n * (1 + start)
    )
    decoding(sched, streams=1)
    sched.add(request("deep", 520))
    assert [run_step(sched)["deep"] for _ in range(3)] == [512, 1, 1]


def test_a_latency_targets_budget_is_taken_as_tokens():
    """The cost model sized it for the history's keys already."""
    config = SchedulerConfig(prefill_chunk=512, idle_prefill_chunk=4096)
    sched = Scheduler(
        config,
        KVManager(BlockPool(4096, 16)),
        prefill_budget=lambda contexts, start, target: 300,
        itl_targets={"standard": 0.1},
        prompt_work=model_config(SMOLLM2).prompt_work(),
    )
    decoding(sched, streams=2)
    deep = request("deep", 9000)
    sched.add(deep)
    assert [run_step(sched)["deep"] for _ in range(30)] == [300] * 30  # to 9,000 tokens
