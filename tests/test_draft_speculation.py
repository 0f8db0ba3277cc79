"""Speculative decoding with a draft model (engine/draft.py): the same greedy tokens, and the
same seeded samples, as without it, with prompt chunks and other decodes in the same steps;
the target as its own draft has all its proposals accepted; cancellation frees both pools'
blocks; a draft with another tokenizer is refused by name."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from checkpoints import ARCHS
from helpers import greedy, prompt
from test_speculation import (
    Run,
    cancel_once_it_verifies,
    check_speculation_ran,
    decoding,
)

from gapless.engine.config import EngineConfig
from gapless.engine.draft import DraftModel, check_same_tokenizer
from gapless.engine.engine import Engine
from gapless.engine.plan import DraftPlan
from gapless.engine.request import Request
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler, SchedulerConfig
from gapless.kv.block_pool import BlockPool
from gapless.kv.manager import KVManager
from gapless.model.tokenizer import Tokenizer
from gapless.server.cli import add_serve_parser, engine_config

# Small chunks: the longer prompts prefill over several steps while the shorter one decodes.
CHUNKED = {"prefill_chunk": 16, "idle_prefill_chunk": 16, "enable_prefix_cache": False}
# (step it arrives at, prompt tokens, seed): each later prompt prefills over several steps
# while the first decodes, and ends in a chunk of 8 (16, 16, 8; 16, 8), which leaves half a
# step's budget for the draft to catch up on what it missed and propose beside it.
ARRIVALS = [(0, 12, 1), (3, 40, 2), (6, 24, 3)]


def engine_of(path, **options) -> Engine:
    return Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **CHUNKED, **options))


def tokens_of(engine: Engine, params: SamplingParams) -> tuple[list[list[int]], Run]:
    run = Run(engine)
    rids = []
    for step, n, seed in ARRIVALS:
        while engine.num_steps < step:
            run.step()
        # The first decodes (and accepts runs of proposals) until the last prompt chunk.
        most = params.max_tokens * (4 if not rids else 1)
        rids.append(run.add(prompt(n, seed), dataclasses.replace(params, max_tokens=most)))
    run.until_idle()
    assert engine.draft is None or engine.draft.pool.num_used == 0
    return [run.tokens[r] for r in rids], run


def draft_forwards(engine: Engine) -> list[list[int]]:
    """Each forward of the engine's draft model from here on: its chunks' token counts."""
    forwards: list[list[int]] = []
    run = engine.draft.runner.run

    def spy(inputs: list) -> tuple:
        forwards.append([len(i.token_ids) for i in inputs])
        return run(inputs)

    engine.draft.runner.run = spy
    return forwards


@pytest.mark.parametrize("draft_arch", ["llama", "qwen2"])
def test_greedy_tokens_are_the_same_with_a_draft(checkpoint, draft_arch):
    # Another random model: most of its proposals are rejected.
    target = checkpoint("llama")
    want, _ = tokens_of(engine_of(target, speculate="none"), greedy(32))
    engine = engine_of(target, speculate="draft", draft_model=str(checkpoint(draft_arch, seed=1)))
    assert tokens_of(engine, greedy(32))[0] == want
    assert engine.metrics.speculative_proposed_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_target_as_its_own_draft_has_its_proposals_accepted(checkpoint, arch):
    """Every family, its own draft: the same greedy tokens, proposals verified beside prompt
    chunks, nearly all accepted."""
    target = checkpoint(arch)
    want, _ = tokens_of(engine_of(target, speculate="none"), greedy(32))
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    tokens, run = tokens_of(engine, greedy(32))
    assert tokens == want
    assert run.mixed_steps > 0  # proposals verified beside prompt chunks
    metrics = engine.metrics
    assert metrics.speculative_proposed_tokens >= 20
    # Only float rounding between a batched verification row and a draft row could make the
    # two argmaxes differ.
    assert metrics.speculative_accepted_tokens >= 0.95 * metrics.speculative_proposed_tokens


def test_seeded_samples_are_the_same_with_a_draft(checkpoint):
    target = checkpoint("llama")
    # A low temperature, so that the random model's draws often are its argmax: the draft's
    # proposals are then both accepted and rejected.
    params = SamplingParams(max_tokens=24, temperature=0.05, seed=7, ignore_eos=True)
    want, _ = tokens_of(engine_of(target, speculate="none"), params)
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    assert tokens_of(engine, params)[0] == want
    check_speculation_ran(engine)


def test_cancel_during_verification_frees_both_pools_and_leaves_others_unchanged(checkpoint):
    target = checkpoint("llama")
    pa, pb = prompt(40, 1), prompt(50, 2)
    plain = Run(engine_of(target, speculate="none"))
    b_plain = plain.add(pb, greedy(40))
    plain.until_idle()
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    run = Run(engine)
    a, b = run.add(pa, greedy(40)), run.add(pb, greedy(40))
    cancelled = cancel_once_it_verifies(engine, a)
    while a not in run.finished:
        run.step()
    assert cancelled == [True]
    [req_b] = engine.scheduler.running
    assert engine.kv.pool.num_used == len(req_b.kv.block_table)
    draft_blocks = engine.draft._tables.get(req_b, [])
    assert engine.draft.pool.num_used == len(draft_blocks)
    run.until_idle()
    assert engine.draft.pool.num_used == 0
    assert run.tokens[b] == plain.tokens[b_plain]


def a_decodes_b_computed(
    run: Run, a_tokens: int, b_prompt: int, b_tokens: int
) -> tuple[str, str, Request]:
    """A (a 12-token prompt) decodes for three steps, then B's b_prompt-token prompt arrives
    and runs until its first token: the ids of A and B, and B's request."""
    a = run.add(prompt(12, 1), greedy(a_tokens))
    for _ in range(3):
        run.step()
    b = run.add(prompt(b_prompt, 2), greedy(b_tokens))
    while b not in run.tokens:
        run.step()
    [req_b] = [r for r in run.engine.scheduler.running if r.request_id == b]
    return a, b, req_b


