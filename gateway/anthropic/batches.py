"""Anthropic's Message Batches API (/v1/messages/batches) over the batch jobs' store and runner
(gateway/batch/): a batch's requests become a job whose input lines call /v1/messages, the job
is read back as a MessageBatch, and its output and error files as Anthropic's results.

The job runs as an OpenAI Batch API job does (the engine's batch lane, a restart resumes it,
the caller's own jobs only); its id starts with msgbatch_ and only this API lists it. Never runs
a request itself (the runner does, through batch/lines.py's /v1/messages route).
"""

from __future__ import annotations

import asyncio
import json

from common.errors import InvalidParameter, NotFound
from gateway.anthropic import protocol as aapi
from gateway.anthropic.translate import ERROR_TYPES, rfc3339
from gateway.batch.protocol import EXPIRED_LINE_CODE, Batch, OutputLine
from gateway.batch.service import BatchService
from gateway.batch.store import new_id

ID_PREFIX = "msgbatch_"
MESSAGES_URL = "/v1/messages"
# The job's statuses as the batch's processing_status; every other one has ended.
PROCESSING_STATUS = {
    "validating": "in_progress",
    "in_progress": "in_progress",
    "finalizing": "in_progress",
    "cancelling": "canceling",
}


class MessageBatches:
    """The Message Batches operations the routes call, on the gateway's batch service."""

    def __init__(self, batches: BatchService) -> None:
        self._batches = batches
        self._store = batches.store

    async def create(self, owner: str, body: aapi.MessageBatchCreateRequest) -> aapi.MessageBatch:
        seen: set[str] = set()
        for i, request in enumerate(body.requests):
            if request.custom_id in seen:
                raise InvalidParameter(
                    f"requests[{i}].custom_id: {request.custom_id!r} is used by an earlier "
                    "request of the batch",
                    "requests",
                )
            seen.add(request.custom_id)
        batch_id = new_id(ID_PREFIX)
        content = "\n".join(
            json.dumps(
                {
                    "custom_id": request.custom_id,
                    "method": "POST",
                    "url": MESSAGES_URL,
                    "body": request.params,
                }
            )
            for request in body.requests
        ).encode()
        file = await asyncio.to_thread(
            self._store.add_file, owner, f"{batch_id}.jsonl", "batch", content
        )
        batch = await self._batches.add_job(owner, batch_id, MESSAGES_URL, file.id)
        counts = aapi.MessageBatchRequestCounts(processing=len(body.requests))
        return _view(batch, counts, None)

    async def retrieve(self, owner: str, batch_id: str, base_url: str) -> aapi.MessageBatch:
        batch = await self._batch(owner, batch_id)
        return _view(batch, await self._counts(owner, batch), _results_url(batch, base_url))

    async def list_batches(
        self, owner: str, query: aapi.MessageBatchListQuery, base_url: str
    ) -> aapi.MessageBatchList:
        if query.after_id is not None and query.before_id is not None:
            raise InvalidParameter("set at most one of after_id and before_id", "before_id")
        batches, more = await asyncio.to_thread(
            self._store.batches, owner, query.limit, query.after_id, ID_PREFIX, query.before_id
        )
        views = [
            _view(batch, await self._counts(owner, batch), _results_url(batch, base_url))
            for batch in batches
        ]
        return aapi.MessageBatchList(
            data=views,
            has_more=more,
            first_id=views[0].id if views else None,
            last_id=views[-1].id if views else None,
        )

    async def cancel(self, owner: str, batch_id: str, base_url: str) -> aapi.MessageBatch:
        await self._batch(owner, batch_id)
        batch = await self._batches.cancel_batch(owner, batch_id)
        return _view(batch, await self._counts(owner, batch), _results_url(batch, base_url))

    async def delete(self, owner: str, batch_id: str) -> aapi.DeletedMessageBatch:
        batch = await self._batch(owner, batch_id)
        if batch.status in PROCESSING_STATUS:
            raise InvalidParameter(
                f"message batch {batch_id} is still processing: cancel it, and delete it once "
                "it has ended",
                "message_batch_id",
            )
        await asyncio.to_thread(self._store.delete_batch, owner, batch_id)
        return aapi.DeletedMessageBatch(id=batch_id)

    async def results(self, owner: str, batch_id: str) -> bytes:
        """The results file (JSONL, in the requests' order), once the batch has ended."""
        batch = await self._batch(owner, batch_id)
        if batch.status in PROCESSING_STATUS:
            raise InvalidParameter(
                f"message batch {batch_id} is still processing: its results come once it has ended",
                "message_batch_id",
            )
        lines = await self._results(owner, batch)
        return b"".join(line.model_dump_json().encode() + b"\n" for line in lines)

    async def _batch(self, owner: str, batch_id: str) -> Batch:
        batch = None
        if batch_id.startswith(ID_PREFIX):
            batch = await asyncio.to_thread(self._store.batch, owner, batch_id)
        if batch is None:
            raise NotFound(
                f"message_batch_id: no message batch {batch_id} (for this API key)",
                "message_batch_id",
            )
        return batch

    async def _counts(self, owner: str, batch: Batch) -> aapi.MessageBatchRequestCounts:
        counts = batch.request_counts
        if batch.status == "validating":  # its lines are not counted yet
            content = await self._file(owner, batch.input_file_id)
            return aapi.MessageBatchRequestCounts(processing=content.count(b"\n") + 1)
        if batch.status in PROCESSING_STATUS:
            return aapi.MessageBatchRequestCounts(
                processing=counts.total - counts.completed - counts.failed,
                succeeded=counts.completed,
                errored=counts.failed,
            )
        tally = aapi.MessageBatchRequestCounts()
        for line in await self._results(owner, batch):
            setattr(tally, line.result.type, getattr(tally, line.result.type) + 1)
        return tally

    async def _results(self, owner: str, batch: Batch) -> list[aapi.BatchResultLine]:
        """Each request's result, in the requests' order: the answered ones from the job's
        output and error files; the rest canceled (or errored with the job's error, if the job
        failed)."""
        answered: dict[str, aapi.BatchResult] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id is None:
                continue
            for raw in (await self._file(owner, file_id)).splitlines():
                line = OutputLine.model_validate_json(raw)
                if line.custom_id is not None:
                    answered[line.custom_id] = _result(line)
        failed = None
        if batch.status == "failed" and batch.errors is not None and batch.errors.data:
            failed = _error("api_error", batch.errors.data[0].message or "the batch failed")
        out = []
        for raw in (await self._file(owner, batch.input_file_id)).splitlines():
            custom_id = json.loads(raw)["custom_id"]
            result = answered.get(custom_id) or aapi.BatchResult(
                type="canceled" if failed is None else "errored", error=failed
            )
            out.append(aapi.BatchResultLine(custom_id=custom_id, result=result))
        return out

    async def _file(self, owner: str, file_id: str) -> bytes:
        return await asyncio.to_thread(self._store.file_content, owner, file_id) or b""


