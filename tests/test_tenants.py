"""API keys and tenants (--api-keys FILE): a key names its tenant and default service class,
its tenant's requests in flight are bounded (429 with Retry-After, in each dialect's shape,
and the count returns to 0 whatever way a request ends), bad files stop the start without
printing a key, and SIGHUP rereads the file."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_fixture import MODEL, running_server
from test_server_cli import ServerProcess, _port, start_server  # noqa: F401 - a fixture

from gapless.server import tenants as tenants_module
from gapless.server.settings import ServerSettings
from gapless.server.tenants import KeyFileError, OverLimit, Tenant, Tenants

KEYS = {
    "keys": {
        "sk-acme": {"tenant": "acme", "class": "batch", "max_in_flight": 1},
        "sk-zeta": {"tenant": "zeta"},
        "sk-tight": {"tenant": "tight", "tokens_per_minute": 40},
    }
}


def write(path: Path, keys: object) -> Path:
    path.write_text(json.dumps(keys))
    return path


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory) -> Iterator:
    path = write(tmp_path_factory.mktemp("keys") / "keys.json", KEYS)
    tenants = Tenants(path)
    settings = ServerSettings(MODEL, api_keys=str(path))
    with running_server(checkpoint("llama"), settings, tenants=tenants) as server:
        yield server, tenants


def labelled(url: str, family: str, label: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = rf'^gapless_{family}{{{label}="([^"]+)"}} (\S+)$'
    return {name: float(v) for name, v in re.findall(pattern, text, re.MULTILINE)}


def test_a_key_names_its_tenant_and_default_class(served):
    server, tenants = served
    before = labelled(server.url, "class_requests_finished_total", "class")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-acme")
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    after = labelled(server.url, "class_requests_finished_total", "class")
    assert after["batch"] == before["batch"] + 1  # the key's class, not `standard`
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"service_class": "interactive"}
    )
    assert labelled(server.url, "class_requests_finished_total", "class")["interactive"] == (
        before["interactive"] + 1  # the request's own class wins
    )
    assert labelled(server.url, "tenant_requests_finished_total", "tenant")["acme"] >= 2
    assert tenants.in_flight("acme") == 0


def test_a_wrong_or_missing_key_is_refused(served):
    server, _ = served
    for key in ("sk-wrong", "sk-acm", "sk-acmee"):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "model": MODEL})
    assert r.status_code == 401


def test_a_tenant_past_its_limit_gets_429_in_each_dialects_shape(served):
    server, tenants = served
    acme = tenants.identify("sk-acme")
    tenants.admit(acme, 1)  # acme's one request in flight (max_in_flight 1)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            refused = http.post("/v1/completions", json=body, headers={"x-api-key": "sk-acme"})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "too_many_requests"
            user = [{"role": "user", "content": "x"}]
            message = {"model": MODEL, "max_tokens": 2, "messages": user}
            shaped = http.post("/v1/messages", json=message, headers={"x-api-key": "sk-acme"})
            assert shaped.status_code == 429
            assert shaped.json()["type"] == "error"  # Anthropic's shape
        # Another tenant is not held back by acme's limit.
        zeta = anthropic.Anthropic(base_url=server.url, api_key="sk-zeta")
        zeta.messages.create(model=MODEL, max_tokens=2, messages=user)
    finally:
        tenants.ended(acme)
    assert tenants.in_flight("acme") == 0


def test_tokens_per_minute_counts_prompts_and_outputs_over_the_last_minute(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(tenants_module.time, "monotonic", lambda: now[0])
    tenants = Tenants(write(tmp_path / "keys.json", KEYS))
    tight = Tenant("tight", tokens_per_minute=100)
    tenants.admit(tight, 30)
    now[0] += 10
    tenants.spend(tight, 50)  # its output, as generated
    tenants.admit(tight, 20)  # 100 in the window: at the limit, not past it
    now[0] += 10
    with pytest.raises(OverLimit) as refused:
        tenants.admit(tight, 5)
    # The window drops the first 30 tokens 60 s after they came: 40 s from now.
    assert refused.value.retry_after_s == 40
    assert tenants.in_flight("tight") == 2  # a refused request is not counted in flight
    now[0] += 40
    tenants.admit(tight, 5)
    # A prompt larger than the limit alone is admitted once the window is empty.
    now[0] += 61
    tenants.admit(tight, 500)
    with pytest.raises(OverLimit):
        tenants.admit(tight, 1)


def test_a_tenant_past_its_tokens_per_minute_gets_429_and_others_do_not(served):
    server, tenants = served
    tight = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-tight", max_retries=0)
    done = tight.completions.create(
        model=MODEL, prompt="hi", max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 40  # its output counted as generated: 40 + prompt
    with pytest.raises(openai.RateLimitError) as refused:
        tight.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert 50 <= int(refused.value.response.headers["retry-after"]) <= 60
    assert "tokens per minute" in refused.value.message
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-zeta")
    other.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_metrics_have_each_tenants_latencies_and_only_the_files_tenants(served):
    server, _ = served
    before = labelled(server.url, "tenant_time_to_first_token_seconds_count", "tenant")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-zeta")
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    after = labelled(server.url, "tenant_time_to_first_token_seconds_count", "tenant")
    assert set(after) == {"acme", "tight", "zeta"}
    assert after["zeta"] == before["zeta"] + 1
    itl = labelled(server.url, "tenant_inter_token_latency_seconds_count", "tenant")
    assert itl["zeta"] >= 2


def test_a_tenants_count_ends_with_its_request_however_it_ends(served):
    server, tenants = served
    headers = {"Authorization": "Bearer sk-acme"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1500, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=60, headers=headers) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as first,
    ):
        next(first.iter_lines())  # admitted; the client then goes away mid-stream
    bad = httpx.post(
        f"{server.url}/v1/completions", json={**body, "top_p": 7}, headers=headers, timeout=60
    )
    assert bad.status_code == 400  # refused at admission: never counted, or counted out
    wait_until_none_in_flight(tenants, "acme")
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "max_tokens": 2},
        headers=headers,
        timeout=60,
    )
    assert ok.status_code == 200
    # Its count ends as its handler returns, which a loaded machine may run after the client
    # has read the response.
    wait_until_none_in_flight(tenants, "acme")


def wait_until_none_in_flight(tenants, tenant: str) -> None:
    deadline = time.monotonic() + 30
    while tenants.in_flight(tenant):
        assert time.monotonic() < deadline, "a request's count never ended"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ("not json", "cannot read it as JSON"),
        ({"keys": {"sk-secret": {}}}, "key 1: tenant must be a non-empty string"),
        ({"keys": {"sk-secret": {"tenant": "a", "class": "urgent"}}}, "key 1: class must be"),
        ({"keys": {"sk-secret": {"tenant": "a", "max_in_flight": 0}}}, "key 1: max_in_flight"),
        ({"keys": {"sk-secret": {"tenant": "a", "tokens_per_minute": 1.5}}}, "tokens_per_minute"),
        ({"keys": {"sk-secret": {"tenant": "a", "limit": 3}}}, "key 1: unknown fields"),
    ],
)
def test_a_bad_key_file_is_refused_naming_what_is_wrong_but_no_key(tmp_path, keys, says):
    path = tmp_path / "keys.json"
    path.write_text(keys if isinstance(keys, str) else json.dumps(keys))
    with pytest.raises(KeyFileError, match=re.escape(says)) as e:
        Tenants(path)
    assert "sk-secret" not in str(e.value)


def test_serve_stops_on_a_bad_key_file_and_rereads_a_good_one_on_sighup(start_server, tmp_path):  # noqa: F811
    bad = write(tmp_path / "bad.json", {"keys": {"sk-secret": {"tenant": ""}}})
    refused = start_server("--api-keys", str(bad))
    assert refused.proc.wait(120) == 2
    log = refused.rest_of_log()
    assert "tenant must be a non-empty string" in log and "sk-secret" not in log

    path = write(tmp_path / "keys.json", {"keys": {"sk-old": {"tenant": "a"}}})
    server = start_server("--api-keys", str(path))
    url = f"http://127.0.0.1:{_port(server)}/v1/models"

    def status(key: str) -> int:
        return httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    assert (status("sk-old"), status("sk-new")) == (200, 401)
    write(path, {"keys": {"sk-new": {"tenant": "b"}}})
    server.proc.send_signal(signal.SIGHUP)
    server.wait_for_line("--api-keys reloaded")
    assert (status("sk-old"), status("sk-new")) == (401, 200)
    path.write_text("{broken")
    server.proc.send_signal(signal.SIGHUP)
    server.wait_for_line("--api-keys not reloaded")
    assert status("sk-new") == 200
