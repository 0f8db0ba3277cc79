"""API keys, a full queue, and draining on shutdown, each against a real in-process server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import openai
import pytest
from server_fixture import MODEL, RunningServer, SSEReader, running_server

from gapless.server.settings import ServerSettings

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    # One request runs at a time and one may wait: the third is refused.
    settings = ServerSettings(MODEL, api_key=KEY)
    with running_server(
        llama_dir, settings, max_num_seqs=1, max_queue=1, kv_cache_tokens=8192
    ) as running:
        yield running


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong-key"}, {"authorization": KEY}],
    ids=["missing", "wrong", "not bearer"],
)
def test_api_key_refused(server: RunningServer, headers: dict[str, str]) -> None:
    for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models")]:
        r = httpx.request(
            method, f"{server.url}{path}", headers=headers, json={"prompt": "hi"}, timeout=30
        )
        assert r.status_code == 401
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_api_key_accepted(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    # Probes stay open: a load balancer has no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_full_queue_is_503_with_retry_after(server: RunningServer) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    long = {"prompt": "occupy", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with (
        server.client(headers=auth) as running_client,
        running_client.stream("POST", "/v1/completions", json=long) as running,
    ):
        # Decoding: it holds the only batch slot. (Keep the reader: dropping it would close
        # the connection, and the server would rightly cancel the request.)
        reader = SSEReader(running)
        reader.read_until("data")
        waiter = threading.Thread(
            target=lambda: server.client(headers=auth).post("/v1/completions", json=long)
        )
        waiter.start()
        # Not observable through its own response (nothing is sent while it waits).
        server.wait_for_metric("gapless_requests_waiting", 1)
        r = httpx.post(f"{server.url}/v1/completions", headers=auth, json={"prompt": "x"})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("overloaded_error", "queue_full")
        # Cancel both so the module's other tests find an idle server.
        for request_id in list(server.server.state.live):
            assert httpx.post(
                f"{server.url}/v1/cancel/{request_id}", headers=auth, json={}
            ).status_code in (
                200,
                404,
            )
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    server.wait_for_metric("gapless_requests_running", 0)


def test_shutdown_lets_streams_finish_and_refuses_new_work(llama_dir: Path) -> None:
    settings = ServerSettings(MODEL, shutdown_grace_s=60)
    with running_server(llama_dir, settings, kv_cache_tokens=8192) as srv, srv.client() as client:
        body = {"prompt": "finish me", "max_tokens": 600, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            reader = SSEReader(r)
            reader.read_until("data")
            srv.server.shutdown()
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{srv.url}/health")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert health.status_code == 503
            refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "late"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            assert refused.headers["retry-after"] == "1"
            sse = reader.read_all()
        # Within the grace period the stream runs to its natural end.
        assert sse.finish_reason == "length"
        assert len(sse.token_chunks) == 600
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive()


def test_health_is_503_loading_until_the_start_up_step_is_done(llama_dir: Path) -> None:
    warming: Future = Future()  # the start-up step, still running
    with running_server(llama_dir, warming=warming, kv_cache_tokens=2048) as srv:
        health = httpx.get(f"{srv.url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        assert health.headers["retry-after"] == "1"
        # A request that comes anyway is served: it queues on the engine thread behind the
        # step, it is not refused.
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        done = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert done.json()["usage"]["completion_tokens"] == 2
        warming.set_result(None)
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
