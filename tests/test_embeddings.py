"""Embeddings: the engine pools the final hidden states (after the final norm) of prompts that
prefill in chunks beside running decodes, as transformers computes them; the OpenAI and Ollama
endpoints serve them to the real clients; `--task embed` serves nothing else."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import torch
from helpers import greedy, prompt
from server_fixture import MODEL, RunningServer, running_server
from test_engine import finished, run, tokens
from test_model import hf_model

from gapless import LLM, Engine, EngineConfig
from gapless.engine.admission import RequestError
from gapless.engine.events import FinishedEvent, ProgressEvent, TokenEvent
from gapless.server.settings import ServerSettings

CONTEXT = 64  # the server's: inputs beyond it are cheap to send
CHUNK = 8


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


# Float32 throughout, the KV cache too (auto stores it in float16 on most CPUs): the vectors
# are compared with transformers' float32 ones.
EXACT = {"dtype": "float32", "kv_cache_dtype": "float32"}


def engine(path: Path, **fields: Any) -> Engine:
    return Engine.from_pretrained(path, EngineConfig.of(**EXACT, **fields))


def embed_alone(e: Engine, ids: list[int], pooling: str | None = None) -> FinishedEvent:
    rid = e.add_embedding([ids], pooling=pooling)
    return finished(run(e)[rid])


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_pooled_hidden_states_across_chunks(llama_dir, hf, pooling):
    # 40 tokens in chunks of 8: mean pooling adds up five chunks' sums.
    llm = LLM(llama_dir, **EXACT, prefill_chunk=CHUNK, idle_prefill_chunk=CHUNK)
    texts = ["def fibonacci(n):", "import os\nprint(os.getcwd())"]
    ids = [prompt(40, 3), *(llm.tokenizer.encode(t) for t in texts)]
    want = [reference(hf, p, pooling) for p in ids]

    got = llm.embed([ids[0], *texts], pooling=pooling)
    assert all(close(v, w) for v, w in zip(got, want, strict=True))
    assert all(abs(torch.tensor(v).norm().item() - 1) < 1e-5 for v in got)
    assert llm.engine.kv.pool.num_used == 0

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
    assert e.kv.pool.num_used == 0


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
    assert e.kv.pool.num_used == 0


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
    assert e.kv.pool.num_used == 0


def test_cancelling_an_embedding_mid_prefill_frees_its_blocks(llama_dir):
    e = engine(llama_dir, prefill_chunk=16, idle_prefill_chunk=16)
    rid = e.add_embedding([prompt(100, 9), prompt(90, 10)])
    e.step()
    assert e.kv.pool.num_used > 0
    e.cancel(rid)
    ends = [x for x in run(e)[rid] if isinstance(x, FinishedEvent)]
    assert [x.finish_reason for x in ends] == ["cancelled", "cancelled"]
    assert all(x.embedding is None for x in ends)
    assert e.kv.pool.num_used == 0


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
    assert e.kv.pool.num_used == 0


def test_two_tensor_parallel_ranks_embed_as_one(llama_dir, hf):
    ids = prompt(40, 3)
    with LLM(llama_dir, **EXACT, prefill_chunk=CHUNK, tensor_parallel_size=2) as llm:
        for pooling in ("last", "mean"):
            [vector] = llm.embed([ids], pooling=pooling)
            assert close(vector, reference(hf, ids, pooling), 1e-4)


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(
        llama_dir, max_model_len=CONTEXT, prefill_chunk=CHUNK, idle_prefill_chunk=CHUNK, **EXACT
    ) as running:
        yield running


TEXTS = ["def fibonacci(n):", "import os\nprint(os.getcwd())"]


def test_openai_client_gets_float_and_base64_embeddings(oai, server, hf):
    ids = [server.engine.tokenizer.encode(t) for t in TEXTS]
    want = [reference(hf, p, "last") for p in ids]
    floats = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it.
    packed = oai.embeddings.create(model=MODEL, input=TEXTS, user="ignored")
    for r in (floats, packed):
        assert (r.object, r.model) == ("list", MODEL)
        assert [(d.object, d.index) for d in r.data] == [("embedding", 0), ("embedding", 1)]
        assert all(close(d.embedding, w) for d, w in zip(r.data, want, strict=True))
        total = sum(map(len, ids))
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (total, total)

    # Token ids, one list or several; the model's own width as `dimensions`.
    one = oai.embeddings.create(model=MODEL, input=ids[1], dimensions=64, encoding_format="float")
    assert close(one.data[0].embedding, want[1])
    both = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert all(close(d.embedding, w) for d, w in zip(both.data, want, strict=True))
    server.wait_for_metric("gapless_kv_blocks_used", 0)


def test_base64_is_little_endian_float32(client: httpx.Client) -> None:
    body = {"input": TEXTS[0]}
    floats = client.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    raw = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == floats
    assert len(floats) == 64


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({}, "input", None),
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": 5}, "input", None),
        ({"input": {"text": "x"}}, "input", None),
        ({"input": ["a", ""]}, "input[1]", None),
        ({"input": [[5, 6], []]}, "input[1]", None),
        ({"input": ["a", 3]}, "input[1]", None),
        ({"input": ["a", [5, "b"]]}, "input[1]", None),
        ({"input": [5, 99999]}, "input", None),
        ({"input": [5] * (CONTEXT + 1)}, "input", "context_length_exceeded"),
        ({"input": ["a", [5] * (CONTEXT + 1)]}, "input[1]", "context_length_exceeded"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "dimensions": 32}, "dimensions", None),
        ({"input": "x", "dimensions": "64"}, "dimensions", None),
        ({"input": "x", "model": 7}, "model", None),
    ],
)
def test_bad_openai_requests_are_400s_naming_the_field(client, server, body, param, code):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]
    assert client.post("/v1/embeddings", json={"input": "x", "model": "gpt"}).status_code == 404
    assert server.engine.kv.pool.num_used == 0


def test_a_full_context_input_embeds_and_a_batch_too(oai, server):
    r = oai.embeddings.create(model=MODEL, input=[prompt(CONTEXT, 1)] * 3 + ["x"])
    x = len(server.engine.tokenizer.encode("x"))
    assert len(r.data) == 4 and r.usage.prompt_tokens == 3 * CONTEXT + x
    assert close(r.data[0].embedding, torch.tensor(r.data[2].embedding))
    server.wait_for_metric("gapless_kv_blocks_used", 0)


def test_ollama_client_embed_and_embeddings(llama, server, hf):
    tokenizer = server.engine.tokenizer
    want = [reference(hf, tokenizer.encode(t), "last") for t in TEXTS]
    one = llama.embed(model=MODEL, input=TEXTS[0], keep_alive="5m", options={"num_ctx": 8})
    assert one.model == MODEL
    assert len(one.embeddings) == 1 and close(one.embeddings[0], want[0])
    assert one.prompt_eval_count == len(tokenizer.encode(TEXTS[0]))
    assert one.total_duration > 0 and one.load_duration == 0
    both = llama.embed(model=f"{MODEL}:latest", input=TEXTS, dimensions=64)
    assert both.model == f"{MODEL}:latest"
    assert all(close(v, w) for v, w in zip(both.embeddings, want, strict=True))
    legacy = llama.embeddings(model=MODEL, prompt=TEXTS[1])
    assert close(legacy.embedding, want[1])
    server.wait_for_metric("gapless_kv_blocks_used", 0)


def test_ollama_truncates_a_long_input_unless_told_not_to(llama, server, hf):
    text = "the quick brown fox jumps over the lazy dog " * 40
    ids = server.engine.tokenizer.encode(text)
    assert len(ids) > CONTEXT
    r = llama.embed(model=MODEL, input=["x", text])  # truncate is true by default
    assert r.prompt_eval_count == len(server.engine.tokenizer.encode("x")) + CONTEXT
    assert close(r.embeddings[1], reference(hf, ids[:CONTEXT], "last"))
    with pytest.raises(ollama.ResponseError) as caught:
        llama.embed(model=MODEL, input=["x", text], truncate=False)
    assert caught.value.status_code == 400
    assert caught.value.error.startswith("input[1]: the prompt has")
    with pytest.raises(ollama.ResponseError) as caught:
        llama.embeddings(model=MODEL, prompt=text)  # the older endpoint never truncates
    assert caught.value.status_code == 400 and "context is 64 tokens" in caught.value.error
    server.wait_for_metric("gapless_kv_blocks_used", 0)


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/api/embed", {}, "input must be"),
        ("/api/embed", {"input": ""}, "input: the prompt is empty"),
        ("/api/embed", {"input": []}, "input is empty"),
        ("/api/embed", {"input": [[5, 6]]}, "input[0]: must be a string"),
        ("/api/embed", {"input": ["a", ""]}, "input[1]: the prompt is empty"),
        ("/api/embed", {"input": "x", "options": "x"}, "options must be an object"),
        ("/api/embed", {"input": "x", "truncate": "yes"}, "truncate must be a boolean"),
        ("/api/embed", {"input": "x", "dimensions": 3}, "dimensions must be 64"),
        ("/api/embeddings", {}, "prompt must be a string"),
        ("/api/embeddings", {"prompt": ["x"]}, "prompt must be a string"),
        ("/api/embeddings", {"prompt": ""}, "the prompt is empty"),
    ],
)
def test_bad_ollama_requests_are_400s(client, server, path, body, needle):
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    assert r.json()["error"].startswith(needle), r.json()
    assert client.post(path, json={"model": "llama3", "input": "x"}).status_code == 404
    assert server.engine.kv.pool.num_used == 0


def test_task_embed_serves_embeddings_only(llama_dir, hf):
    settings = ServerSettings(MODEL, task="embed")
    with (
        running_server(llama_dir, settings, pooling="mean", **EXACT) as running,
        running.client() as c,
    ):
        ids = running.engine.tokenizer.encode(TEXTS[0])
        r = c.post("/v1/embeddings", json={"input": TEXTS[0]})
        assert close(r.json()["data"][0]["embedding"], reference(hf, ids, "mean"))
        r = c.post("/api/embed", json={"input": TEXTS[0]})
        assert close(r.json()["embeddings"][0], reference(hf, ids, "mean"))
        assert c.post("/api/show", json={}).json()["capabilities"] == ["embedding"]

        ask = [{"role": "user", "content": "hi"}]
        refused = [
            ("/v1/chat/completions", {"messages": ask}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/responses", {"input": "hi"}),
            ("/v1/messages", {"messages": ask, "max_tokens": 4}),
            ("/api/chat", {"messages": ask}),
            ("/api/generate", {"prompt": "hi"}),
        ]
        for path, body in refused:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            error = r.json()
            if path.startswith("/api/"):
                message = error["error"]
            elif path == "/v1/messages":
                assert error["type"] == "error"
                message = error["error"]["message"]
            else:
                assert error["error"]["code"] == "embeddings_only"
                message = error["error"]["message"]
            assert "serves embeddings only (--task embed)" in message, (path, message)