def _result(line: OutputLine) -> aapi.BatchResult:
    """An answered line as Anthropic's result: its Message, or its error."""
    if line.response is not None and line.response.status_code == 200:
        return aapi.BatchResult(type="succeeded", message=line.response.body)
    if line.error is not None:
        if line.error.code == EXPIRED_LINE_CODE:
            return aapi.BatchResult(type="expired")
        return aapi.BatchResult(
            type="errored", error=_error("invalid_request_error", line.error.message)
        )
    assert line.response is not None  # an error line has one or the other
    status, body = line.response.status_code, line.response.body
    message = body.get("error", {}).get("message", f"the request failed with status {status}")
    return aapi.BatchResult(
        type="errored", error=_error(ERROR_TYPES.get(status, "api_error"), message)
    )


def _error(kind: str, message: str) -> aapi.MessagesErrorResponse:
    return aapi.MessagesErrorResponse(error=aapi.MessagesError(type=kind, message=message))


def _view(
    batch: Batch, counts: aapi.MessageBatchRequestCounts, results_url: str | None
) -> aapi.MessageBatch:
    ended = batch.completed_at or batch.failed_at or batch.cancelled_at or batch.expired_at
    return aapi.MessageBatch(
        id=batch.id,
        processing_status=PROCESSING_STATUS.get(batch.status, "ended"),  # type: ignore[arg-type]
        request_counts=counts,
        created_at=rfc3339(batch.created_at),
        expires_at=rfc3339(batch.expires_at or batch.created_at),
        ended_at=rfc3339(ended) if batch.status not in PROCESSING_STATUS and ended else None,
        cancel_initiated_at=rfc3339(batch.cancelling_at) if batch.cancelling_at else None,
        results_url=results_url,
    )


def _results_url(batch: Batch, base_url: str) -> str | None:
    if batch.status in PROCESSING_STATUS:
        return None
    return f"{base_url.rstrip('/')}{MESSAGES_URL}/batches/{batch.id}/results"
