"""OpenAI's Batches API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id} and
POST /v1/batches/{id}/cancel, over the jobs that batch_jobs.py runs and batch_store.py keeps.

A job belongs to the tenant that created it, as its input file must (openai_files.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gapless.server import protocol
from gapless.server.batch_jobs import ENDPOINTS, BatchJobs
from gapless.server.batch_store import StoredBatch
from gapless.server.endpoint import ServerState, read_json
from gapless.server.openai_files import owner, page, page_params, store
from gapless.server.protocol import APIError, invalid, str_field

ID_PREFIX = "batch_"
COMPLETION_WINDOWS = ("24h",)
# OpenAI's bounds on a job's metadata.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# A list's page when its request names no limit, and the most it may name.
BATCHES_PAGE, MOST_BATCHES = 20, 100


def batch_object(batch: StoredBatch) -> dict[str, Any]:
    errors = None if batch.errors is None else {"object": "list", "data": batch.errors}
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        **batch.times,
        # A job runs until it is done: none expires.
        "expires_at": None,
        "expired_at": None,
        "request_counts": batch.counts,
        "metadata": batch.metadata,
    }


def _jobs(state: ServerState, request: Request) -> BatchJobs:
    store(state)  # the 400 where the server keeps no jobs
    jobs: BatchJobs = request.app.state.batch_jobs  # app.py's, wherever there is a store
    return jobs


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = protocol.dict_field(body, "metadata")
    if metadata is None:
        return None
    if len(metadata) > METADATA_PAIRS:
        raise invalid(f"metadata may hold at most {METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str):
            raise invalid(
                f"metadata's keys must be at most {METADATA_KEY_CHARS} characters and its "
                "values strings",
                f"metadata.{key}",
            )
        if len(value) > METADATA_VALUE_CHARS:
            raise invalid(
                f"metadata's values must be at most {METADATA_VALUE_CHARS} characters",
                f"metadata.{key}",
            )
    return metadata


def _required(body: dict[str, Any], name: str, choices: tuple[str, ...] | None = None) -> str:
    value = str_field(body, name)
    if value is None:
        raise invalid(f"{name} is required", name)
    if choices is not None and value not in choices:
        raise invalid(f"{name} must be one of {', '.join(choices)}, got {value!r}", name)
    return value


async def create(state: ServerState, request: Request) -> Response:
    jobs = _jobs(state, request)
    body = await read_json(state, request)
    input_file_id = _required(body, "input_file_id")
    endpoint = _required(body, "endpoint", tuple(ENDPOINTS))
    window = _required(body, "completion_window", COMPLETION_WINDOWS)
    metadata = _metadata(body)
    file = await jobs.store.file(input_file_id, owner())
    if file is None:
        raise APIError(
            404,
            f"no such file: {input_file_id}",
            "not_found_error",
            "input_file_id",
            "file_not_found",
        )
    if file.purpose != "batch":
        raise invalid(
            f"the input file's purpose is {file.purpose}; a job reads files uploaded for batch",
            "input_file_id",
        )
    batch_id = f"{ID_PREFIX}{uuid.uuid4().hex}"
    await jobs.store.add_batch(
        batch_id, owner(), endpoint, input_file_id, window, metadata, protocol.now()
    )
    jobs.start(batch_id)
    return JSONResponse(batch_object(await _batch(state, batch_id)))


async def _batch(state: ServerState, batch_id: str) -> StoredBatch:
    batch = await store(state).batch(batch_id, owner())
    if batch is None:
        raise APIError(
            404, f"no such batch: {batch_id}", "not_found_error", "batch_id", "batch_not_found"
        )
    return batch


async def retrieve(state: ServerState, request: Request) -> Response:
    return JSONResponse(batch_object(await _batch(state, request.path_params["batch_id"])))


async def list_batches(state: ServerState, request: Request) -> Response:
    after, limit = page_params(request, BATCHES_PAGE, MOST_BATCHES)
    found = await store(state).batches(owner(), after, limit + 1)
    return JSONResponse(page([batch_object(b) for b in found], limit))


async def cancel(state: ServerState, request: Request) -> Response:
    batch = await _batch(state, request.path_params["batch_id"])
    if not await _jobs(state, request).cancel(batch.id):
        raise APIError(
            409,
            f"batch {batch.id} is {batch.status}: only a validating or in-progress job can be "
            "cancelled",
            code="batch_not_cancellable",
        )
    return JSONResponse(batch_object(await _batch(state, batch.id)))


ROUTES = [
    ("POST", "/v1/batches", create),
    ("GET", "/v1/batches", list_batches),
    ("GET", "/v1/batches/{batch_id}", retrieve),
    ("POST", "/v1/batches/{batch_id}/cancel", cancel),
]
