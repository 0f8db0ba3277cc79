"""The measurement scripts' harness (bench/harness.py) runs a prompt as the runner computes it,
however its steps are cut, reruns a step at the same context, and frees its blocks."""

from __future__ import annotations

import pytest
import torch
from test_model import Seq, prompt, run_chunks

from gapless.bench.harness import Harness
from gapless.engine.runner import ModelRunner
from gapless.model.loader import load_decoder


@pytest.fixture(scope="module")
def runner(llama_dir) -> ModelRunner:
    return ModelRunner(load_decoder(llama_dir, "float32"), 16, 16)


def test_two_chunks_and_a_decode_give_the_one_chunk_prefills_logits(runner):
    ids = prompt(40)
    want = run_chunks(runner, Seq(ids, 8), [len(ids)])
    harness = Harness(runner)
    request = harness.request(ids)
    first, second = (harness.step([(request, n)], all_logits=True)[0] for n in (21, 18))
    decode = harness.step([(request, 1)])[0]
    assert request.num_computed == len(ids)
    got = torch.cat([first, second, decode])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_an_unbooked_step_runs_again_at_the_same_context(runner):
    ids = prompt(30, seed=1)
    want = run_chunks(runner, Seq(ids, 8), [len(ids)])[-1]
    harness = Harness(runner)
    request = harness.request(ids)
    harness.step([(request, len(ids) - 1)])
    again = [harness.step([(request, 1)], book=False)[0][-1] for _ in range(2)]
    assert request.num_computed == len(ids) - 1
    for logits in again:
        assert (logits - want).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="2 tokens after 29 of its 30"):
        harness.step([(request, 2)])


def test_released_blocks_serve_the_next_request(runner):
    harness = Harness(runner)
    whole = prompt(16 * runner.num_blocks, seed=2)  # every block of the runner
    for _ in range(2):
        request = harness.request(whole)
        harness.step([(request, len(whole))])
        assert harness.kv.pool.num_free == 0
        harness.release(request)
        assert harness.kv.pool.num_free == runner.num_blocks
        assert request.num_computed == 0
