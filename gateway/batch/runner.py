"""Runs batch jobs in the background of a gateway process: claims an unfinished job from the
store (its lease), reads its input file into lines (validating -> in_progress), runs the lines
waiting for an answer a few at a time, records each answer as it comes, and writes the output
and error files (finalizing -> completed; cancelled or expired when so).

Every gateway process (each of --workers N; a restarted one) runs one: the lease decides which
runs a job, and a job whose holder died or stopped is taken over where it was (the lines already
answered are not run again). While it runs a job the runner renews the lease every
RENEW_SECONDS, which is also when it sees a cancel or the completion window's end. Stopping (the
gateway draining) starts no more lines, lets those in flight finish for the drain time, then
gives the lease up. A line that meets a passing failure (the engine unavailable, its queue full)
waits and is tried again; any other failure is that line's answer.

Scheduling of jobs and lines only: the answers come from lines.py, storage from store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, ParamSpec, TypeVar

from common.errors import QueueFullError, UnavailableError
from gateway.batch import lines as batch_lines
from gateway.batch.protocol import (
    EXPIRED_LINE_CODE,
    BatchError,
    BatchErrors,
    LineError,
    OutputLine,
)
from gateway.batch.store import BatchStore, Holder, LeaseLost, Line

logger = logging.getLogger(__name__)

# How often a running job's lease is renewed, and its cancel (made through another process)
# and expiry looked at.
RENEW_SECONDS = 2.0
# How often an idle runner looks for jobs other processes left or created (its own process's
# new jobs wake it at once).
POLL_SECONDS = 5.0
# How long a line that met a passing failure waits before it is tried again.
RETRY_SECONDS = 1.0

P = ParamSpec("P")
T = TypeVar("T")
Answer = Callable[[str, Line], Awaitable[tuple[bool, OutputLine]]]
Stop = Literal["done", "cancelling", "expired", "stopping"]


async def _db(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """A store call (or other blocking work), in a thread: SQLite blocks (a busy database waits
    for its lock)."""
    return await asyncio.to_thread(call, *args, **kwargs)


@dataclass
class _Pass:
    """One pass over a job's waiting lines: why it stopped, and whether a line must wait."""

    stop: Stop | None = None
    retry: bool = False


class BatchRunner:
    def __init__(self, store: BatchStore, answer: Answer, concurrency: int) -> None:
        """`answer(owner, line)`: a line's answer (lines.answer with the gateway bound)."""
        self._store = store
        self._answer = answer
        self._concurrency = concurrency
        self.holder = Holder()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._current: str | None = None  # the job this runner holds

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        """Look for jobs now (one was just created or cancelled here)."""
        self._wake.set()

    async def stop(self, grace: float) -> None:
        """Start no more lines; let those in flight finish for up to `grace` seconds, then
        abort them; give the lease up."""
        self._stopping = True
        self._wake.set()
        task = self._task
        if task is None:
            return
        await asyncio.wait({task}, timeout=grace)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._current is not None:
            self._store.release(self._current, self.holder)
            self._current = None

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            batch_id = await _db(self._store.claim, self.holder)
            if batch_id is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_SECONDS)
                continue
            self._current = batch_id
            try:
                await self._run(batch_id)
            except LeaseLost:
                logger.warning("batch %s: another process took it over", batch_id)
            except Exception:
                logger.exception("batch %s: running it failed; it waits for a later try", batch_id)
                await _db(self._store.release, batch_id, self.holder)
                await asyncio.sleep(POLL_SECONDS)
            else:
                if self._stopping:
                    await _db(self._store.release, batch_id, self.holder)
            self._current = None

    async def _run(self, batch_id: str) -> None:
        store, holder = self._store, self.holder
        batch, owner = await _db(store.leased_batch, batch_id, holder)
        if batch.status == "validating":
            content = await _db(store.input_content, batch_id, holder)
            # Reading a large file takes a while: in a thread, as the store calls.
            read = [] if content is None else await _db(batch_lines.read_input, content)
            if not read:
                code, message = (
                    ("file_not_found", f"input file {batch.input_file_id} was deleted")
                    if content is None
                    else ("empty_file", f"input file {batch.input_file_id} has no request")
                )
                error = BatchError(code=code, message=message, param="input_file_id")
                await _db(store.fail, batch_id, holder, BatchErrors(data=[error]))
                return
            batch = await _db(store.start, batch_id, holder, read)
        stop: Stop = "done"
        if batch.status == "in_progress":
            stop = await self._run_lines(batch_id, owner)
        elif batch.status == "cancelling":
            stop = "cancelling"
        if stop == "stopping":
            return
        if stop == "cancelling":
            await _db(store.finish, batch_id, holder, "cancelled", None)
        elif stop == "expired":
            expired = LineError(
                code=EXPIRED_LINE_CODE, message="the batch's completion window ended first"
            )
            await _db(store.finish, batch_id, holder, "expired", expired)
        else:
            await _db(store.set_status, batch_id, holder, "finalizing")
            await _db(store.finish, batch_id, holder, "completed", None)

    async def _run_lines(self, batch_id: str, owner: str) -> Stop:
        """Run the job's waiting lines until none is left (`done`), or until it is cancelled,
        expires or this runner stops."""
        while True:
            waiting = await _db(self._store.waiting_lines, batch_id)
            if not waiting:
                return "done"
            state = await self._pass(batch_id, owner, waiting)
            if state.stop is not None:
                return state.stop
            if state.retry:
                await asyncio.sleep(RETRY_SECONDS)

    async def _pass(self, batch_id: str, owner: str, waiting: list[Line]) -> _Pass:
        store, holder = self._store, self.holder
        state = _Pass()
        queue = iter(waiting)

        async def work() -> None:
            for line in queue:
                if self._stopping or state.stop is not None:
                    return
                if not await _db(store.start_line, batch_id, holder, line.line):
                    continue
                try:
                    ok, result = await self._answer(owner, line)
                except (UnavailableError, QueueFullError) as exc:
                    logger.info("batch %s line %d: %s; tried again later", batch_id, line.line, exc)
                    await _db(store.retry_line, batch_id, holder, line.line)
                    state.retry = True
                    return
                await _db(store.finish_line, batch_id, holder, line.line, ok, result)

        workers = [asyncio.create_task(work()) for _ in range(self._concurrency)]
        watch = asyncio.create_task(self._watch(batch_id, state, workers))
        try:
            await asyncio.wait(workers)
        finally:
            watch.cancel()
            for worker in workers:
                worker.cancel()
            await asyncio.gather(watch, *workers, return_exceptions=True)
        for task in (*workers, watch):
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if self._stopping and state.stop is None:
            state.stop = "stopping"
        return state

    async def _watch(self, batch_id: str, state: _Pass, workers: list[asyncio.Task[None]]) -> None:
        """Renew the lease while the lines run; end them when the job is cancelled or its
        window ends."""
        while True:
            # A cancel made through this process wakes it at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RENEW_SECONDS)
            self._wake.clear()
            try:
                batch = await _db(self._store.renew, batch_id, self.holder)
            except LeaseLost:  # another process runs the job now: this one stops at once
                for worker in workers:
                    worker.cancel()
                raise
            if batch.status == "cancelling":
                state.stop = "cancelling"
            elif batch.expires_at is not None and time.time() > batch.expires_at:
                state.stop = "expired"
            else:
                continue
            for worker in workers:
                worker.cancel()
            return
