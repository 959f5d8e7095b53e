"""The batch jobs' SQLite database (the standard library's sqlite3, one file): uploaded and
written files with their contents, batch jobs, and every line of a job with its result once
answered, so that a gateway that stops or dies resumes its jobs where they were.

Several processes share one database (a gateway's workers; a gateway started again on the same
--batch-dir): a job is run by the one process holding its lease, which it claims, renews and
releases in transactions, and which another process may take only once it has run out or its
holder's process has died. A line moves pending -> running -> done, each step checked against
the lease in the same transaction, so no two processes run a line at once and its result is
recorded once. What a caller stores is kept under its owner (an API key's digest), and every
read names the owner: another owner's files and jobs do not exist for it.

Storage only: it never runs a line and never decides what a request means. Its methods block
(the callers run them in a thread); one connection, used under a lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.batch.protocol import (
    OUTPUT_PURPOSE,
    Batch,
    BatchErrors,
    BatchStatus,
    FileObject,
    LineError,
    OutputLine,
)
from gateway.json_lines import one_line

DATABASE_NAME = "batches.sqlite3"
# The statuses of a job some process still has to carry on.
UNFINISHED: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
# How long a lease lasts unless renewed; its holder renews it far more often (runner.py).
LEASE_SECONDS = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    object TEXT NOT NULL,
    lease_holder TEXT,
    lease_pid INTEGER,
    lease_host TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT,
    url TEXT,
    body TEXT,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    ok INTEGER,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state);
"""


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: one runner of one process on one host."""

    name: str = field(default_factory=lambda: new_id("runner-"))
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)


@dataclass(frozen=True)
class Line:
    """A line of a job waiting for its answer: what to call, with what."""

    line: int  # its number in the input file, from 1
    custom_id: str
    url: str
    body: str  # the request body's JSON


@dataclass(frozen=True)
class ReadLine:
    """A line of an input file as validation read it: to run (`body` set), or already
    answered (`result`, when it could not be read or run)."""

    line: int
    custom_id: str | None
    url: str | None = None
    body: str | None = None
    result: OutputLine | None = None


@dataclass(frozen=True)
class Page:
    """One page of a list: its objects and whether more follow."""

    ids: list[str]
    has_more: bool


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds that number now: alive, to be safe
    return True


class LeaseLost(Exception):
    """This process no longer holds the job's lease: another one runs it now."""


