"""Sliding-window layers hold only their window of KV (kv/groups.py): a Gemma-3-shaped model's
local layers keep their blocks in a pool of their own, released as the window passes, and the
tokens are those of transformers and of a cache that keeps every layer's whole context."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, prompt
from test_engine import finished, run, tokens
from test_model import hf_model

from gapless import LLM, Engine, EngineConfig
from gapless.engine.plan import StepOutcome
from gapless.engine.request import Request, RequestState
from gapless.engine.runner import ModelRunner
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.groups import KVGroup, LayerGroups, split_blocks, window_blocks
from gapless.kv.manager import KVManager
from gapless.model.checkpoint import load_model

WINDOW = 24  # the gemma3 test checkpoint's (tests/checkpoints.py)
BLOCK = 16
CHUNK = 20  # cuts windows and blocks alike
PROMPT, DECODE = 130, 70  # several windows long


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    return checkpoint("gemma3")


def engine(path, **fields) -> Engine:
    chunks = {"prefill_chunk": CHUNK, "idle_prefill_chunk": CHUNK}
    return Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **chunks, **fields))


def full_kv_engine(path) -> Engine:
    """Every layer keeps the whole context, in one pool: as before sliding groups."""
    decoder, tokenizer = load_model(path, "float32")
    config = EngineConfig.of(dtype="float32", prefill_chunk=CHUNK, idle_prefill_chunk=CHUNK)
    return Engine(decoder, tokenizer, config, runner=ModelRunner(decoder, 64, BLOCK))


def pools_empty(e: Engine) -> bool:
    return all(g.pool.num_used == 0 for g in e.kv.groups)


def test_the_local_layers_form_a_group_with_a_pool_of_their_own(gemma3):
    e = engine(gemma3)
    assert e.runner.groups.windows == (None, WINDOW)
    assert e.runner.groups.layers == ((5,), (0, 1, 2, 3, 4, 6))
    [sliding] = e.kv.groups[1:]
    assert sliding.window == WINDOW and sliding.pool.num_blocks == e.runner.window_blocks[0]
    cache = e.runner.kv_cache
    assert cache[5][0].shape[0] == e.kv.pool.num_blocks
    assert cache[0][0].shape[0] == sliding.pool.num_blocks < e.kv.pool.num_blocks
    e.reserve_peak_memory()  # its largest step fits the local pool too


def test_a_long_run_gives_the_tokens_of_transformers_and_of_full_kv(gemma3):
    ids = prompt(PROMPT, 7)
    with torch.no_grad():
        out = hf_model(gemma3).generate(
            torch.tensor([ids]), max_new_tokens=DECODE, min_new_tokens=DECODE, do_sample=False
        )
    want = out[0, PROMPT:].tolist()
    full = full_kv_engine(gemma3)
    full.add_request(ids, greedy(DECODE))
    assert tokens(next(iter(run(full).values()))) == want

    e = engine(gemma3, speculate="none")  # one token a decode step, for the block count
    e.add_request(ids, greedy(DECODE))
    [sliding] = e.kv.groups[1:]
    peak_prefill = peak_decode = 0
    log: dict = {}
    while e.has_work:
        [req] = e.scheduler.running or [None]
        decoding = req is not None and req.is_decoding
        for event in e.step():
            log.setdefault(event.request_id, []).append(event)
        # What the step held: the full layers every block so far, the local ones a window.
        used = sliding.pool.num_used
        if decoding:
            peak_decode = max(peak_decode, used)
        else:
            peak_prefill = max(peak_prefill, used)
        if e.scheduler.running:
            [req] = e.scheduler.running
            assert e.kv.pool.num_used == -(-req.num_computed // BLOCK)
            assert used == sum(b >= 0 for b in req.kv.window_tables[0])
    # The window math: a step of n new tokens holds the first one's window - 1 keys back and
    # the n, over one more block where they straddle block edges, and it is reached.
    assert peak_decode == window_blocks(WINDOW, 1, BLOCK) == 3
    assert peak_prefill == window_blocks(WINDOW, CHUNK, BLOCK) == 4
    assert tokens(next(iter(log.values()))) == want
    assert pools_empty(e)


def test_a_prefix_hit_gives_the_same_tokens(gemma3):
    ids = prompt(PROMPT, 8)
    e = engine(gemma3)
    first = e.add_request(ids, greedy(20))
    want = tokens(run(e)[first])
    again = e.add_request(ids + [], greedy(20))
    events = run(e)[again]
    # The full layers hold the whole prompt, the local ones their last window: all but the
    # last token's block (at least one token is computed) is served.
    assert finished(events).cached_prompt_tokens == (PROMPT - 1) // BLOCK * BLOCK
    assert tokens(events) == want
    assert pools_empty(e)


def test_verified_proposals_read_back_a_window_from_their_first_position(gemma3):
    # A prompt that repeats itself, so that prompt lookup proposes runs of its tokens.
    ids = prompt(40, 10) * 4
    outputs = []
    for x in (full_kv_engine(gemma3), e := engine(gemma3)):
        rid = x.add_request(ids, greedy(60))
        outputs.append(tokens(run(x)[rid]))
    want, got = outputs
    assert e.metrics.speculative_accepted_tokens > 0
    assert got == want
    assert pools_empty(e)


def test_n_choices_fork_every_group(gemma3):
    # Ends 12 tokens into a block: each choice copies that block, in each group, and half the
    # local layers' window lies in it.
    ids = prompt(8 * BLOCK + 12, 12)
    e = engine(gemma3)
    rid = e.add_request(ids, greedy(20))
    want = tokens(run(e)[rid])
    e.add_request(ids, greedy(20, n=2), request_id="two")
    events = run(e)["two"]
    for index in (0, 1):
        chosen = [ev for ev in events if getattr(ev, "index", None) == index]
        assert tokens(chosen) == want
    assert pools_empty(e)


def test_two_ranks_keep_the_same_groups(gemma3):
    ids = prompt(PROMPT, 11)
    want = LLM(gemma3, dtype="float32", prefill_chunk=CHUNK).generate([ids], greedy(20))
    llm = LLM(gemma3, dtype="float32", prefill_chunk=CHUNK, tensor_parallel_size=2)
    assert llm.engine.runner.window_blocks
    assert llm.generate([ids], greedy(20))[0].token_ids == want[0].token_ids


def test_cancel_mid_prefill_frees_every_group(gemma3):
    e = engine(gemma3, max_num_seqs=1)
    rid = e.add_request(prompt(PROMPT, 9), greedy(5, n=2))  # its second choice waits to fork
    queued = e.add_request(prompt(PROMPT, 10), greedy(5))
    for _ in range(4):
        e.step()
    [req] = e.scheduler.running
    assert req.state is RequestState.PREFILLING and -1 in req.kv.window_tables[0]
    e.cancel(rid)
    e.cancel(queued)
    e.step()
    assert not e.has_work and pools_empty(e)


def scheduled(scheduler: Scheduler, request: Request) -> None:
    """Runs the request's prompt through the scheduler as if the forwards had run it."""
    scheduler.add(request)
    while request.num_uncomputed:
        plan = scheduler.schedule()
        scheduler.update(plan, StepOutcome(computed=plan.chunks))


