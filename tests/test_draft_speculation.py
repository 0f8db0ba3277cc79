"""Speculative decoding with a draft model (engine/draft.py): the same greedy tokens, and the
same seeded samples, as without it, with prompt chunks and other decodes in the same steps;
the target as its own draft has all its proposals accepted; cancellation frees both pools'
blocks; a draft with another tokenizer is refused by name."""

from __future__ import annotations

import argparse

import pytest
from test_speculation import Run, cancel_once_it_verifies, check_speculation_ran, greedy, prompt

from gapless.engine.draft import check_same_tokenizer
from gapless.engine.engine import Engine, EngineConfig
from gapless.engine.sampling_params import SamplingParams
from gapless.model.tokenizer import Tokenizer
from gapless.server.cli import add_serve_parser, engine_config

# Small chunks: the longer prompts prefill over several steps while the shorter ones decode
# and verify the draft's proposals.
CHUNKED = {"prefill_chunk": 16, "idle_prefill_chunk": 16, "enable_prefix_cache": False}
PROMPTS = [(12, 1), (40, 2), (72, 3)]


def engine_of(path, **options) -> Engine:
    return Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **CHUNKED, **options))


def tokens_of(engine: Engine, params: SamplingParams) -> list[list[int]]:
    run = Run(engine)
    rids = [run.add(prompt(n, seed), params) for n, seed in PROMPTS]
    run.until_idle()
    assert run.mixed_steps > 0 or engine.draft is None
    assert engine.draft is None or engine.draft.pool.num_used == 0
    return [run.tokens[r] for r in rids]


@pytest.mark.parametrize("draft_arch", ["llama", "qwen2"])
def test_greedy_tokens_are_the_same_with_a_draft(checkpoint, draft_arch):
    target = checkpoint("llama")
    want = tokens_of(engine_of(target, speculate="none"), greedy(32))
    engine = engine_of(target, speculate="draft", draft_model=str(checkpoint(draft_arch, seed=1)))
    assert tokens_of(engine, greedy(32)) == want
    assert engine.metrics.speculative_proposed_tokens > 0


def test_the_target_as_its_own_draft_has_its_proposals_accepted(checkpoint):
    target = checkpoint("llama")
    want = tokens_of(engine_of(target, speculate="none"), greedy(32))
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    assert tokens_of(engine, greedy(32)) == want
    metrics = engine.metrics
    assert metrics.speculative_proposed_tokens >= 20
    # Only float rounding between a batched verification row and a lone draft row could
    # make the two argmaxes differ.
    assert metrics.speculative_accepted_tokens >= 0.95 * metrics.speculative_proposed_tokens


def test_seeded_samples_are_the_same_with_a_draft(checkpoint):
    target = checkpoint("llama")
    # A low temperature, so that the random model's draws often are its argmax: the draft's
    # proposals are then both accepted and rejected.
    params = SamplingParams(max_tokens=24, temperature=0.05, seed=7, ignore_eos=True)
    want = tokens_of(engine_of(target, speculate="none"), params)
    engine = engine_of(target, speculate="draft", draft_model=str(target))
    assert tokens_of(engine, params) == want
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
    assert engine.pool.num_used == len(req_b.block_table)
    draft_blocks = engine.draft._tables.get(req_b, [])
    assert engine.draft.pool.num_used == len(draft_blocks)
    run.until_idle()
    assert engine.draft.pool.num_used == 0
    assert run.tokens[b] == plain.tokens[b_plain]


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