def test_a_long_prompt_catches_the_draft_up_in_chunks_of_the_step_budget(checkpoint):
    target = checkpoint("llama")
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    forwards = draft_forwards(engine)
    run = Run(engine)
    a, b, req_b = a_decodes_b_computed(run, 400, 200, 64)
    # B's prompt is computed: now the draft reads it, while A decodes every step.
    first = len(forwards)
    steps = 0
    while engine.draft.unseen(req_b) > 2:
        assert req_b in engine.scheduler.running
        run.step()
        steps += 1
        assert run.step_tokens[-1].get(a)
    read = [sum(f) for f in forwards[first:]]
    assert read and max(read) <= CHUNKED["prefill_chunk"]
    assert steps >= 200 // CHUNKED["prefill_chunk"]
    run.until_idle()
    assert max(sum(f) for f in forwards) <= CHUNKED["idle_prefill_chunk"]


def test_cancel_while_the_draft_catches_up_frees_its_blocks(checkpoint):
    target = checkpoint("llama")
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    run = Run(engine)
    _, b, req_b = a_decodes_b_computed(run, 60, 120, 40)
    run.step()  # the draft reads B's first chunk
    assert engine.draft.unseen(req_b) > 1 and engine.draft._tables[req_b]
    assert engine.cancel(b)
    run.step()
    assert run.finished[b].finish_reason == "cancelled"
    [req_a] = engine.scheduler.running
    assert engine.draft.pool.num_used == len(engine.draft._tables[req_a])
    run.until_idle()
    assert engine.draft.pool.num_used == 0


