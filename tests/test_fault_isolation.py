"""One client can never hurt another: bad input is refused at admission, a fault in a batched
step fails only the requests it comes from, and every other stream keeps its exact tokens."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixture import MODEL, RunningServer, running_server

from gapless import Engine, EngineConfig, SamplingParams
from gapless.engine import sampler as sampler_module
from gapless.engine.events import TokenEvent
from gapless.server.settings import ServerSettings

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(
        llama_dir, ServerSettings(MODEL, max_body_mb=4), kv_cache_tokens=8192
    ) as running:
        yield running


# -- the server -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers,content",
    [
        ({"content-type": "text/plain"}, b'{"prompt": "hi"}'),
        ({"content-type": "application/x-www-form-urlencoded"}, b"prompt=hi"),
        ({"content-type": "multipart/form-data; boundary=x"}, b"--x--"),
        ({}, b'{"prompt": "hi"}'),
    ],
    ids=["text/plain", "form", "multipart", "none"],
)
def test_post_bodies_must_be_json(
    client: httpx.Client, headers: dict[str, str], content: bytes
) -> None:
    # Without this, any web page could drive a local server: browsers send these cross-origin
    # without a preflight.
    for path in (COMPLETIONS, CHAT, "/v1/cancel/some-id"):
        r = client.post(path, content=content, headers=headers)
        assert r.status_code == 415, (path, r.text)
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
    charset = {"content-type": "application/json; charset=utf-8"}
    body = b'{"prompt": "hi", "max_tokens": 1}'
    assert client.post(COMPLETIONS, content=body, headers=charset).status_code == 200


def test_template_kwargs_named_like_our_own_arguments_are_just_variables(
    client: httpx.Client,
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "chat_template_kwargs": {"self": 1, "add_generation_prompt": True, "tokenizer": 2},
    }
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_client_hanging_up_mid_body_logs_one_line(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        "content-length: 100000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(head.encode() + b'{"prompt": "half a bo')
        # The server notices on its next read; a normal request after that has been served.
        r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 200, r.text
    hung_up = [r for r in caplog.records if "hung up" in r.getMessage()]
    assert len(hung_up) == 3
    assert all(r.levelno <= logging.INFO and r.exc_info is None for r in hung_up)
    assert not [r for r in caplog.records if r.exc_info and "ClientDisconnect" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_echo_of_token_ids_keeps_special_tokens(
    client: httpx.Client, server: RunningServer
) -> None:
    tok = server.engine.tokenizer
    text = "<|user|>hello<|end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.special_ids & set(ids)
    for prompt in (text, ids):
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "skip_special_tokens": False}
        r = client.post(COMPLETIONS, json=body).json()
        assert r["choices"][0]["text"] == text, prompt


def test_logprobs_end_where_the_stop_string_cuts_the_text(client: httpx.Client) -> None:
    body = {"prompt": "stop here", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    body["logprobs"] = 0
    full = client.post(COMPLETIONS, json=body).json()["choices"][0]
    pieces = full["logprobs"]["tokens"]
    # A stop string that begins exactly at a token boundary and appears nowhere before it.
    cut = next(
        k
        for k in range(2, len(pieces))
        if pieces[k].strip()
        and "\ufffd" not in "".join(pieces[: k + 1])
        and pieces[k] not in "".join(pieces[:k]) + pieces[k][:-1]
    )
    r = client.post(COMPLETIONS, json={**body, "stop": [pieces[cut]]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == "".join(pieces[:cut])
    assert choice["logprobs"]["tokens"] == pieces[:cut]
    assert choice["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:cut]


HOSTILE = [
    (COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 4, "top_k": 10**20}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63}),
    (COMPLETIONS, {"prompt": "x = 1; " * 400_000}),  # 2.8 MB of text, under the body limit
    # More JSON values than the context could use: 413 before parsing.
    (COMPLETIONS, {"prompt": "y", "max_tokens": 30, "stop": [f"s{i}" for i in range(100_000)]}),
    (COMPLETIONS, {"prompt": "z", "seed": -(2**70)}),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "w"}], "chat_template_kwargs": {"messages": []}},
    ),
    (COMPLETIONS, {"prompt": "def f(\ud800):"}),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud800y"}]}),
]


def test_hostile_requests_beside_a_stream_leave_its_tokens_exactly_alone(
    client: httpx.Client, server: RunningServer
) -> None:
    body = {"prompt": "bystander", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = client.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    hostile_status: list[int] = []

    def attack() -> None:
        with server.client(headers={"content-type": "application/json"}) as other:
            for path, bad in HOSTILE:
                # json.dumps escapes a lone surrogate as \\ud800, as a client's JSON would.
                hostile_status.append(other.post(path, content=json.dumps(bad)).status_code)

    attacker = threading.Thread(target=attack)
    with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        attacker.start()
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    attacker.join(timeout=60)
    assert hostile_status == [400, 400, 400, 413, 400, 400, 400, 400]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
    assert text == alone


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture
def engine(llama_dir: Path) -> Engine:
    return Engine.from_pretrained(llama_dir, EngineConfig.of(dtype="float32", kv_cache_tokens=4096))


def _run(engine: Engine) -> dict[str, list[Any]]:
    events: dict[str, list[Any]] = {}
    while engine.has_work:
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


def _tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(
        max_tokens=12, temperature=1.0, seed=11, repetition_penalty=1.3, ignore_eos=True
    ),
]


def _add_all(engine: Engine) -> list[str]:
    prompts = ["first prompt", "second one, longer than that", "third"]
    return [engine.add_request(p, params) for p, params in zip(prompts, PARAMS, strict=True)]


def _clean_tokens(engine: Engine) -> list[list[int]]:
    """Each request's tokens when nothing fails, in the order _add_all adds them."""
    ids = _add_all(engine)
    events = _run(engine)
    return [_tokens(events[i]) for i in ids]