class BatchStore:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / DATABASE_NAME
        self._lock = threading.Lock()
        # isolation_level None: transactions are begun here, explicitly (BEGIN IMMEDIATE
        # takes the write lock at once, so two processes never both read then write).
        self._db = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        # WAL: readers never wait for the writer; NORMAL: a commit survives a crash of the
        # process (what a restart needs), only a power loss may take its last commits.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- files ----------------------------------------------------------------------------------

    def add_file(self, owner: str, filename: str, purpose: str, content: bytes) -> FileObject:
        with self._transaction() as db:
            return self._add_file(db, owner, filename, purpose, content)

    def _add_file(
        self, db: sqlite3.Connection, owner: str, filename: str, purpose: str, content: bytes
    ) -> FileObject:
        file = FileObject(
            id=new_id("file-"),
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        db.execute(
            "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file.id, owner, filename, purpose, file.bytes, file.created_at, content),
        )
        return file

    def file(self, owner: str, file_id: str) -> FileObject | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, bytes, created_at, filename, purpose FROM files "
                "WHERE id = ? AND owner = ?",
                (file_id, owner),
            ).fetchone()
        return None if row is None else _file_object(row)

    def files(
        self, owner: str, purpose: str | None, limit: int, ascending: bool, after: str | None
    ) -> tuple[list[FileObject], bool]:
        where, args = "owner = ?", [owner]
        if purpose is not None:
            where += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            where += f" AND seq {'>' if ascending else '<'} "
            where += "(SELECT seq FROM files WHERE id = ? AND owner = ?)"
            args += [after, owner]
        with self._lock:
            rows = self._db.execute(
                "SELECT id, bytes, created_at, filename, purpose FROM files "
                f"WHERE {where} ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        return [_file_object(row) for row in rows[:limit]], len(rows) > limit

    def file_content(self, owner: str, file_id: str) -> bytes | None:
        with self._lock:
            row = self._db.execute(
                "SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute(
                "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).rowcount
        return deleted > 0

    # -- batches, as their owners see them ------------------------------------------------------

    def add_batch(self, owner: str, batch: Batch) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, owner, status, object) VALUES (?, ?, ?, ?)",
                (batch.id, owner, batch.status, batch.model_dump_json()),
            )

    def batch(self, owner: str, batch_id: str) -> Batch | None:
        with self._lock:
            row = self._db.execute(
                "SELECT object FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
        return None if row is None else Batch.model_validate_json(row[0])

    def batches(
        self,
        owner: str,
        limit: int,
        after: str | None,
        id_prefix: str,
        before: str | None = None,
    ) -> tuple[list[Batch], bool]:
        """A page of the owner's jobs whose ids start with `id_prefix` (each API's own), newest
        first: the `limit` older than `after`, or the `limit` just newer than `before`; and
        whether more follow in that direction."""
        where, args = "owner = ? AND substr(id, 1, ?) = ?", [owner, len(id_prefix), id_prefix]
        cursor, newer = (before, True) if before is not None else (after, False)
        if cursor is not None:
            where += f" AND seq {'>' if newer else '<'} "
            where += "(SELECT seq FROM batches WHERE id = ? AND owner = ?)"
            args += [cursor, owner]
        with self._lock:
            rows = self._db.execute(
                f"SELECT object FROM batches WHERE {where} "
                f"ORDER BY seq {'ASC' if newer else 'DESC'} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        page = [Batch.model_validate_json(row[0]) for row in rows[:limit]]
        return (page[::-1] if newer else page), len(rows) > limit

    def delete_batch(self, owner: str, batch_id: str) -> bool:
        """Forget an ended job: its lines, its input, output and error files and itself."""
        with self._transaction() as db:
            batch = _owned_batch(db, owner, batch_id)
            if batch is None:
                return False
            files = (batch.input_file_id, batch.output_file_id, batch.error_file_id)
            db.executemany(
                "DELETE FROM files WHERE id = ? AND owner = ?",
                [(file_id, owner) for file_id in files if file_id is not None],
            )
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
        return True

    def cancel(self, owner: str, batch_id: str) -> Batch | None:
        """Mark a validating or in-progress job cancelling (its runner ends it); a job past
        those is returned as it is. None: no such job for this owner."""
        with self._transaction() as db:
            batch = _owned_batch(db, owner, batch_id)
            if batch is not None and batch.status in ("validating", "in_progress"):
                batch.status = "cancelling"
                batch.cancelling_at = int(time.time())
                _save(db, batch)
        return batch

    # -- running jobs ---------------------------------------------------------------------------

    def claim(self, holder: Holder) -> str | None:
        """An unfinished job no live process holds, now leased to `holder` (its lines left
        running by the last holder waiting again); None when there is none."""
        now = time.time()
        with self._transaction() as db:
            rows = db.execute(
                "SELECT id, lease_holder, lease_pid, lease_host, lease_until FROM batches "
                f"WHERE status IN ({', '.join('?' * len(UNFINISHED))}) ORDER BY seq",
                UNFINISHED,
            ).fetchall()
            for batch_id, lease_holder, pid, host, until in rows:
                free = (
                    lease_holder is None
                    or until < now
                    or (host == holder.host and pid != holder.pid and not _alive(pid))
                )
                if not free:
                    continue
                db.execute(
                    "UPDATE batches SET lease_holder = ?, lease_pid = ?, lease_host = ?, "
                    "lease_until = ? WHERE id = ?",
                    (holder.name, holder.pid, holder.host, now + LEASE_SECONDS, batch_id),
                )
                db.execute(
                    "UPDATE lines SET state = 'pending' WHERE batch_id = ? AND state = 'running'",
                    (batch_id,),
                )
                return str(batch_id)
        return None

    def renew(self, batch_id: str, holder: Holder) -> Batch:
        """Extend the lease; the job as it is now (a cancel shows here). LeaseLost if another
        process holds it."""
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            db.execute(
                "UPDATE batches SET lease_until = ? WHERE id = ?",
                (time.time() + LEASE_SECONDS, batch_id),
            )
        return batch

    def release(self, batch_id: str, holder: Holder) -> None:
        """Give the lease up (a stopping gateway): its running lines wait again."""
        with self._transaction() as db:
            updated = db.execute(
                "UPDATE batches SET lease_holder = NULL, lease_pid = NULL, lease_host = NULL, "
                "lease_until = NULL WHERE id = ? AND lease_holder = ?",
                (batch_id, holder.name),
            ).rowcount
            if updated:
                db.execute(
                    "UPDATE lines SET state = 'pending' WHERE batch_id = ? AND state = 'running'",
                    (batch_id,),
                )

    def leased_batch(self, batch_id: str, holder: Holder) -> tuple[Batch, str]:
        """The job `holder` runs and its owner."""
        with self._lock:
            batch = _leased(self._db, batch_id, holder)
            row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return batch, str(row[0])

    def input_content(self, batch_id: str, holder: Holder) -> bytes | None:
        """The content of the job's input file; None if it was deleted."""
        batch, owner = self.leased_batch(batch_id, holder)
        return self.file_content(owner, batch.input_file_id)

    def start(self, batch_id: str, holder: Holder, lines: Sequence[ReadLine]) -> Batch:
        """The validated job in progress: its lines stored, those already answered counted."""
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            if batch.status != "validating":
                return batch  # cancelled meanwhile
            db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, url, body, state, ok, result) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
                [
                    (
                        batch_id,
                        line.line,
                        line.custom_id,
                        line.url,
                        line.body,
                        "pending" if line.result is None else "done",
                        None if line.result is None else line.result.model_dump_json(),
                    )
                    for line in lines
                ],
            )
            batch.status = "in_progress"
            batch.in_progress_at = int(time.time())
            batch.request_counts.total = len(lines)
            batch.request_counts.failed = sum(line.result is not None for line in lines)
            _save(db, batch)
        return batch

    def fail(self, batch_id: str, holder: Holder, errors: BatchErrors) -> None:
        """The job failed validation as a whole (no line was run)."""
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            batch.status = "failed"
            batch.failed_at = int(time.time())
            batch.errors = errors
            _save(db, batch, release=True)

    def waiting_lines(self, batch_id: str) -> list[Line]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line, custom_id, url, body FROM lines "
                "WHERE batch_id = ? AND state = 'pending' ORDER BY line",
                (batch_id,),
            ).fetchall()
        return [Line(*row) for row in rows]

    def start_line(self, batch_id: str, holder: Holder, line: int) -> bool:
        """Mark a waiting line running (one more attempt); False if it is not waiting."""
        with self._transaction() as db:
            _leased(db, batch_id, holder)
            return (
                db.execute(
                    "UPDATE lines SET state = 'running', attempts = attempts + 1 "
                    "WHERE batch_id = ? AND line = ? AND state = 'pending'",
                    (batch_id, line),
                ).rowcount
                > 0
            )

    def finish_line(
        self, batch_id: str, holder: Holder, line: int, ok: bool, result: OutputLine
    ) -> None:
        """Record a running line's answer and count it."""
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            done = db.execute(
                "UPDATE lines SET state = 'done', ok = ?, result = ? "
                "WHERE batch_id = ? AND line = ? AND state = 'running'",
                (int(ok), result.model_dump_json(), batch_id, line),
            ).rowcount
            if not done:
                return
            if ok:
                batch.request_counts.completed += 1
            else:
                batch.request_counts.failed += 1
            _save(db, batch)

    def retry_line(self, batch_id: str, holder: Holder, line: int) -> None:
        """A running line waits again (it met a passing failure: the engine restarting)."""
        with self._transaction() as db:
            _leased(db, batch_id, holder)
            db.execute(
                "UPDATE lines SET state = 'pending' "
                "WHERE batch_id = ? AND line = ? AND state = 'running'",
                (batch_id, line),
            )

    def set_status(self, batch_id: str, holder: Holder, status: BatchStatus) -> Batch:
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            batch.status = status
            setattr(batch, f"{status}_at", int(time.time()))
            _save(db, batch)
        return batch

    def finish(
        self, batch_id: str, holder: Holder, status: BatchStatus, unanswered: LineError | None
    ) -> Batch:
        """End the job with `status`: its output file (lines answered 200) and error file (the
        others) written in input order, each only if it has a line; with `unanswered` (the job
        expired), every line not answered yet goes to the error file with that error."""
        with self._transaction() as db:
            batch = _leased(db, batch_id, holder)
            owner = db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
            outputs: list[str] = []
            errors: list[str] = []
            for ok, result, custom_id in db.execute(
                "SELECT ok, result, custom_id FROM lines WHERE batch_id = ? ORDER BY line",
                (batch_id,),
            ):
                if result is not None:
                    (outputs if ok else errors).append(result)
                elif unanswered is not None:
                    line = OutputLine(
                        id=new_id("batch_req_"), custom_id=custom_id, error=unanswered
                    )
                    errors.append(line.model_dump_json())
                    batch.request_counts.failed += 1
            for lines, attribute in ((outputs, "output_file_id"), (errors, "error_file_id")):
                if lines:
                    content = b"".join(one_line(line.encode()) + b"\n" for line in lines)
                    name = f"{batch_id}_{attribute.split('_')[0]}.jsonl"
                    file = self._add_file(db, owner, name, OUTPUT_PURPOSE, content)
                    setattr(batch, attribute, file.id)
            batch.status = status
            setattr(batch, f"{status}_at", int(time.time()))
            _save(db, batch, release=True)
        return batch

    def attempts(self, batch_id: str) -> dict[int, int]:
        """How many times each line of a job was started (what a restart must not repeat)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT line, attempts FROM lines WHERE batch_id = ?", (batch_id,)
            ).fetchall()
        return dict(rows)


def _file_object(row: tuple[str, int, int, str, str]) -> FileObject:
    file_id, size, created_at, filename, purpose = row
    return FileObject(
        id=file_id, bytes=size, created_at=created_at, filename=filename, purpose=purpose
    )


def _owned_batch(db: sqlite3.Connection, owner: str, batch_id: str) -> Batch | None:
    row = db.execute(
        "SELECT object FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
    ).fetchone()
    return None if row is None else Batch.model_validate_json(row[0])


def _leased(db: sqlite3.Connection, batch_id: str, holder: Holder) -> Batch:
    row = db.execute(
        "SELECT object, lease_holder FROM batches WHERE id = ?", (batch_id,)
    ).fetchone()
    if row is None or row[1] != holder.name:
        raise LeaseLost(f"batch {batch_id} is no longer leased to this process")
    return Batch.model_validate_json(row[0])


def _save(db: sqlite3.Connection, batch: Batch, release: bool = False) -> None:
    lease = ", lease_holder = NULL, lease_until = NULL" if release else ""
    db.execute(
        f"UPDATE batches SET status = ?, object = ?{lease} WHERE id = ?",
        (batch.status, batch.model_dump_json(), batch.id),
    )
