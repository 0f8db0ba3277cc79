"""Uploaded files, batch jobs and each job's lines, in SQLite under --data-dir.

One database file, `batches.sqlite`, holds it all: a file's bytes in 1 MiB chunks, a job's
row with its status and timestamps, and one row per line of its input with its request's body
and, once the line is done, its output or error line. A line's result is written by the one
statement that marks it done, so a server killed at any moment has lost only lines that were
not done, and does each line once. A job's counts are counted from its lines: nothing else
holds them.

Every method runs on the store's one thread (`off_loop`): commits wait for the disk, and the
event loop that serves the streams must not. A lock file keeps a second server off the same
directory, where both would run the same lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import json
import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

CHUNK_BYTES = 2**20
DATABASE = "batches.sqlite"
LOCK = "gapless.lock"

# A job's statuses, as OpenAI's Batch object names them (validating, then in_progress, then
# finalizing or cancelling); TERMINAL ones never change again.
TERMINAL = ("completed", "failed", "cancelled")
# The timestamp column each status sets when it begins.
STATUS_TIMES = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order, for lists
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,  -- the tenant that uploaded it ('' without --api-keys)
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS file_chunks (
    file_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (file_id, n)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,  -- JSON
    status TEXT NOT NULL,
    errors TEXT,  -- JSON: why the job failed as a whole
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,  -- its line number in the input file, from 1
    custom_id TEXT,
    body TEXT,  -- the request's body (JSON), to run; NULL for a line refused before it ran
    state TEXT NOT NULL,  -- pending, completed (into the output file) or failed (the error file)
    result TEXT,  -- its output or error file line, once done
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state);
"""


class DataDirError(RuntimeError):
    """--data-dir cannot be used: unwritable, or another server holds it."""


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int


@dataclass(frozen=True)
class StoredBatch:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    status: str
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    times: dict[str, int | None]  # created_at and STATUS_TIMES' columns
    counts: dict[str, int]  # total, completed, failed


@dataclass(frozen=True)
class PendingLine:
    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class CheckedLine:
    """An input line after the checks that need no engine: its request's body to run, or
    its error file line (`result`) where it was refused already."""

    line: int
    custom_id: str | None
    body: dict[str, Any] | None = None
    result: dict[str, Any] | None = None


P = ParamSpec("P")
R = TypeVar("R")


