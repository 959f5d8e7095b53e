"""The Files and Batch APIs' shapes (pydantic), as OpenAI defines them: the file object, the
batch object with its request counts and errors, their lists, the create bodies and list
queries, and one line of a batch's input and of its output and error files.

Shapes and their bounds only: nothing here stores, runs or routes anything.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai.protocol import NonEmptyStr, RequestBody, ResponseBody

# The purpose of the files a batch job writes.
OUTPUT_PURPOSE = "batch_output"
# The urls a batch (and each of its lines) may name: those lines.py runs.
BatchEndpoint = Literal[
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"
]
COMPLETION_WINDOW_SECONDS = 24 * 3600
# The error of the lines a job's completion window left unanswered (OpenAI's code).
EXPIRED_LINE_CODE = "batch_expired"
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_FILE_LIST = 10_000
MAX_BATCH_LIST = 100
DEFAULT_BATCH_LIST = 20

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]


class FileObject(ResponseBody):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    # OpenAI's deprecated status: every stored file here is whole, hence processed.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(ResponseBody):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileUpload(RequestBody):
    """POST /v1/files, a multipart/form-data body: the file and its purpose."""

    file: bytes = Field(description="The JSONL file of requests (multipart file part)")
    purpose: Literal["batch"] = Field(description="What the file is for: a batch job's input")


class FileListQuery(RequestBody):
    """GET /v1/files' query parameters."""

    purpose: str | None = None
    limit: int = Field(MAX_FILE_LIST, ge=1, le=MAX_FILE_LIST)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


class BatchListQuery(RequestBody):
    """GET /v1/batches' query parameters."""

    limit: int = Field(DEFAULT_BATCH_LIST, ge=1, le=MAX_BATCH_LIST)
    after: str | None = None


class OutputExpiresAfter(RequestBody):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)


class BatchCreateRequest(RequestBody):
    input_file_id: NonEmptyStr
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    # Accepted as OpenAI's clients send it; output files here are kept until deleted.
    output_expires_after: OutputExpiresAfter | None = None


class RequestCounts(ResponseBody):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(ResponseBody):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(ResponseBody):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class Batch(ResponseBody):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class InputLine(BaseModel):
    """One line of a batch's input file."""

    model_config = ConfigDict(strict=True, extra="forbid")

    custom_id: NonEmptyStr
    method: Literal["POST"]
    url: NonEmptyStr
    body: dict[str, Any]


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class OutputLine(BaseModel):
    """One line of a batch's output file (a 200 answer) or error file (any other answer in
    `response`, or `error` for a line that could not be run at all)."""

    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineError | None = None
