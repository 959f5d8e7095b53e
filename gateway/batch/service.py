"""The Files and Batch APIs as the HTTP routes call them: each operation checks its input
(400 naming the parameter, 404 for what the caller does not own), reads or writes the store
under the caller's owner (in a thread: SQLite blocks), and wakes the runner for new or cancelled
jobs.

One per gateway process, with its store and runner; it never parses HTTP (front/app.py and
front/uploads.py do, the upload's size limit included) and never runs a line (runner.py does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from common.config import GatewayConfig, default_batch_dir
from common.errors import InvalidParameter, NotFound
from gateway.batch import lines
from gateway.batch.protocol import (
    COMPLETION_WINDOW_SECONDS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    Batch,
    BatchCreateRequest,
    BatchList,
    BatchListQuery,
    FileDeleted,
    FileList,
    FileListQuery,
    FileObject,
    FileUpload,
    OutputLine,
)
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore, Line, new_id
from gateway.pipeline.generation import Gateway

# The ids of the OpenAI Batch API's jobs (the Message Batches API's have their own).
OPENAI_BATCH_PREFIX = "batch_"
QueryT = TypeVar("QueryT", bound=BaseModel)
PageT = TypeVar("PageT", FileList, BatchList)
MIB = 1024 * 1024


def parse_query(model: type[QueryT], params: Mapping[str, str]) -> QueryT:
    """A list's query parameters (strings, converted: limit=10 is a number); InvalidParameter
    naming the first one at fault. Parameters it does not know are ignored."""
    try:
        return model.model_validate(dict(params), strict=False)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else None
        raise InvalidParameter(f"{name}: {error['msg']}", name) from None


class BatchService:
    def __init__(self, gateway: Gateway, config: GatewayConfig) -> None:
        self.store = BatchStore(Path(config.batch_dir) if config.batch_dir else default_batch_dir())
        self.max_upload_bytes = int(config.max_upload_mib * MIB)
        context = lines.LineContext(gateway, config)

        async def answer(owner: str, line: Line) -> tuple[bool, OutputLine]:
            return await lines.answer(context, owner, line)

        self.runner = BatchRunner(self.store, answer, config.batch_concurrency)

    def start(self) -> None:
        self.runner.start()

    async def stop(self, grace: float) -> None:
        """Stop running jobs (what runs gets `grace` seconds to finish); the routes still
        answer until close()."""
        await self.runner.stop(grace)

    def close(self) -> None:
        self.store.close()

    # -- files ----------------------------------------------------------------------------------

    async def create_file(self, owner: str, filename: str, upload: FileUpload) -> FileObject:
        """Store an upload (front/uploads.py read it within max_upload_bytes)."""
        return await asyncio.to_thread(
            self.store.add_file, owner, filename, upload.purpose, upload.file
        )

    async def file(self, owner: str, file_id: str) -> FileObject:
        file = await asyncio.to_thread(self.store.file, owner, file_id)
        if file is None:
            raise _no_file(file_id)
        return file

    async def files(self, owner: str, query: FileListQuery) -> FileList:
        files, more = await asyncio.to_thread(
            self.store.files, owner, query.purpose, query.limit, query.order == "asc", query.after
        )
        return _page(FileList, files, more)

    async def file_content(self, owner: str, file_id: str) -> bytes:
        content = await asyncio.to_thread(self.store.file_content, owner, file_id)
        if content is None:
            raise _no_file(file_id)
        return content

    async def delete_file(self, owner: str, file_id: str) -> FileDeleted:
        if not await asyncio.to_thread(self.store.delete_file, owner, file_id):
            raise _no_file(file_id)
        return FileDeleted(id=file_id)

    # -- batches --------------------------------------------------------------------------------

    async def create_batch(self, owner: str, body: BatchCreateRequest) -> Batch:
        _check_metadata(body.metadata)
        file = await asyncio.to_thread(self.store.file, owner, body.input_file_id)
        if file is None:
            raise NotFound(
                f"input_file_id: no file {body.input_file_id} (for this API key)", "input_file_id"
            )
        if file.purpose != "batch":
            raise InvalidParameter(
                f"input_file_id: file {file.id} was uploaded with purpose {file.purpose!r}, "
                "not 'batch'",
                "input_file_id",
            )
        batch_id = new_id(OPENAI_BATCH_PREFIX)
        return await self.add_job(owner, batch_id, body.endpoint, file.id, body.metadata)

    async def add_job(
        self,
        owner: str,
        batch_id: str,
        endpoint: str,
        input_file_id: str,
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        """A job over a stored input file: validating until a runner (woken now) claims it;
        24 hours to finish."""
        now = int(time.time())
        batch = Batch(
            id=batch_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window="24h",
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_SECONDS,
            metadata=metadata,
        )
        await asyncio.to_thread(self.store.add_batch, owner, batch)
        self.runner.wake()
        return batch

    async def batch(self, owner: str, batch_id: str) -> Batch:
        batch = await asyncio.to_thread(self.store.batch, owner, batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    async def batches(self, owner: str, query: BatchListQuery) -> BatchList:
        batches, more = await asyncio.to_thread(
            self.store.batches, owner, query.limit, query.after, OPENAI_BATCH_PREFIX
        )
        return _page(BatchList, batches, more)

    async def cancel_batch(self, owner: str, batch_id: str) -> Batch:
        batch = await asyncio.to_thread(self.store.cancel, owner, batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        self.runner.wake()
        return batch


def _page(kind: type[PageT], items: list[Any], more: bool) -> PageT:
    """One page of a list: its objects, the first and last ids (cursors), whether more follow."""
    return kind(
        data=items,
        first_id=items[0].id if items else None,
        last_id=items[-1].id if items else None,
        has_more=more,
    )


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"file_id: no file {file_id} (for this API key)", "file_id")


def _no_batch(batch_id: str) -> NotFound:
    return NotFound(f"batch_id: no batch {batch_id} (for this API key)", "batch_id")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameter(
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidParameter(
                f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}; {key[:MAX_METADATA_KEY]!r} is over",
                "metadata",
            )
