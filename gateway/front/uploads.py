"""A file upload (POST /v1/files): a multipart/form-data body, already read within its size
limit, into the uploaded file's name and the FileUpload it makes; 415 for another media type,
413 for a file over the limit, 400 naming the part at fault.

Parsing only (Starlette's multipart parser, python-multipart): it never stores the file.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from pydantic import ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from common.errors import InvalidParameter, RequestTooLarge, UnsupportedMediaType
from gateway.batch.protocol import FileUpload

MULTIPART = "multipart/form-data"
# What a multipart body may hold besides its file: boundaries, part headers, the purpose.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
DEFAULT_FILENAME = "upload.jsonl"


async def parse_upload(headers: Headers, body: bytes, limit: int) -> tuple[str, FileUpload]:
    """The uploaded file's name and the upload; its file at most `limit` bytes."""
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != MULTIPART:
        raise UnsupportedMediaType(
            f"a file is uploaded as {MULTIPART} (file and purpose parts), got {media_type!r}"
        )

    async def chunks() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(headers, chunks(), max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidParameter(
            f"file: the multipart body cannot be read: {exc.message}", "file"
        ) from None
    try:
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise InvalidParameter("file: a file part named file is required", "file")
        content = await file.read()
        if len(content) > limit:
            raise RequestTooLarge(
                f"file: {len(content)} bytes, over the upload limit of {limit} bytes "
                "(--max-upload-mib)",
                "file",
            )
        purpose = form.get("purpose")
        if not isinstance(purpose, str):
            raise InvalidParameter("purpose: a form field named purpose is required", "purpose")
        try:
            upload = FileUpload.model_validate({"file": content, "purpose": purpose})
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0])
            raise InvalidParameter(f"{name}: {error['msg']}", name) from None
        return file.filename or DEFAULT_FILENAME, upload
    finally:
        await form.close()