def _assert_unharmed(
    faulty: dict[str, list[Any]], ids: list[str], clean: list[list[int]], victim: str
) -> None:
    assert faulty[victim][-1].finish_reason == "error"
    for mine, expected in zip(ids, clean, strict=True):
        if mine != victim:
            assert _tokens(faulty[mine]) == expected
            assert faulty[mine][-1].finish_reason == "length"


def test_a_sampler_fault_in_one_row_fails_only_that_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = _clean_tokens(engine)
    ids = _add_all(engine)
    victim = ids[0]
    real_sample = sampler_module.sample
    victim_states = [r.sampling for r in engine.intake.sequences(victim)]

    def faulty_sample(states: list[Any], logits: Any) -> Any:
        out = real_sample(states, logits)  # draws first: the retry must rewind the seeds
        if any(s is v for s in states for v in victim_states):
            raise OverflowError("injected sampler fault")
        return out

    monkeypatch.setattr(sampler_module, "sample", faulty_sample)
    faulty = _run(engine)
    _assert_unharmed(faulty, ids, clean, victim)
    assert "injected sampler fault" in faulty[victim][-1].error
    assert engine.kv.pool.num_used == 0


def test_a_forward_fault_in_one_chunk_fails_only_that_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = _clean_tokens(engine)
    ids = _add_all(engine)
    victim = ids[1]
    real_execute = engine.runner.execute

    def faulty_execute(chunks: list[Any], all_logits: set[int]) -> Any:
        if any(c.request.request_id == victim for c in chunks):
            raise RuntimeError("injected forward fault")
        return real_execute(chunks, all_logits)

    monkeypatch.setattr(engine.runner, "execute", faulty_execute)
    faulty = _run(engine)
    _assert_unharmed(faulty, ids, clean, victim)
    assert "injected forward fault" in faulty[victim][-1].error
    assert engine.kv.pool.num_used == 0


def test_an_engine_bug_in_every_row_fails_safe(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(sampler_module, "sample", broken)
    ids = _add_all(engine)
    events = _run(engine)  # ends: every request fails once, nothing is retried forever
    assert [events[i][-1].finish_reason for i in ids] == ["error"] * 3
    assert engine.kv.pool.num_used == 0


def test_python_api_refuses_what_the_server_refuses(engine: Engine) -> None:
    from gapless.engine.engine import RequestError

    cases = [
        ("a", SamplingParams(top_k=10**20), "top_k"),
        ("a", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ("def f(\ud800):", SamplingParams(), "prompt"),
        ("x = 1; " * 100_000, SamplingParams(), "prompt"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(RequestError) as info:
            engine.add_request(prompt, params)
        assert info.value.param == param
    assert not engine.has_work
