"""Embeddings: the engine pools the final hidden states (after the final norm) of prompts that
prefill in chunks beside running decodes, as transformers computes them; the OpenAI and Ollama
endpoints serve them to the real clients; `--task embed` serves nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_engine import finished, greedy, prompt, run, tokens
from test_model import hf_model

from gapless import LLM, Engine, EngineConfig
from gapless.engine.admission import RequestError
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent

CONTEXT = 64  # the server's: inputs beyond it are cheap to send
CHUNK = 8


@pytest.fixture(scope="module")
def llama_dir(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> Any:
    return hf_model(llama_dir)


def reference(hf: Any, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' hidden states after the final norm, pooled and L2-normalized."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def close(vector: list[float], want: torch.Tensor, tol: float = 1e-5) -> bool:
    return (torch.tensor(vector) - want).abs().max().item() < tol


def engine(path: Path, **fields: Any) -> Engine:
    return Engine.from_pretrained(path, EngineConfig.of(dtype="float32", **fields))


def embed_alone(e: Engine, ids: list[int], pooling: str | None = None) -> FinishedEvent:
    rid = e.add_embedding([ids], pooling=pooling)
    return finished(run(e)[rid])


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_pooled_hidden_states_across_chunks(llama_dir, hf, pooling):
    # 40 tokens in chunks of 8: mean pooling adds up five chunks' sums.
    llm = LLM(llama_dir, dtype="float32", prefill_chunk=CHUNK, idle_prefill_chunk=CHUNK)
    texts = ["def fibonacci(n):", "import os\nprint(os.getcwd())"]
    ids = [prompt(40, 3), *(llm.tokenizer.encode(t) for t in texts)]
    want = [reference(hf, p, pooling) for p in ids]

    got = llm.embed([ids[0], *texts], pooling=pooling)
    assert all(close(v, w) for v, w in zip(got, want, strict=True))
    assert all(abs(torch.tensor(v).norm().item() - 1) < 1e-5 for v in got)
    assert llm.engine.pool.num_used == 0

    # The engine's pooling option is the default; progress comes per chunk.
    e = engine(llama_dir, prefill_chunk=CHUNK, idle_prefill_chunk=CHUNK, pooling=pooling)
    rid = e.add_embedding([ids[0]])
    events = run(e)[rid]
    assert [x.processed for x in events if isinstance(x, ProgressEvent)] == [8, 16, 24, 32, 40]
    end = finished(events)
    assert (end.finish_reason, end.prompt_tokens, end.completion_tokens) == ("stop", 40, 0)
    assert close(end.embedding, want[0])
    assert tokens(events) == []


def test_last_pooling_reads_the_prefix_cache_and_mean_pooling_does_not(llama_dir, hf):
    e = engine(llama_dir, prefill_chunk=16)
    ids = prompt(50, 4)
    for pooling, cached in (("last", 48), ("mean", 0)):
        first, again = (embed_alone(e, ids, pooling) for _ in range(2))
        # The second last-pooled request reuses the blocks the first left (all but the last
        # token); a mean needs every token's hidden state, so it recomputes all of them.
        assert (first.cached_prompt_tokens, again.cached_prompt_tokens) == (0, cached)
        want = reference(hf, ids, pooling)
        assert close(first.embedding, want) and close(again.embedding, want)
    assert e.pool.num_used == 0


def test_embedding_beside_four_decoding_streams_changes_none_of_their_tokens(llama_dir, hf):
    prompts = [prompt(5 + i, 10 + i) for i in range(4)]
    alone = engine(llama_dir, prefill_chunk=16)
    ids = [alone.add_request(p, greedy(30)) for p in prompts]
    reference_tokens = run(alone)
    want = [tokens(reference_tokens[i]) for i in ids]

    e = engine(llama_dir, prefill_chunk=16)
    streams = [e.add_request(p, greedy(30)) for p in prompts]
    log: dict[str, list] = {}

    def step() -> list:
        events = e.step()
        for event in events:
            log.setdefault(event.request_id, []).append(event)
        return events

    step()  # the four prompts prefill at once, and decode from here
    embedded = [prompt(120, 5), prompt(30, 6)]
    rid = e.add_embedding(embedded, pooling="mean")
    while sum(isinstance(x, FinishedEvent) for x in log.get(rid, [])) < 2:
        # Every stream gets its token in every step of the embeddings' prefill.
        assert {x.request_id for x in step() if isinstance(x, TokenEvent)} == set(streams)
    run(e, log)
    assert [tokens(log[s]) for s in streams] == want
    ends = sorted((x for x in log[rid] if isinstance(x, FinishedEvent)), key=lambda x: x.index)
    assert [x.index for x in ends] == [0, 1]
    for end, ids in zip(ends, embedded, strict=True):
        assert close(end.embedding, reference(hf, ids, "mean"))
    assert e.pool.num_used == 0


def test_a_preempted_mean_pooled_prompt_starts_its_sum_again(llama_dir, hf):
    # 6 blocks of 16. A decode from 47 tokens takes its 4th block at token 48, and the
    # embedding its 2 first: when the decode needs a 5th (token 64), the embedding, admitted
    # last, is preempted, and recomputed later from its first token.
    e = engine(llama_dir, kv_cache_tokens=96, prefill_chunk=16)
    stream = e.add_request(prompt(47, 7), greedy(40))
    e.step()
    ids = prompt(48, 8)
    rid = e.add_embedding([ids], pooling="mean")
    log = run(e)
    assert finished(log[rid]).preempted >= 1
    assert close(finished(log[rid]).embedding, reference(hf, ids, "mean"))
    assert len(tokens(log[stream])) == 40 - 1
    assert e.pool.num_used == 0


def test_cancelling_an_embedding_mid_prefill_frees_its_blocks(llama_dir):
    e = engine(llama_dir, prefill_chunk=16, idle_prefill_chunk=16)
    rid = e.add_embedding([prompt(100, 9), prompt(90, 10)])
    e.step()
    assert e.pool.num_used > 0
    e.cancel(rid)
    ends = [x for x in run(e)[rid] if isinstance(x, FinishedEvent)]
    assert [x.finish_reason for x in ends] == ["cancelled", "cancelled"]
    assert all(x.embedding is None for x in ends)
    assert e.pool.num_used == 0


def test_an_embedding_prompt_may_fill_the_context_but_not_more(llama_dir):
    e = engine(llama_dir, max_model_len=CONTEXT)
    end = embed_alone(e, prompt(CONTEXT, 11))
    assert end.prompt_tokens == CONTEXT and end.embedding is not None
    with pytest.raises(RequestError, match="context is 64 tokens") as caught:
        e.add_embedding([prompt(CONTEXT + 1, 12)])
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="leave room for output"):
        e.add_request(prompt(CONTEXT, 11), greedy(1))
    # Truncated: the first tokens that fit, also of a text far too long to encode whole.
    admission = e.admission
    assert (
        admission.check_prompt(prompt(200, 13), output=False, truncate=True)
        == prompt(200, 13)[:CONTEXT]
    )
    text = "the quick brown fox " * 100_000
    ids = admission.check_prompt(text, output=False, truncate=True)
    assert ids == e.tokenizer.encode("the quick brown fox " * 100)[:CONTEXT]
    with pytest.raises(RequestError, match="pooling"):
        e.add_embedding(["x"], pooling="max")
    assert e.pool.num_used == 0
