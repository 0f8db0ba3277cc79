"""Batch jobs through OpenAI's Files and Batches API, with the real `openai` client: a job's
output lines are what the live endpoint answers, bad lines go to the error file while the job
goes on, uploads past --max-upload-mb get a 413, cancelling stops new lines, a job runs in the
batch class and as its tenant, and a server killed with SIGKILL mid-job resumes it on restart
with every line done once."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, RunningServer, running_server
from test_server_cli import ServerProcess, _port, start_server  # noqa: F401 - a fixture

from gapless.server.batch_store import DATABASE, BatchStore
from gapless.server.settings import ServerSettings
from gapless.server.tenants import Tenants

UPLOAD_LIMIT = 256 * 1024
LINE_LIMIT = 64 * 1024  # --max-body-mb: a line's limit too
MESSAGES = [{"role": "user", "content": "Count to ten."}]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def server(llama_dir: Path, data_dir: Path) -> Iterator[RunningServer]:
    store = BatchStore(data_dir)
    settings = ServerSettings(
        MODEL,
        max_upload_mb=UPLOAD_LIMIT / 2**20,
        max_body_mb=LINE_LIMIT / 2**20,
        batch_lines_in_flight=2,
    )
    try:
        with running_server(llama_dir, settings, batch_store=store) as running:
            yield running
    finally:
        store.close()


def jsonl(lines: list[Any]) -> bytes:
    """Lines of a JSONL file: objects as JSON, bytes as they are (a line that is not JSON)."""
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def chat_line(custom_id: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        },
    }


def wait_for(
    client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout: float = 120
) -> Any:
    deadline = time.monotonic() + timeout
    while not done(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"batch {batch_id} stuck: {batch}"
        time.sleep(0.05)
    return batch


def finished(batch: Any) -> bool:
    return batch.status in ("completed", "failed", "cancelled")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def run_job(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions"):
    upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"run": "test"},
    )
    assert batch.status == "validating"
    assert batch.input_file_id == upload.id
    return wait_for(client, batch.id, finished)


def labelled(url: str, family: str, label: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = rf'^gapless_{family}{{{label}="([^"]+)"}} (\S+)$'
    return {name: float(v) for name, v in re.findall(pattern, text, re.MULTILINE)}


# -- files ------------------------------------------------------------------------------------


def test_a_file_uploads_reads_lists_and_deletes(oai: openai.OpenAI) -> None:
    data = jsonl([chat_line("a"), chat_line("b")])
    file = oai.files.create(file=("requests.jsonl", data), purpose="batch")
    assert file.id.startswith("file-")
    assert (file.object, file.bytes, file.filename, file.purpose) == (
        "file",
        len(data),
        "requests.jsonl",
        "batch",
    )
    assert oai.files.retrieve(file.id) == file
    assert oai.files.content(file.id).content == data
    assert file.id in [f.id for f in oai.files.list(purpose="batch")]
    deleted = oai.files.delete(file.id)
    assert (deleted.id, deleted.deleted) == (file.id, True)
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(file.id)
    assert file.id not in [f.id for f in oai.files.list()]


def test_an_upload_past_the_limit_is_refused_with_413(oai: openai.OpenAI, server: RunningServer):
    with pytest.raises(openai.APIStatusError) as refused:
        oai.files.create(file=("big.jsonl", b"x" * (UPLOAD_LIMIT + 1)), purpose="batch")
    assert refused.value.status_code == 413
    assert "--max-upload-mb" in refused.value.message

    # Sent in chunks with no declared length: refused once past the limit, as it arrives.
    def body() -> Iterator[bytes]:
        yield b"--b\r\nContent-Disposition: form-data; name=file; filename=big.jsonl\r\n\r\n"
        for _ in range(16):
            yield b"x" * (UPLOAD_LIMIT // 4)

    headers = {"content-type": "multipart/form-data; boundary=b"}
    r = httpx.post(f"{server.url}/v1/files", content=body(), headers=headers, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "file_too_large"


def test_an_upload_needs_a_batch_purpose_and_a_file(
    oai: openai.OpenAI, server: RunningServer
) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oai.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    r = httpx.post(f"{server.url}/v1/files", files={"purpose": (None, "batch")})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "file"


def test_a_web_page_cannot_upload(server: RunningServer) -> None:
    # A form is what a browser posts to another origin without asking it first.
    files = {"file": ("x.jsonl", b"{}\n"), "purpose": (None, "batch")}
    r = httpx.post(f"{server.url}/v1/files", files=files, headers={"origin": "http://a.example"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "cross_origin"


# -- jobs -------------------------------------------------------------------------------------


def test_a_jobs_output_is_what_the_live_endpoint_answers(
    oai: openai.OpenAI, client: httpx.Client, server: RunningServer
) -> None:
    before = labelled(server.url, "class_requests_finished_total", "class").get("batch", 0)
    lines = [chat_line(f"q{i}", max_tokens=4 + i) for i in range(3)]
    batch = run_job(oai, lines)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert batch.metadata == {"run": "test"}
    assert batch.error_file_id is None
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = lines_of(oai, batch.output_file_id)
    assert [line["custom_id"] for line in out] == ["q0", "q1", "q2"]
    for sent, line in zip(lines, out, strict=True):
        assert line["id"].startswith("batch_req_")
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        got = line["response"]["body"]
        assert got["id"] == f"chatcmpl-{line['response']['request_id']}"
        live = client.post("/v1/chat/completions", json=sent["body"]).json()
        for key in ("id", "created"):
            del got[key], live[key]
        assert got == live
    # Each line ran in the batch class.
    assert labelled(server.url, "class_requests_finished_total", "class")["batch"] == before + 3


def test_bad_lines_go_to_the_error_file_and_the_job_goes_on(oai: openai.OpenAI) -> None:
    lines = [
        chat_line("good"),
        b'{"custom_id": "broken", "url": ',  # not JSON
        chat_line("good"),  # a custom_id taken
        {**chat_line("elsewhere"), "url": "/v1/images/generations"},
        {**chat_line("embeds"), "url": "/v1/embeddings"},  # not the job's endpoint
        chat_line("rejected", temperature=-1),  # the endpoint's own checks refuse it
        chat_line("class", service_class="interactive"),  # runs, in the batch class
        b'{"custom_id": "huge", "body": "' + b"x" * LINE_LIMIT + b'"}',  # past the line limit
    ]
    batch = run_job(oai, lines)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 2, "failed": 6}
    assert [line["custom_id"] for line in lines_of(oai, batch.output_file_id)] == ["good", "class"]
    errors = {
        (e["custom_id"], e["error"] and e["error"]["code"]): e
        for e in lines_of(oai, batch.error_file_id)
    }
    assert set(errors) == {
        (None, "invalid_json"),
        ("good", "duplicate_custom_id"),
        ("elsewhere", "invalid_url"),
        ("embeds", "mismatched_url"),
        ("rejected", None),
        (None, "request_too_large"),
    }
    assert errors[(None, "invalid_json")]["error"]["message"].startswith("line 2: ")
    rejected = errors[("rejected", None)]["response"]
    assert rejected["status_code"] == 400
    assert rejected["body"]["error"]["param"] == "temperature"


def test_an_embeddings_job(oai: openai.OpenAI) -> None:
    line = {"custom_id": "e", "url": "/v1/embeddings", "body": {"input": ["a cat", "a dog"]}}
    batch = run_job(oai, [line], "/v1/embeddings")
    assert batch.request_counts.completed == 1
    [out] = lines_of(oai, batch.output_file_id)
    live = oai.embeddings.create(model=MODEL, input=["a cat", "a dog"])
    got = [item["embedding"] for item in out["response"]["body"]["data"]]
    for vector, expected in zip(got, live.data, strict=True):
        assert vector == pytest.approx(expected.embedding, abs=1e-5)


def test_an_empty_input_fails_the_job(oai: openai.OpenAI) -> None:
    batch = run_job(oai, [b"", b"  "])
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "empty_file"
    assert batch.failed_at is not None


def test_a_job_needs_a_known_endpoint_and_file(oai: openai.OpenAI) -> None:
    upload = oai.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        oai.batches.create(
            input_file_id=upload.id, endpoint="/v1/moderations", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_cancelling_stops_new_lines(oai: openai.OpenAI, server: RunningServer) -> None:
    lines = [chat_line(f"c{i}", max_tokens=48) for i in range(30)]
    upload = oai.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(oai, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 1)
    cancelling = oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(oai, batch.id, finished)
    assert cancelled.status == "cancelled"
    assert cancelled.cancelling_at and cancelled.cancelled_at
    done = cancelled.request_counts.completed
    assert 1 <= done < 30
    assert len(lines_of(oai, cancelled.output_file_id)) == done
    time.sleep(0.5)
    assert oai.batches.retrieve(batch.id).request_counts.completed == done  # nothing ran on
    assert server.server.state.live == set()  # its lines in the engine were cancelled
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(batch.id)
    assert batch.id in [b.id for b in oai.batches.list(limit=100)]


def test_the_list_pages_newest_first(oai: openai.OpenAI) -> None:
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "a", "max_tokens": 1}}
    upload = oai.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
    made = [
        oai.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = oai.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2]
    assert first.has_more
    assert oai.batches.list(limit=1, after=made[1]).data[0].id == made[0]
    for batch_id in made:
        wait_for(oai, batch_id, finished)


def test_without_a_data_dir_the_endpoints_say_so(llama_dir: Path) -> None:
    with running_server(llama_dir) as plain:
        client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--data-dir"):
            client.batches.list()


# -- tenants ----------------------------------------------------------------------------------


def test_a_job_is_its_tenants_and_runs_within_its_limits(llama_dir: Path, tmp_path: Path):
    keys = tmp_path / "keys.json"
    tenants = {"sk-acme": {"tenant": "acme", "max_in_flight": 1}, "sk-zeta": {"tenant": "zeta"}}
    keys.write_text(json.dumps({"keys": tenants}))
    store, served = BatchStore(tmp_path / "data"), Tenants(keys)
    settings = ServerSettings(MODEL, api_keys=str(keys), batch_lines_in_flight=4)
    try:
        with running_server(llama_dir, settings, tenants=served, batch_store=store) as s:
            acme = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-acme", max_retries=0)
            zeta = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-zeta", max_retries=0)
            # Without a limit of its own, a job has --batch-lines-in-flight lines in flight.
            upload = zeta.files.create(
                file=("in.jsonl", jsonl([chat_line(f"z{i}", 64) for i in range(12)])),
                purpose="batch",
            )
            job = zeta.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            seen = []
            while not finished(zeta.batches.retrieve(job.id)):
                seen.append(served.in_flight("zeta"))
            assert max(seen) == 4
            # Four lines in flight at most, one request in flight for acme: the other three
            # wait for their turn (429s, retried), and all finish.
            batch = run_job(acme, [chat_line(f"t{i}") for i in range(4)])
            assert batch.request_counts.completed == 4
            assert labelled(s.url, "tenant_requests_finished_total", "tenant")["acme"] == 4
            with pytest.raises(openai.NotFoundError):
                zeta.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                zeta.files.content(batch.output_file_id)
            assert [b.id for b in zeta.batches.list()] == [job.id]  # not acme's
    finally:
        store.close()


# -- restart ----------------------------------------------------------------------------------


def _done_lines(data_dir: Path, batch_id: str) -> dict[int, str]:
    """The lines the store has done, and their results, read straight from the database."""
    with sqlite3.connect(data_dir / DATABASE) as db:
        rows = db.execute(
            "SELECT line, result FROM lines WHERE batch_id = ? AND state != 'pending'",
            (batch_id,),
        ).fetchall()
    return dict(rows)


def test_a_job_killed_mid_way_resumes_on_restart_and_does_each_line_once(
    start_server: Callable[..., ServerProcess],  # noqa: F811 - the fixture
    llama_dir: Path,
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    flags = [str(llama_dir), "--served-model-name", MODEL, "--data-dir", str(data_dir)]
    flags += ["--batch-lines-in-flight", "1"]
    first = start_server(*flags)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{_port(first)}/v1", api_key="-")
    lines = [chat_line(f"r{i}", max_tokens=48) for i in range(24)]
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 12)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    before = _done_lines(data_dir, batch.id)
    assert 12 <= len(before) < 24  # killed mid-job: half of it done, some of it not

    second = start_server(*flags)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{_port(second)}/v1", api_key="-")
    # A third server on the same directory would run the same lines: it stops at start.
    third = start_server(*flags)
    assert third.proc.wait(timeout=120) == 2
    assert "is in use by another gapless server" in third.rest_of_log()
    done = wait_for(client, batch.id, finished)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 24, "completed": 24, "failed": 0}
    out = lines_of(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(f"r{i}" for i in range(24))
    after = _done_lines(data_dir, batch.id)
    assert all(after[line] == result for line, result in before.items())  # not done again


def test_a_job_stopped_by_sigterms_drain_resumes_with_its_lines_left(llama_dir: Path, tmp_path):
    store = BatchStore(tmp_path / "data")
    settings = ServerSettings(MODEL, batch_lines_in_flight=2, shutdown_grace_s=0.2)
    lines = [chat_line(f"d{i}", max_tokens=48) for i in range(24)]
    try:
        with running_server(llama_dir, settings, batch_store=store) as first:
            client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="-", max_retries=0)
            upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_for(client, batch.id, lambda b: b.request_counts and b.request_counts.completed)
        # The drain (what SIGTERM starts) cancelled the running lines: none of them is
        # written as failed, and the job waits for the next server.
        before = _done_lines(tmp_path / "data", batch.id)
        assert 1 <= len(before) < 24
        assert all('"status_code": 200' in result for result in before.values())
        with running_server(llama_dir, settings, batch_store=store) as second:
            client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="-", max_retries=0)
            done = wait_for(client, batch.id, finished)
            assert done.request_counts.model_dump() == {"total": 24, "completed": 24, "failed": 0}
            out = lines_of(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(f"d{i}" for i in range(24))
    finally:
        store.close()