def test_a_prefix_is_served_only_as_far_as_every_group_holds_the_next_window():
    local = BlockPool(12, BLOCK)
    scheduler = Scheduler(
        SchedulerConfig(prefill_chunk=32, idle_prefill_chunk=32),
        KVManager(BlockPool(64, BLOCK), None, [KVGroup(local, WINDOW)]),
    )
    ids = prompt(8 * BLOCK + 3)
    a = Request("a", ids, SamplingParams())
    scheduled(scheduler, a)
    # Only the last blocks of the window stay in use; those before are cached, not lost.
    assert sum(b >= 0 for b in a.kv.window_tables[0]) == 3
    scheduler.remove(a)
    assert local.num_used == 0 and local.num_cached == 8  # the 9th was not full
    # Evict the local blocks of the prompt's first half (least recently freed first).
    local.release(local.allocate(local.num_free + 4))
    b = Request("b", ids + [7] * 40, SamplingParams())
    scheduled(scheduler, b)
    assert b.cached_prompt_tokens == 8 * BLOCK  # its window at 128 reaches back to block 6
    scheduler.remove(b)
    # Evict all local blocks: the full layers still hold the prompt, but no position's window
    # is whole, so nothing is served.
    local.release(local.allocate(local.num_available))
    c = Request("c", ids, SamplingParams())
    scheduled(scheduler, c)
    assert c.cached_prompt_tokens == 0
    scheduler.remove(c)
    assert all(g.pool.num_used == 0 for g in scheduler.kv.groups)


def test_gemma3_270m_kv_bytes_per_token():
    """The figures docs/server.md quotes: Gemma 3 270M keeps 18 layers of 1 KV head of 256
    dims, 3 of them global, the others local with a 512-token window."""
    groups = LayerGroups.of(((512,) * 5 + (None,)) * 3)
    per_layer = 2 * 1 * 256 * 2  # K and V, bfloat16
    full, local = groups.bytes_per_token(per_layer)
    assert (full, local) == (3072, 15360)

    def per_token(context: int) -> int:
        """While decoding at this context: the local layers hold at most 33 blocks."""
        held = min(context, window_blocks(512, 1, BLOCK) * BLOCK)
        return round(full + local * held / context)

    assert full + local == 18432  # before: every layer the whole context
    assert (per_token(8192), per_token(32768)) == (4062, 3320)
    # Under the default --kv-memory 2 GiB and scheduler, with 32k-token contexts: the local
    # layers get what every sequence's window and one step's tokens need, the global ones
    # the rest, which holds 4.4x the tokens that one pool for every layer held.
    config = SchedulerConfig()
    blocks, (local_blocks,) = split_blocks(
        groups, BLOCK, [full, local], 64, config.max_step_tokens(False), 32768, None, 2 * 2**30
    )
    assert local_blocks == 64 * 33 + 4096 // BLOCK
    assert (blocks * BLOCK, 2 * 2**30 // (18432 * BLOCK) * BLOCK) == (509_600, 116_496)


def test_a_budget_too_small_for_every_window_is_shared_block_for_block():
    # Gemma 2's shape: alternating, window 4,096; 1 GiB is less than 64 sequences' windows.
    groups = LayerGroups.of((4096, None) * 13)
    per_token = groups.bytes_per_token(4096)
    full, (local,) = split_blocks(groups, BLOCK, per_token, 64, 4096, 8192, None, 2**30)
    assert full == local == 2**30 // (sum(per_token) * BLOCK)
    # One group (every layer full, or every layer one window) is sized as it always was.
    one = LayerGroups.of((None,) * 4)
    assert one.windows == (None,)
    # Bytes: no more than every running sequence (2) at full context (8,192 tokens).
    assert split_blocks(one, BLOCK, [4096], 2, 512, 8192, None, 2**30) == (2 * 8192 // BLOCK, ())
    assert split_blocks(one, BLOCK, [4096], 2, 512, 8192, 1000, 2**30) == (63, ())  # tokens
