"""OpenAI's Files API, for batch jobs' input and output: POST /v1/files (a JSONL upload,
`purpose: batch`), GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content and
DELETE /v1/files/{id}.

A file belongs to the tenant that uploaded it (its API key's; with no --api-keys, to every
caller alike), and no other tenant sees it. An upload is read as it arrives and refused with
413 once past --max-upload-mb (at once where its declared length is), and its bytes go into the
store (batch_store.py) a chunk at a time: no upload is ever whole in memory.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gapless.server import protocol
from gapless.server.batch_store import BatchStore, StoredFile
from gapless.server.endpoint import ServerState, accepts
from gapless.server.protocol import APIError, invalid
from gapless.server.tenants import CALLER

ID_PREFIX = "file-"
# What an upload may be for: batch jobs' input is all this server reads.
PURPOSES = ("batch",)
# A list's page when its request names no limit, and the most it may name.
FILES_PAGE, MOST_FILES = 10_000, 10_000


def store(state: ServerState) -> BatchStore:
    """The server's store of files and jobs; a 400 where it has none."""
    if state.batch_store is None:
        raise APIError(
            400,
            "this server keeps no files or batch jobs: start it with --data-dir DIR",
            code="no_data_dir",
        )
    return state.batch_store


def owner() -> str:
    """Whose the caller's files and jobs are: its tenant's name ('' without --api-keys)."""
    tenant = CALLER.get()
    return "" if tenant is None else tenant.name


def new_id() -> str:
    return f"{ID_PREFIX}{uuid.uuid4().hex}"


def file_object(file: StoredFile) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": file.created_at,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def not_found(file_id: str) -> APIError:
    return APIError(404, f"no such file: {file_id}", "not_found_error", "file_id", "file_not_found")


def page_params(request: Request, default: int, most: int) -> tuple[str | None, int]:
    """A list's `after` (the id it continues after) and `limit`, from the query string."""
    limit = request.query_params.get("limit", str(default))
    if not limit.isdigit() or not 1 <= int(limit) <= most:
        raise invalid(f"limit must be an integer in [1, {most}], got {limit!r}", "limit")
    return request.query_params.get("after"), int(limit)


def page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A list's response, from up to limit + 1 objects (one more means more follow)."""
    shown = objects[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(objects) > limit,
    }


async def _bounded(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request's body as it arrives, refused (413) once past `limit` bytes."""
    received = 0
    async for piece in request.stream():
        received += len(piece)
        if received > limit:
            raise _too_large(limit)
        yield piece


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the upload is larger than {limit} bytes (--max-upload-mb)",
        code="file_too_large",
    )


@accepts("multipart/form-data")
async def upload(state: ServerState, request: Request) -> Response:
    files = store(state)
    limit = state.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    # Spooled to a temporary file past 1 MiB (starlette's parser), never all in memory.
    parser = MultiPartParser(request.headers, _bounded(request, limit), max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise invalid(f"the upload is not a multipart form: {e}") from e
    try:
        sent, purpose = form.get("file"), form.get("purpose")
        if not isinstance(sent, UploadFile):
            raise invalid("file is required: the JSONL file to upload", "file")
        if purpose not in PURPOSES:
            raise invalid(
                f"purpose must be {' or '.join(PURPOSES)} (batch jobs' input), got {purpose!r}",
                "purpose",
            )
        file = StoredFile(
            new_id(),
            owner(),
            sent.filename or "upload.jsonl",
            purpose,
            sent.size or 0,
            protocol.now(),
        )
        await sent.seek(0)
        await files.add_file(file, sent.file)
    finally:
        await form.close()
    return JSONResponse(file_object(file))


async def list_files(state: ServerState, request: Request) -> Response:
    after, limit = page_params(request, FILES_PAGE, MOST_FILES)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order!r}", "order")
    purpose = request.query_params.get("purpose")
    found = await store(state).files(owner(), purpose, after, limit + 1, order == "desc")
    return JSONResponse(page([file_object(f) for f in found], limit))


async def _file(state: ServerState, request: Request) -> StoredFile:
    file_id = request.path_params["file_id"]
    file = await store(state).file(file_id, owner())
    if file is None:
        raise not_found(file_id)
    return file


async def retrieve(state: ServerState, request: Request) -> Response:
    return JSONResponse(file_object(await _file(state, request)))


async def content(state: ServerState, request: Request) -> Response:
    file, files = await _file(state, request), store(state)

    async def chunks() -> AsyncIterator[bytes]:
        for n in itertools.count():
            data = await files.chunk(file.id, n)
            if data is None:
                return
            yield data

    return StreamingResponse(chunks(), media_type="application/octet-stream")


async def delete(state: ServerState, request: Request) -> Response:
    file_id = request.path_params["file_id"]
    if not await store(state).delete_file(file_id, owner()):
        raise not_found(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


ROUTES = [
    ("POST", "/v1/files", upload),
    ("GET", "/v1/files", list_files),
    ("GET", "/v1/files/{file_id}", retrieve),
    ("GET", "/v1/files/{file_id}/content", content),
    ("DELETE", "/v1/files/{file_id}", delete),
]
