"""Running batch jobs: a job's input lines are checked, then each line's body runs through the
same code as the live endpoint's request (openai_chat.respond, ...), in the `batch` service
class and as the tenant that created the job; then its output and error files are written.

A job's lines share the engine with live requests. At most `--batch-lines-in-flight` lines of
all jobs together are in the engine at once (jobs take turns at them), so a chat that arrives
finds the batch with room, and in the `batch` class a line yields to it anyway: prefilled after
it, preempted before it. A line refused for load (a 429 past its tenant's limits, a 503 with
the queue full) waits and tries again; one cancelled by a shutdown is left pending, and the
next server on the data directory runs it (`resume`). A line is written once, when it is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from gapless.server import (
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_files,
    protocol,
)
from gapless.server.batch_store import BatchStore, CheckedLine, PendingLine, StoredBatch, StoredFile
from gapless.server.endpoint import EngineResponse, ServerState, json_object
from gapless.server.openai_common import error_body
from gapless.server.protocol import APIError, now
from gapless.server.tenants import CALLER, Tenant

log = logging.getLogger("gapless.server")


@dataclass(frozen=True)
class Endpoint:
    respond: Callable[[ServerState, dict[str, Any]], Awaitable[EngineResponse]]
    contexts: int  # the JSON values a line may hold, in contexts' worth (json_object)


# The endpoints a job's lines may name, each run by the live endpoint's own code.
ENDPOINTS = {
    "/v1/chat/completions": Endpoint(openai_chat.respond, 1),
    "/v1/completions": Endpoint(openai_completions.respond, 1),
    "/v1/embeddings": Endpoint(openai_embeddings.respond, openai_embeddings.BATCH_CONTEXTS),
}
# An output or error file line's id is this and a fresh hex id.
LINE_ID_PREFIX = "batch_req_"
# Statuses that refuse a retry now and ask for one later (a tenant's limit, a full queue).
LOAD_STATUSES = (429, 503)


def output_line(
    custom_id: str | None,
    response: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A line of a job's output or error file, in OpenAI's shape."""
    return {
        "id": f"{LINE_ID_PREFIX}{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def check_line(
    state: ServerState, endpoint: str, seen: set[str], number: int, raw: bytes
) -> CheckedLine:
    """An input line checked as far as it can be without running it: JSON within the body
    limits (--max-body-mb), a custom_id not `seen` before, POST to the job's endpoint, a body
    object; the body's own checks are the endpoint's, when the line runs."""

    def refused(code: str, message: str, custom_id: str | None = None) -> CheckedLine:
        error = {"code": code, "message": f"line {number}: {message}"}
        return CheckedLine(number, custom_id, result=output_line(custom_id, error=error))

    try:
        line = json_object(state, raw, ENDPOINTS[endpoint].contexts)
    except APIError as e:
        return refused(e.code or "invalid_json", e.message)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return refused("missing_custom_id", "custom_id must be a non-empty string")
    if custom_id in seen:
        return refused("duplicate_custom_id", f"custom_id {custom_id!r} is taken", custom_id)
    seen.add(custom_id)
    if line.get("method", "POST") != "POST":
        return refused("invalid_method", "method must be POST", custom_id)
    url = line.get("url")
    if url not in ENDPOINTS:
        known = ", ".join(ENDPOINTS)
        return refused("invalid_url", f"url must be one of {known}, got {url!r}", custom_id)
    if url != endpoint:
        return refused("mismatched_url", f"url must be the job's endpoint {endpoint}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        return refused("invalid_body", "body must be a JSON object", custom_id)
    if body.get("stream") is True:
        return refused("invalid_body", "a batch job's request cannot stream", custom_id)
    return CheckedLine(number, custom_id, body=body)


class BatchJobs:
    """The jobs that run on this server, each in an asyncio task of its own."""

    def __init__(self, state: ServerState, store: BatchStore) -> None:
        self.state = state
        self.store = store
        settings, scheduler = state.settings, state.engine.config.scheduler
        self.lines_in_flight = settings.batch_lines_in_flight or max(1, scheduler.max_num_seqs // 2)
        # The lines of all jobs in the engine at once; a waiting job takes the next free one.
        self._slots = asyncio.Semaphore(self.lines_in_flight)
        self._tasks: dict[str, asyncio.Task] = {}
        self._running_lines: dict[str, anyio.CancelScope] = {}  # by job

    async def resume(self) -> None:
        """Starts every unfinished job in the store: those a stopped server left."""
        for batch_id in await self.store.unfinished():
            self.start(batch_id)

    def start(self, batch_id: str) -> None:
        if batch_id in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._run(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, task: asyncio.Task) -> None:
        del self._tasks[batch_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("batch job %s stopped", batch_id, exc_info=task.exception())

    async def cancel(self, batch_id: str) -> bool:
        """Cancels a job that is validating or in progress: its lines in the engine are
        cancelled, and it finishes with the lines done so far; False if it was past that."""
        if not await self.store.move(batch_id, "cancelling", now(), ("validating", "in_progress")):
            return False
        scope = self._running_lines.get(batch_id)
        if scope is not None:
            scope.cancel()
        else:
            self.start(batch_id)  # it finishes as cancelled (a running one does once validated)
        return True

    async def stop(self) -> None:
        """Stops every job where it is (the server is stopping); a restart resumes them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, batch_id: str) -> None:
        batch = await self.store.batch(batch_id)
        assert batch is not None
        if batch.status == "validating":
            check = functools.partial(check_line, self.state, batch.endpoint, set())
            await self.store.validate(batch_id, batch.input_file_id, check, now())
        if await self._status(batch_id) == "in_progress":
            with anyio.CancelScope() as scope:
                self._running_lines[batch_id] = scope
                try:
                    await self._run_lines(batch)
                finally:
                    del self._running_lines[batch_id]
            if not scope.cancel_called and not self.state.draining:
                await self.store.move(batch_id, "finalizing", now(), ("in_progress",))
        status = await self._status(batch_id)
        if status in ("finalizing", "cancelling"):
            final = "completed" if status == "finalizing" else "cancelled"
            files = {
                state: StoredFile(
                    openai_files.new_id(),
                    batch.owner,
                    f"{batch_id}_{kind}.jsonl",
                    "batch_output",
                    0,  # counted as it is written
                    now(),
                )
                for state, kind in (("completed", "output"), ("failed", "error"))
            }
            await self.store.finish(batch_id, final, files, now())

    async def _status(self, batch_id: str) -> str:
        batch = await self.store.batch(batch_id)
        assert batch is not None
        return batch.status

    async def _run_lines(self, batch: StoredBatch) -> None:
        """Runs the job's pending lines until none is left, or the server drains."""
        endpoint, tenant = ENDPOINTS[batch.endpoint], self._tenant(batch.owner)
        # This job's lines started and not ended, bounded so that a long job is never all in
        # memory at once; twice the slots, so that lines wait for a slot while others write
        # their results, and the engine always has its share of the job.
        room = anyio.Semaphore(2 * self.lines_in_flight)
        async with anyio.create_task_group() as lines:
            async for line in self._pending(batch.id):
                await room.acquire()
                if self.state.draining:
                    return
                lines.start_soon(self._line, batch.id, endpoint, tenant, line, room)

    async def _pending(self, batch_id: str) -> AsyncIterator[PendingLine]:
        after = 0
        while page := await self.store.pending(batch_id, after, self.lines_in_flight):
            for line in page:
                yield line
            after = page[-1].line

    def _tenant(self, owner: str) -> Tenant | None:
        """The job's tenant, as the keys in force give it: so its limits are today's. A
        tenant no longer in --api-keys keeps its name (its fair share) and no limits."""
        if not owner or self.state.tenants is None:
            return None
        return self.state.tenants.named(owner) or Tenant(owner)

    async def _line(
        self,
        batch_id: str,
        endpoint: Endpoint,
        tenant: Tenant | None,
        line: PendingLine,
        room: anyio.Semaphore,
    ) -> None:
        try:
            CALLER.set(tenant)  # this task's: what admission and the tenant's limits read
            while True:
                async with self._slots:
                    result = await self._attempt(endpoint, line)
                if result is not None:
                    succeeded, out = result
                    await self.store.done(batch_id, line.line, succeeded, out)
                    return
                if self.state.draining:
                    return  # left pending, for the next server on this data directory
                await asyncio.sleep(protocol.RETRY_AFTER_S)
        finally:
            room.release()

    async def _attempt(
        self, endpoint: Endpoint, line: PendingLine
    ) -> tuple[bool, dict[str, Any]] | None:
        """The line run once: (succeeded, its output or error line), or None where it was
        refused for load or cancelled, to run again."""
        # Whatever class the body names: a job is bulk work, and yields to live requests.
        body = {**line.body, "service_class": "batch"}
        try:
            response = await endpoint.respond(self.state, body)
            out = await response.read()
        except APIError as e:
            if e.status in LOAD_STATUSES:
                return None
            return False, _failed(line, e)
        except Exception as e:  # as the live endpoint answers it: a 500, this line alone
            log.exception("a line of a batch job failed")
            return False, _failed(line, protocol.server_error(f"{type(e).__name__}: {e}"))
        if any(f.finish_reason == "cancelled" for f in response.renderer.finishes):
            return None
        answered = {"status_code": 200, "request_id": response.request_id, "body": out}
        return True, output_line(line.custom_id, answered)


def _failed(line: PendingLine, error: APIError) -> dict[str, Any]:
    """The error file line of a line whose request the endpoint refused or failed."""
    response = {
        "status_code": error.status,
        "request_id": uuid.uuid4().hex,
        "body": error_body(error),
    }
    return output_line(line.custom_id, response)