def off_loop(method: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """The method, awaited, run on its store's one thread."""

    @functools.wraps(method)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        store: BatchStore = args[0]  # type: ignore[assignment]
        return await asyncio.wrap_future(store.thread.submit(method, *args, **kwargs))

    return run


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class BatchStore:
    def __init__(self, data_dir: str | Path) -> None:
        """Opens (creating) the database under data_dir; DataDirError where it cannot, or
        where another server holds the directory."""
        path = Path(data_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._lock = open(path / LOCK, "w")  # noqa: SIM115 - held as long as the server
        except OSError as e:
            raise DataDirError(f"--data-dir {path}: {e}") from e
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._lock.close()
            raise DataDirError(
                f"--data-dir {path} is in use by another gapless server: both would run the "
                "same batch jobs' lines"
            ) from e
        self.path = path / DATABASE
        # One thread uses the connection, in autocommit mode: each transaction is explicit.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="gapless-batches")
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # WAL: readers never wait for the writer; FULL: a commit is on disk when it returns.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.row_factory = sqlite3.Row
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self.thread.submit(self._db.close).result()
        self.thread.shutdown()
        self._lock.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- files ----------------------------------------------------------------------------

    def _write_file(self, file: StoredFile, chunks: Iterable[bytes]) -> None:
        db = self._db
        for n, data in enumerate(chunks):
            db.execute("INSERT INTO file_chunks VALUES (?, ?, ?)", (file.id, n, data))
        db.execute(
            "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (file.id, file.owner, file.filename, file.purpose, file.bytes, file.created_at),
        )

    @off_loop
    def add_file(self, file: StoredFile, source: IO[bytes]) -> None:
        """Stores a file, its bytes read from `source` a chunk at a time."""
        with self._transaction():
            self._write_file(file, iter(functools.partial(source.read, CHUNK_BYTES), b""))

    @off_loop
    def file(self, file_id: str, owner: str) -> StoredFile | None:
        row = self._db.execute(
            "SELECT id, owner, filename, purpose, bytes, created_at FROM files "
            "WHERE id = ? AND owner = ?",
            (file_id, owner),
        ).fetchone()
        return None if row is None else StoredFile(**row)

    @off_loop
    def files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> list[StoredFile]:
        """Up to `limit` of the owner's files in creation order (or its reverse), those after
        the file `after` in that order."""
        ordering, beyond = ("DESC", "<") if newest_first else ("ASC", ">")
        rows = self._db.execute(
            "SELECT id, owner, filename, purpose, bytes, created_at FROM files "
            "WHERE owner = ? AND (? IS NULL OR purpose = ?) "
            f"AND (? IS NULL OR seq {beyond} (SELECT seq FROM files WHERE id = ?)) "
            f"ORDER BY seq {ordering} LIMIT ?",
            (owner, purpose, purpose, after, after, limit),
        ).fetchall()
        return [StoredFile(**row) for row in rows]

    def _chunk(self, file_id: str, n: int) -> bytes | None:
        row = self._db.execute(
            "SELECT data FROM file_chunks WHERE file_id = ? AND n = ?", (file_id, n)
        ).fetchone()
        return None if row is None else row["data"]

    @off_loop
    def chunk(self, file_id: str, n: int) -> bytes | None:
        """The file's nth chunk of its bytes; None past the last."""
        return self._chunk(file_id, n)

    @off_loop
    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._transaction():
            deleted = self._db.execute(
                "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).rowcount
            if deleted:
                self._db.execute("DELETE FROM file_chunks WHERE file_id = ?", (file_id,))
        return bool(deleted)

    # -- batch jobs -----------------------------------------------------------------------

    @off_loop
    def add_batch(
        self,
        batch_id: str,
        owner: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        created_at: int,
    ) -> None:
        self._db.execute(
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, "
            "metadata, status, created_at) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?)",
            (
                batch_id,
                owner,
                endpoint,
                input_file_id,
                completion_window,
                _dumps(metadata),
                created_at,
            ),
        )

    def _batch(self, batch_id: str, owner: str | None = None) -> StoredBatch | None:
        row = self._db.execute(
            "SELECT * FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
            (batch_id, owner, owner),
        ).fetchone()
        if row is None:
            return None
        by_state = dict(
            self._db.execute(
                "SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state", (batch_id,)
            ).fetchall()
        )
        return StoredBatch(
            id=row["id"],
            owner=row["owner"],
            endpoint=row["endpoint"],
            input_file_id=row["input_file_id"],
            completion_window=row["completion_window"],
            metadata=_loads(row["metadata"]),
            status=row["status"],
            errors=_loads(row["errors"]),
            output_file_id=row["output_file_id"],
            error_file_id=row["error_file_id"],
            times={name: row[name] for name in ("created_at", *STATUS_TIMES.values())},
            counts={
                "total": sum(by_state.values()),
                "completed": by_state.get("completed", 0),
                "failed": by_state.get("failed", 0),
            },
        )

    @off_loop
    def batch(self, batch_id: str, owner: str | None = None) -> StoredBatch | None:
        """The job; owner: only if it is that owner's."""
        return self._batch(batch_id, owner)

    @off_loop
    def batches(self, owner: str, after: str | None, limit: int) -> list[StoredBatch]:
        """Up to `limit` of the owner's jobs, newest first, those older than `after`."""
        ids = self._db.execute(
            "SELECT id FROM batches WHERE owner = ? "
            "AND (? IS NULL OR seq < (SELECT seq FROM batches WHERE id = ?)) "
            "ORDER BY seq DESC LIMIT ?",
            (owner, after, after, limit),
        ).fetchall()
        return [self._batch(row["id"]) for row in ids]  # type: ignore[misc]

    @off_loop
    def unfinished(self) -> list[str]:
        """The jobs not yet in a terminal status, oldest first: what a restart resumes."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = self._db.execute(
            f"SELECT id FROM batches WHERE status NOT IN ({marks}) ORDER BY seq", TERMINAL
        ).fetchall()
        return [row["id"] for row in rows]

    def _move(
        self, batch_id: str, status: str, now: int, only_from: tuple[str, ...], **columns: Any
    ) -> bool:
        """Moves the job to `status` (and sets `columns`) if it is in one of `only_from`."""
        sets = {"status": status, STATUS_TIMES[status]: now, **columns}
        assignments = ", ".join(f"{name} = ?" for name in sets)
        marks = ", ".join("?" * len(only_from))
        changed = self._db.execute(
            f"UPDATE batches SET {assignments} WHERE id = ? AND status IN ({marks})",
            (*sets.values(), batch_id, *only_from),
        ).rowcount
        return bool(changed)

    @off_loop
    def move(self, batch_id: str, status: str, now: int, only_from: tuple[str, ...]) -> bool:
        """Moves the job to `status` if it is in one of `only_from`; False if it was not."""
        return self._move(batch_id, status, now, only_from)

    @off_loop
    def validate(
        self, batch_id: str, file_id: str, check: Callable[[int, bytes], CheckedLine], now: int
    ) -> None:
        """Reads the input file's lines (none blank, each without its line end) a chunk at a
        time, writes each as check(line number, line) makes it, and starts the job
        (in_progress), all in one transaction; an input gone or without a line fails it."""
        with self._transaction():
            count = 0
            for number, line in _split_lines(self._chunks(file_id)):
                checked = check(number, line)
                self._db.execute(
                    "INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        batch_id,
                        number,
                        checked.custom_id,
                        _dumps(checked.body),
                        "failed" if checked.body is None else "pending",
                        _dumps(checked.result),
                    ),
                )
                count += 1
            if count:
                self._move(batch_id, "in_progress", now, ("validating",))
                return
            exists = self._db.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone()
            error = (
                {"code": "empty_file", "message": "the input file has no lines"}
                if exists
                else {"code": "file_not_found", "message": f"the input file {file_id} is gone"}
            )
            self._move(batch_id, "failed", now, ("validating",), errors=_dumps([error]))

    def _chunks(self, file_id: str) -> Iterator[bytes]:
        for n in itertools.count():
            data = self._chunk(file_id, n)
            if data is None:
                return
            yield data

    @off_loop
    def pending(self, batch_id: str, after: int, limit: int) -> list[PendingLine]:
        """Up to `limit` of the job's lines not yet done, in order, after line `after`."""
        rows = self._db.execute(
            "SELECT line, custom_id, body FROM lines WHERE batch_id = ? AND state = 'pending' "
            "AND line > ? ORDER BY line LIMIT ?",
            (batch_id, after, limit),
        ).fetchall()
        return [PendingLine(row["line"], row["custom_id"], json.loads(row["body"])) for row in rows]

    @off_loop
    def done(self, batch_id: str, line: int, succeeded: bool, result: dict[str, Any]) -> None:
        """Marks a line done with its result, in one statement: done once, written once."""
        self._db.execute(
            "UPDATE lines SET state = ?, result = ? "
            "WHERE batch_id = ? AND line = ? AND state = 'pending'",
            ("completed" if succeeded else "failed", _dumps(result), batch_id, line),
        )

    @off_loop
    def finish(self, batch_id: str, status: str, files: dict[str, StoredFile], now: int) -> None:
        """Ends a job in `status` (completed or cancelled), in one transaction: the results
        of its done lines, in line order, become its output file (`files["completed"]`) and
        its error file (`files["failed"]`), each only if it has lines."""
        with self._transaction():
            kept = {}
            for state, file in files.items():
                size = self._db.execute(
                    "SELECT SUM(LENGTH(CAST(result AS BLOB)) + 1) FROM lines "
                    "WHERE batch_id = ? AND state = ?",
                    (batch_id, state),
                ).fetchone()[0]
                if size:
                    file = dataclasses.replace(file, bytes=size)
                    self._write_file(file, _in_chunks(self._results(batch_id, state)))
                    kept[state] = file.id
            self._move(
                batch_id,
                status,
                now,
                ("finalizing", "cancelling"),
                output_file_id=kept.get("completed"),
                error_file_id=kept.get("failed"),
            )

    def _results(self, batch_id: str, state: str) -> Iterator[bytes]:
        rows = self._db.execute(
            "SELECT result FROM lines WHERE batch_id = ? AND state = ? ORDER BY line",
            (batch_id, state),
        )
        for row in rows:
            yield row["result"].encode() + b"\n"


def _split_lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for each line that is not blank; a line may span chunks."""
    number, rest = 0, b""
    for chunk in chunks:
        *whole, rest = (rest + chunk).split(b"\n")
        for line in whole:
            number += 1
            if line.strip():
                yield number, line.rstrip(b"\r")
    if rest.strip():
        yield number + 1, rest.rstrip(b"\r")


def _in_chunks(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """The pieces' bytes regrouped into chunks of CHUNK_BYTES (the last one shorter)."""
    buffer = bytearray()
    for piece in pieces:
        buffer += piece
        while len(buffer) >= CHUNK_BYTES:
            yield bytes(buffer[:CHUNK_BYTES])
            del buffer[:CHUNK_BYTES]
    if buffer:
        yield bytes(buffer)
