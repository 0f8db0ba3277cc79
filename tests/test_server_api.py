"""The OpenAI-compatible API against a real server on a loopback port, with real clients."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers import gate_forwards
from server_fixture import MODEL, RunningServer, SSEReader, running_server, stream

from gapless.server.app import max_json_values
from gapless.server.settings import ServerSettings
from gapless.server.streaming import ndjson, sse

CHUNK = 16
MAX_MODEL_LEN = 2048
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    # Small prefill chunks, also when idle, so every prompt prefills over several steps.
    settings = ServerSettings(MODEL, max_body_mb=BODY_LIMIT / 2**20)
    with running_server(
        llama_dir,
        settings,
        prefill_chunk=CHUNK,
        idle_prefill_chunk=CHUNK,
        kv_cache_tokens=40_000,
        kv_cache_dtype="float32",  # prompt logprobs are compared with transformers' float32
        max_num_seqs=32,
    ) as running:
        yield running


def long_prompt_ids(server: RunningServer, n: int, salt: str) -> list[int]:
    """n ordinary prompt ids; a distinct salt keeps prompts from sharing cached prefixes."""
    ids = server.engine.tokenizer.encode(f"{salt}: " + "the quick brown fox jumps over " * n)
    return ids[:n]


# -- the openai client ----------------------------------------------------------------------


def test_chat_non_streaming(oai: openai.OpenAI, server: RunningServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=7, extra_body={"ignore_eos": True}
    )
    expected_prompt = server.engine.tokenizer.encode_chat(messages)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == len(expected_prompt) + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_completion_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [c for c in chunks[1:] if c.choices and c.choices[0].finish_reason is None]
    assert len(tokens) == 9  # one chunk per token
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])

    # Greedy decoding is deterministic: the same request without streaming says the same.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_completion_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == text


def test_completions_both_ways(oai: openai.OpenAI, server: RunningServer) -> None:
    prompt = "def fibonacci(n):"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    r = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 5)
    assert r.choices[0].finish_reason == "length"

    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=[prompt],  # a batch of one prompt is that prompt
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == 5


def test_unknown_fields_ignored_and_prefix_cache_in_usage(
    client: httpx.Client, server: RunningServer
) -> None:
    ids = long_prompt_ids(server, 100, "cache")
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": 2,
        "ignore_eos": True,
        # Extras OpenAI clients send, and nonsense: all ignored.
        "user": "someone",
        "response_format": {"type": "text"},
        "no_such_field": [1, 2, 3],
    }
    first = client.post(COMPLETIONS, json=body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = client.post(COMPLETIONS, json=body).json()
    # Whole blocks of the first prompt are reused, the last token is always recomputed.
    block = server.engine.kv.pool.block_size
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (100 - 1) // block * block


def test_token_id_prompt_and_seed(client: httpx.Client, server: RunningServer) -> None:
    ids = long_prompt_ids(server, 20, "seed")
    body = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a = client.post("/v1/completions", json={**body, "prompt": ids}).json()
    b = client.post("/v1/completions", json={**body, "prompt": [ids]}).json()
    assert a["usage"]["prompt_tokens"] == 20
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # same seed, same sample


def test_stop_string_and_max_tokens_default(client: httpx.Client, server: RunningServer) -> None:
    # Greedy text first, then stop at a string inside it: the stop string is not returned.
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 12, "temperature": 0}
    text = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    full = text["choices"][0]["text"]
    stop = full[4:6]
    assert stop
    cut = client.post("/v1/completions", json={**body, "ignore_eos": True, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full[: full.index(stop)]

    # stop_token_ids and min_tokens reach the engine: with every token a stop token, the
    # request stops as soon as min_tokens allows.
    every = list(range(server.engine.tokenizer.vocab_size))
    r = client.post(
        "/v1/completions", json={**body, "stop_token_ids": every, "min_tokens": 3}
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 3

    # Without max_tokens the whole remaining context is allowed: with eos ignored, the
    # context ends it.
    ids = long_prompt_ids(server, MAX_MODEL_LEN - 3, "default")
    r = client.post("/v1/completions", json={"prompt": ids, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert (r["usage"]["completion_tokens"], r["usage"]["total_tokens"]) == (3, MAX_MODEL_LEN)


def test_chat_logprobs(client: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        if entry["token"] != "\ufffd":  # a piece of a character has its raw bytes instead
            assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)
    s = stream(client, "/v1/chat/completions", body)
    streamed = [e for c in s.token_chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_models_and_health(client: httpx.Client, oai: openai.OpenAI) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    [model] = oai.models.list().data
    assert model.id == MODEL
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other-model")


# -- streaming details ----------------------------------------------------------------------


def test_prefill_progress_comments(client: httpx.Client, server: RunningServer) -> None:
    ids = long_prompt_ids(server, 150, "progress")
    body = {"prompt": ids, "max_tokens": 3, "ignore_eos": True}
    s = stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    processed = [p for p, _ in s.progress]
    assert len(processed) == -(-150 // CHUNK)  # one comment per prefill chunk
    assert {t for _, t in s.progress} == {150}
    assert processed == sorted(processed) and len(set(processed)) == len(processed)
    assert all(b - a <= CHUNK for a, b in zip([0, *processed], processed, strict=False))
    assert processed[-1] == 150
    assert s.done
    assert len(s.token_chunks) == 3
    assert s.usage["prompt_tokens"] == 150


def test_sixteen_concurrent_streams(server: RunningServer) -> None:
    max_tokens = 24

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str, int]:
        chunks = [
            c
            async for c in await client.completions.create(
                model=MODEL,
                prompt=f"request number {i}: " + "word " * (i * 3),
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        ]
        tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return chunks[0].id, len(tokens), finish, chunks[-1].usage.completion_tokens

    async def main() -> list[tuple[str, int, str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert len({r[0] for r in results}) == 16
    assert all(r[1:] == (max_tokens, "length", max_tokens) for r in results), results


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_disconnect_cancels_and_frees_kv(
    server: RunningServer, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = server.metrics()
    cancelled_before = _finished(server, "cancelled")
    gate = threading.Semaphore(1)
    if phase == "prefill":
        # One forward pass, then the engine waits: the disconnect surely lands mid-prefill,
        # however slow this machine is.
        gate = gate_forwards(server.engine, monkeypatch)
    ids = long_prompt_ids(server, 1500, phase)  # ~100 prefill steps of CHUNK tokens
    body = {"prompt": ids, "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        with server.client() as client, client.stream("POST", COMPLETIONS, json=body) as r:
            reader = SSEReader(r)
            if phase == "prefill":
                reader.read_until("progress")
                live = server.metrics()
                assert reader.sse.progress == [(CHUNK, 1500)]
                assert live["gapless_requests_prefilling"] == 1
            else:
                reader.read_until("data")
                reader.read_until("data")
                live = server.metrics()
                assert live["gapless_requests_prefilling"] == 0
                assert live["gapless_requests_running"] == 1
            assert live["gapless_kv_blocks_used"] > before["gapless_kv_blocks_used"]
    finally:
        monkeypatch.undo()
        gate.release()  # the engine may be waiting at the gate
    # The client is gone: the request must end as cancelled and give back its KV blocks.
    server.wait_for_metric("gapless_requests_running", 0)
    server.wait_for_metric("gapless_kv_blocks_used", before["gapless_kv_blocks_used"])
    assert _finished(server, "cancelled") == cancelled_before + 1


def _finished(server: RunningServer, reason: str) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'gapless_requests_finished_total{{finish_reason="{reason}"}} '
    return next(
        (int(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0
    )


@pytest.mark.parametrize("prefixed", [True, False])
def test_cancel_endpoint(client: httpx.Client, server: RunningServer, prefixed: bool) -> None:
    body = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        reader = SSEReader(r)
        reader.read_until("data")
        response_id = reader.sse.data[0]["id"]
        assert response_id.startswith("cmpl-")
        target = response_id if prefixed else response_id.removeprefix("cmpl-")
        with server.client() as other:
            ok = other.post(f"/v1/cancel/{target}", json={})
            assert ok.status_code == 200
            assert ok.json()["cancelled"] is True
        sse = reader.read_all()
    assert sse.finish_reason == "cancelled"
    assert sse.done
    assert len(sse.token_chunks) < 1500
    gone = client.post(f"/v1/cancel/{target}", json={})
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "not_found_error"


def test_max_tokens_zero_and_echo_stream(client: httpx.Client) -> None:
    s = stream(client, "/v1/completions", {"prompt": "echo me", "max_tokens": 0, "echo": True})
    assert s.data[0]["choices"][0]["text"] == "echo me"
    assert s.token_chunks == s.data[:1]
    assert s.finish_reason == "length"


# -- prompt logprobs: what evaluation harnesses request -------------------------------------


def test_echo_prompt_logprobs_match_transformers(
    client: httpx.Client, server: RunningServer, llama_dir: Path
) -> None:
    import transformers

    text = "The capital of France is Paris. " * 6
    ids = server.engine.tokenizer.encode(text)
    assert len(ids) > 3 * CHUNK  # prompt logprobs across several prefill chunks
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(lp["token_logprobs"][1:])
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
    best = logits.log_softmax(-1)[:-1].max(-1).values
    tops = torch.tensor([next(iter(t.values())) for t in lp["top_logprobs"][1:]])
    assert torch.allclose(tops, best, atol=1e-4, rtol=0)


# -- errors ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]
JSON_TYPE = {"content-type": "application/json"}

# (name, path, body: dict or raw bytes, status, type, param, code, text in the message)
BAD_REQUESTS: list[tuple[str, str, Any, int, str, str | None, str | None, str | None]] = [
    ("malformed json", CHAT, b'{"messages": [', 400, "invalid_request_error", None, None, "JSON"),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "invalid_request_error", None, None, "UTF-8"),
    ("not an object", CHAT, b"[1, 2]", 400, "invalid_request_error", None, None, None),
    ("body too large", COMPLETIONS, {"prompt": "x" * BODY_LIMIT}, 413, "invalid_request_error", None, "request_too_large", None),
    ("too many JSON values", COMPLETIONS, {"prompt": "a", "stop": ["s"] * (max_json_values(MAX_MODEL_LEN) + 1)}, 413, "invalid_request_error", None, "request_too_large", str(max_json_values(MAX_MODEL_LEN))),
    ("missing messages", CHAT, {"model": MODEL}, 400, "invalid_request_error", "messages", None, None),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "invalid_request_error", "messages", None, None),
    ("empty messages", CHAT, {"messages": []}, 400, "invalid_request_error", "messages", None, None),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_request_error", "messages[0].role", None, "wizard"),
    ("missing role", CHAT, {"messages": [{"content": "hi"}]}, 400, "invalid_request_error", "messages[0].role", None, None),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "invalid_request_error", "messages[0].content", None, None),
    ("template rejects role", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error", "messages", None, "tool"),
    ("max_tokens negative", CHAT, {"messages": HELLO, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens", None, None),
    ("max_tokens huge", COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 10**6}, 400, "invalid_request_error", "max_tokens", "context_length_exceeded", str(MAX_MODEL_LEN - 3)),
    ("max_completion_tokens huge", CHAT, {"messages": HELLO, "max_completion_tokens": 10**6}, 400, "invalid_request_error", "max_completion_tokens", "context_length_exceeded", str(MAX_MODEL_LEN)),
    ("max_tokens not int", CHAT, {"messages": HELLO, "max_tokens": "ten"}, 400, "invalid_request_error", "max_tokens", None, None),
    ("max_tokens bool", COMPLETIONS, {"prompt": "a", "max_tokens": True}, 400, "invalid_request_error", "max_tokens", None, None),
    ("temperature negative", CHAT, {"messages": HELLO, "temperature": -0.5}, 400, "invalid_request_error", "temperature", None, None),
    ("top_p zero", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "invalid_request_error", "top_p", None, None),
    ("top_p above one", CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "invalid_request_error", "top_p", None, None),
    ("presence_penalty", CHAT, {"messages": HELLO, "presence_penalty": 3}, 400, "invalid_request_error", "presence_penalty", None, None),
    ("prompt too long", COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, "invalid_request_error", "prompt", "context_length_exceeded", str(MAX_MODEL_LEN + 10)),
    ("messages too long", CHAT, {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "invalid_request_error", "messages", "context_length_exceeded", str(MAX_MODEL_LEN)),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": HELLO}, 404, "not_found_error", "model", "model_not_found", "gpt-9"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "invalid_request_error", "prompt", None, "empty"),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, "invalid_request_error", "prompt", None, None),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "invalid_request_error", "prompt", None, None),
    ("batched prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "invalid_request_error", "prompt", None, "batched"),
    ("token id out of vocab", COMPLETIONS, {"prompt": [1, 10**7]}, 400, "invalid_request_error", "prompt", None, None),
    ("n too large", CHAT, {"messages": HELLO, "n": 17}, 400, "invalid_request_error", "n", None, "[1, 16]"),
    ("n zero", COMPLETIONS, {"prompt": "a", "n": 0}, 400, "invalid_request_error", "n", None, "[1, 16]"),
    ("n wrong type", CHAT, {"messages": HELLO, "n": "3"}, 400, "invalid_request_error", "n", None, None),
    # Structured output: a schema or regex that cannot compile is refused before admission.
    ("response_format unknown type", CHAT, {"messages": HELLO, "response_format": {"type": "yaml"}}, 400, "invalid_request_error", "response_format", None, "json_schema"),
    ("json_schema without name", CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "invalid_request_error", "response_format.json_schema.name", None, None),
    ("json_schema invalid schema", COMPLETIONS, {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectz"}}}}, 400, "invalid_request_error", "response_format.json_schema.schema", None, "objectz"),
    ("json_schema schema not object", CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400, "invalid_request_error", "response_format.json_schema.schema", None, None),
    ("guided_regex invalid", COMPLETIONS, {"prompt": "a", "guided_regex": "a(b"}, 400, "invalid_request_error", "guided_regex", None, "unclosed"),
    ("guided_choice empty", COMPLETIONS, {"prompt": "a", "guided_choice": []}, 400, "invalid_request_error", "guided_choice", None, None),
    ("two output formats", CHAT, {"messages": HELLO, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "invalid_request_error", "guided_regex", None, None),
    ("structured_outputs two kinds", COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "invalid_request_error", "structured_outputs", None, None),
    # Tools: wrong shapes name the field.
    ("tools not a list", CHAT, {"messages": HELLO, "tools": {"type": "function"}}, 400, "invalid_request_error", "tools", None, None),
    ("tool without function", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, 400, "invalid_request_error", "tools[0].function", None, None),
    ("tool bad name", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "invalid_request_error", "tools[0].function.name", None, None),
    ("tool parameters not object", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, 400, "invalid_request_error", "tools[0].function.parameters", None, None),
    ("tool_choice unknown function", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_request_error", "tool_choice", None, "'g'"),
    ("tool_choice without tools", CHAT, {"messages": HELLO, "tool_choice": "required"}, 400, "invalid_request_error", "tool_choice", None, None),
    ("tool_choice bad string", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, 400, "invalid_request_error", "tool_choice", None, None),
    ("forced tool invalid schema", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectz"}}}], "tool_choice": "required"}, 400, "invalid_request_error", "tools", None, "objectz"),
    ("auto tools, template shows no format", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_request_error", "tools", None, "--tool-call-parser"),
    ("parallel_tool_calls wrong type", CHAT, {"messages": HELLO, "parallel_tool_calls": "yes"}, 400, "invalid_request_error", "parallel_tool_calls", None, None),
    ("stop wrong type", COMPLETIONS, {"prompt": "a", "stop": 5}, 400, "invalid_request_error", "stop", None, None),
    ("top_logprobs range", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 50}, 400, "invalid_request_error", "top_logprobs", None, None),
    ("completion logprobs range", COMPLETIONS, {"prompt": "a", "logprobs": 99}, 400, "invalid_request_error", "logprobs", None, None),
    ("seed wrong type", COMPLETIONS, {"prompt": "a", "seed": "lucky"}, 400, "invalid_request_error", "seed", None, None),
    ("stream_options wrong type", CHAT, {"messages": HELLO, "stream": True, "stream_options": 1}, 400, "invalid_request_error", "stream_options", None, None),
    ("service_class unknown", COMPLETIONS, {"prompt": "a", "service_class": "urgent"}, 400, "invalid_request_error", "service_class", None, "interactive, standard, batch"),
    ("service_tier unknown", CHAT, {"messages": HELLO, "service_tier": "scale"}, 400, "invalid_request_error", "service_tier", None, "'scale'"),
    ("priority wrong type", CHAT, {"messages": HELLO, "priority": "high"}, 400, "invalid_request_error", "priority", None, None),
    ("unknown route", "/v1/audio/speech", {"input": "x"}, 404, "not_found_error", None, None, None),
    # Fields a client controls are bounded at admission, never in the batched step.
    ("top_k past int64", COMPLETIONS, {"prompt": "a", "top_k": 10**20}, 400, "invalid_request_error", "top_k", None, "vocabulary"),
    ("top_k 2**63 chat", CHAT, {"messages": HELLO, "top_k": 2**63}, 400, "invalid_request_error", "top_k", None, "vocabulary"),
    ("top_k past vocab", COMPLETIONS, {"prompt": "a", "top_k": 513}, 400, "invalid_request_error", "top_k", None, "512"),
    ("seed past 64 bits", COMPLETIONS, {"prompt": "a", "seed": 2**64}, 400, "invalid_request_error", "seed", None, "64-bit"),
    ("too many stop strings", COMPLETIONS, {"prompt": "a", "stop": [f"s{i}" for i in range(1000)]}, 400, "invalid_request_error", "stop", None, "at most 32"),
    ("stop string too long", CHAT, {"messages": HELLO, "stop": ["x" * 257]}, 400, "invalid_request_error", "stop", None, "256"),
    ("stop_token_ids outside vocab", COMPLETIONS, {"prompt": "a", "stop_token_ids": [7, 10**30]}, 400, "invalid_request_error", "stop_token_ids", None, None),
    ("too many stop_token_ids", COMPLETIONS, {"prompt": "a", "stop_token_ids": [5] * 1025}, 400, "invalid_request_error", "stop_token_ids", None, "1024"),
    ("lone surrogate prompt", COMPLETIONS, b'{"prompt": "def f(\\ud800):"}', 400, "invalid_request_error", "prompt", None, "surrogate"),
    ("lone surrogate chat", CHAT, b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}', 400, "invalid_request_error", "messages[0].content", None, "surrogate"),
    ("template kwargs set messages", CHAT, {"messages": HELLO, "chat_template_kwargs": {"messages": []}}, 400, "invalid_request_error", "chat_template_kwargs", None, None),
    # Refused by its length in characters, before any tokenizing.
    ("huge text prompt", COMPLETIONS, {"prompt": "x = 1; " * 30000}, 400, "invalid_request_error", "prompt", "context_length_exceeded", "210000 characters"),
    ("huge chat message", CHAT, {"messages": [{"role": "user", "content": "y" * 200000}]}, 400, "invalid_request_error", "messages", "context_length_exceeded", "characters"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,status,err_type,param,code,needle",
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests(
    client: httpx.Client,
    path: str,
    body: Any,
    status: int,
    err_type: str,
    param: str | None,
    code: str | None,
    needle: str | None,
) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (err_type, param, code)
    assert error["message"]
    if needle is not None:
        assert needle in error["message"]


def test_wrong_method_is_405(client: httpx.Client) -> None:
    r = client.get(CHAT)
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_server_survives_bad_requests(client: httpx.Client) -> None:
    for _ in range(3):
        assert client.post(CHAT, content=b"{", headers=JSON_TYPE).status_code == 400
    r = client.post(
        COMPLETIONS, json={"prompt": "still alive", "max_tokens": 2, "ignore_eos": True}
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("where", ["engine", "server"])
def test_failure_inside_one_request(
    client: httpx.Client, server: RunningServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    if where == "engine":

        def broken_forward(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected forward failure")

        monkeypatch.setattr(server.engine.runner, "execute", broken_forward)
        body: dict[str, Any] = {"prompt": "fail me", "max_tokens": 5, "ignore_eos": True}
    else:

        def broken_token_text(token_id: int) -> str:
            raise RuntimeError("injected rendering failure")

        monkeypatch.setattr(server.engine.tokenizer, "token_text", broken_token_text)
        body = {"prompt": "fail me", "max_tokens": 5, "logprobs": 1, "ignore_eos": True}

    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error"
    assert "injected" in error["message"]

    s = stream(client, COMPLETIONS, body)
    assert s.done
    [failure] = [c for c in s.data if "error" in c]
    assert s.data[-1] is failure  # the error chunk is last, then [DONE]
    assert failure["error"]["type"] == "server_error"
    assert "injected" in failure["error"]["message"]

    monkeypatch.undo()
    ok = client.post(COMPLETIONS, json={**body, "stream": False})
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 5


def test_metrics_exposition(client: httpx.Client, server: RunningServer) -> None:
    client.post(COMPLETIONS, json={"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "gapless_requests_running",
        "gapless_requests_waiting",
        "gapless_requests_prefilling",
        "gapless_kv_blocks_used",
        "gapless_kv_blocks_cached",
        "gapless_kv_blocks_total",
        "gapless_prefix_cache_hit_tokens_total",
        "gapless_generation_tokens_total",
    ):
        assert f"\n# TYPE {name} " in text, name
    for name in (
        "gapless_time_to_first_token_seconds",
        "gapless_inter_token_latency_seconds",
        "gapless_step_time_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{le="+Inf"}}' in text
    for name in (
        "gapless_class_time_to_first_token_seconds",
        "gapless_class_inter_token_latency_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
        for service_class in ("interactive", "standard", "batch"):
            assert f'{name}_bucket{{class="{service_class}",le="+Inf"}}' in text
            assert f'{name}_count{{class="{service_class}"}}' in text
    values = server.metrics()
    assert values["gapless_kv_blocks_total"] == server.engine.kv.pool.num_blocks
    assert values["gapless_generation_tokens_total"] >= 3
    assert values["gapless_time_to_first_token_seconds_count"] >= 1


def finished_by_class(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(
        r'^gapless_class_requests_finished_total\{class="(\w+)"\} (\S+)$', text, re.M
    )
    return {name: float(value) for name, value in found}


@pytest.mark.parametrize(
    "fields,streamed,service_class",
    [
        ({"service_tier": "flex"}, False, "batch"),
        ({"service_tier": "priority"}, False, "interactive"),
        ({"extra_body": {"priority": 5}}, False, "batch"),
        ({"extra_body": {"priority": -1}}, False, "interactive"),
        ({"extra_body": {"service_class": "interactive"}}, False, "interactive"),
        ({"service_tier": "auto", "extra_body": {"service_class": "batch"}}, True, "batch"),
        # The defaults: standard, interactive when streamed, batch for more than 4 choices.
        ({}, False, "standard"),
        ({"service_tier": "default"}, True, "interactive"),
        ({"n": 5}, True, "batch"),
    ],
)
def test_service_class_fields_and_their_metrics(
    oai: openai.OpenAI,
    server: RunningServer,
    fields: dict[str, Any],
    streamed: bool,
    service_class: str,
) -> None:
    before = finished_by_class(server)
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=2,
        stream=streamed,
        extra_body=extra,
        **fields,
    )
    if streamed:
        list(r)
    after = finished_by_class(server)
    n = fields.get("n", 1)
    assert set(after) == {"interactive", "standard", "batch"}
    assert {c: after[c] - before[c] for c in after} == {
        c: n if c == service_class else 0 for c in after
    }


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b", "é\u2028\n"])
def test_a_streamed_line_holds_its_text_whole_whatever_line_breaks_it_carries(text):
    """Generated text may hold characters that str.splitlines (and httpx's iter_lines, and
    so many clients) take for line ends: an SSE data line or an NDJSON line stays one line."""
    obj = {"text": text}
    for line in (sse(obj).decode(), ndjson(obj).decode()):
        [data] = [part for part in line.splitlines() if part]
        assert json.loads(data.removeprefix("data: ")) == obj