def test_batched_proposals_are_the_proposals_made_one_at_a_time(checkpoint):
    engine = engine_of(checkpoint("llama"), speculate="draft", draft_model=str(checkpoint("qwen2")))
    decoder = engine.draft.runner.decoder

    def decoding(n: int, seed: int) -> Request:
        req = Request(str(seed), prompt(n, seed), greedy(64))
        req.output_ids.append(7)
        req.num_computed = req.num_tokens - 1
        return req

    shapes = [(30, 1, 1), (5, 2, 3), (47, 3, 5)]  # prompt length, seed, k
    batched = DraftModel(decoder, 64, 16)
    alone = {seed: DraftModel(decoder, 64, 16) for _, seed, _ in shapes}
    requests = [(decoding(n, seed), seed, k) for n, seed, k in shapes]
    for _ in range(3):  # a whole prompt, then a few tokens after a partly accepted run
        together = batched.propose([DraftPlan(r, batched.unseen(r), k) for r, _, k in requests])
        for req, seed, k in requests:
            draft = alone[seed]
            assert draft.propose([DraftPlan(req, draft.unseen(req), k)]) == {req: together[req]}
            assert len(together[req]) == k
            kept = together[req][: k // 2]
            req.output_ids += [*kept, 11]
            req.num_computed += 1 + len(kept)
    for req, seed, _ in requests:
        for draft in (batched, alone[seed]):
            draft.release(req)
    assert batched.pool.num_used == 0


def test_the_draft_runs_its_largest_step_before_serving_and_keeps_no_trace(checkpoint):
    target = checkpoint("llama")
    fresh = engine_of(target, speculate="draft", draft_model=str(target), kv_cache_tokens=256)
    engine = engine_of(target, speculate="draft", draft_model=str(target), kv_cache_tokens=256)
    decoder, steps = engine.draft.runner.decoder, []
    run_layers = decoder.run_layers
    decoder.run_layers = lambda batch, *rest: (
        steps.append(len(batch.token_ids)),
        run_layers(batch, *rest),
    )
    engine.reserve_peak_memory()
    assert steps == [engine.scheduler.max_step_tokens]
    assert all(not k.any() and not v.any() for k, v in engine.draft.runner.kv_cache)
    assert tokens_of(engine, greedy(16))[0] == tokens_of(fresh, greedy(16))[0]


class CountingDraft:
    """Stands in for a DraftModel that has `unseen` tokens to read for every request; keeps
    each step's plans as (catch_up, k)."""

    def __init__(self, unseen: int) -> None:
        self.unseen = lambda request: unseen
        self.plans: list[list[tuple[int, int]]] = []

    def propose(self, plans: list[DraftPlan]) -> dict[Request, list[int]]:
        self.plans.append([(p.catch_up, p.k) for p in plans])
        return {p.request: [1] * p.k for p in plans}


@pytest.mark.parametrize(
    ("unseen", "waiting", "room", "plans"),
    [
        (100, 0, None, [(32, 0)]),  # a prompt's catch-up: a chunk of the step's budget
        (3, 0, None, [(3, 2)]),  # caught up: proposes what acceptance is worth at batch 1
        (100, 20, None, [(12, 0)]),  # a prompt chunk goes first; the draft takes the rest
        (100, 100, None, []),  # ... and none is left
        (100, 100, 0, []),  # a latency target with no room: prompts still move, drafts not
    ],
)
def test_a_drafts_catch_up_takes_only_what_prompt_chunks_leave(unseen, waiting, room, plans):
    budget = None if room is None else (lambda contexts, start, target: room)
    draft = CountingDraft(unseen)
    scheduler = Scheduler(
        SchedulerConfig(prefill_chunk=32, idle_prefill_chunk=32),
        KVManager(BlockPool(512, 16)),
        prefill_budget=budget,
        draft_unseen=draft.unseen,
        itl_targets=None if room is None else {"standard": 0.1},
    )
    req = decoding(scheduler, 1)
    if waiting:
        scheduler.add(Request("p", prompt(waiting), greedy(1)))
    plan = scheduler.schedule()
    if plan.drafts:  # as the engine runs the draft model between the plan and the forward
        scheduler.verify(plan, draft.propose(plan.drafts))
    chunks = plan.chunks
    assert draft.plans == ([plans] if plans else [])
    [chunk] = [c for c in chunks if c.request is req]
    assert len(chunk.draft) == sum(k for _, k in plans)


def test_a_draft_with_another_tokenizer_is_refused_by_name(checkpoint):
    path = checkpoint("llama")
    target, draft = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(path)
    check_same_tokenizer(target, draft)
    draft.eos_token_ids = {0}
    with pytest.raises(ValueError, match="end-of-sequence ids"):
        check_same_tokenizer(target, draft)
    wider = checkpoint("llama", vocab_size=520)
    with pytest.raises(ValueError, match="vocabulary has 520 rows, the target's 512"):
        engine_of(path, speculate="draft", draft_model=str(wider))


def test_draft_flags_parse_and_go_together():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--speculate", "draft", "--draft-model", "/m/small"])
    config = engine_config(args)
    assert (config.speculate, config.draft_model) == ("draft", "/m/small")
    with pytest.raises(ValueError, match="go together"):
        engine_config(parser.parse_args(["serve", "--speculate", "draft"]))
