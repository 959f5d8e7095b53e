"""Batch jobs through the real openai client (files and batches APIs) against the real gateway
and engine with the default model: a job of chat, text completion and embedding lines answers
each line as its endpoint answers the same greedy request; malformed lines, unknown urls and
refused requests fail alone, in the error file; the Files API's list, content, delete; bad
parameters (400 / 404 naming them, 413 over --max-upload-mib); two API keys never see each
other's files or jobs; a cancel, or the end of the job's window, ends it with what it answered;
two gateways on one database run each line once."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.batch.store import DATABASE_NAME, BatchStore
from gateway_helpers import check_error, start_gateway

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("batch-key-a", "batch-key-b")
UPLOAD_LIMIT_MIB = 0.01  # 10 KiB
WAIT_SECONDS = 300.0
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
TEXT = {"prompt": "The capital of France is", "max_tokens": 8}


def jsonl(lines: list[object]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def request_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_done(client: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while (batch := client.batches.retrieve(batch_id)).status not in (
        "completed",
        "failed",
        "cancelled",
        "expired",
    ):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)
    return batch


def read_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    """A batch output or error file, by custom_id (the unreadable line's under None)."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {line["custom_id"]: line for line in lines}


def run_job(client: openai.OpenAI, lines: list[object], endpoint="/v1/chat/completions"):
    file = client.files.create(file=("job.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating"
    return wait_done(client, batch.id)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def keyed(services):
    """A gateway with two API keys, a small upload limit and one batch line at a time."""
    server = start_gateway(
        services, api_keys=KEYS, max_upload_mib=UPLOAD_LIMIT_MIB, batch_concurrency=1
    )
    yield server
    server.close()


def keyed_client(keyed, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)


def test_a_job_answers_each_line_as_its_endpoint_does(client):
    chat_greedy = {**CHAT, "temperature": 0}
    text_greedy = {**TEXT, "temperature": 0}
    responses_greedy = {"input": "Name a colour.", "max_output_tokens": 6, "temperature": 0}
    lines = [
        request_line("chat-1", "/v1/chat/completions", chat_greedy),
        request_line("text-1", "/v1/completions", text_greedy),
        b'{"custom_id": "broken", "method": "POST", ',
        request_line("nowhere", "/v1/images/generations", {"prompt": "a cat"}),
        request_line("refused", "/v1/completions", {**TEXT, "max_tokens": -1}),
        request_line("chat-2", "/v1/chat/completions", {**chat_greedy, "max_tokens": 4}),
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        request_line("chat-1", "/v1/chat/completions", chat_greedy),  # a used custom_id
        request_line("embed-1", "/v1/embeddings", {"input": ["a red fox", "a blue whale"]}),
        request_line("resp-1", "/v1/responses", responses_greedy),
    ]
    batch = run_job(client, lines)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 10
    assert batch.request_counts.completed == 5
    assert batch.request_counts.failed == 5
    assert batch.completed_at is not None and batch.in_progress_at is not None

    outputs = read_lines(client, batch.output_file_id)
    assert set(outputs) == {"chat-1", "text-1", "chat-2", "embed-1", "resp-1"}
    for line in outputs.values():
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
    chat = client.chat.completions.create(model=MODEL, **chat_greedy)
    text = client.completions.create(model=MODEL, **text_greedy)
    short = client.chat.completions.create(model=MODEL, **{**chat_greedy, "max_tokens": 4})
    answered = outputs["chat-1"]["response"]["body"]
    assert answered["object"] == "chat.completion"
    assert answered["choices"][0]["message"]["content"] == chat.choices[0].message.content
    assert answered["usage"]["completion_tokens"] == chat.usage.completion_tokens
    assert outputs["text-1"]["response"]["body"]["choices"][0]["text"] == text.choices[0].text
    chat_2 = outputs["chat-2"]["response"]["body"]["choices"][0]["message"]["content"]
    assert chat_2 == short.choices[0].message.content
    response = outputs["resp-1"]["response"]["body"]
    asked = client.responses.create(model=MODEL, **responses_greedy)
    assert response["object"] == "response" and response["status"] == asked.status
    assert response["output"][0]["content"][0]["text"] == asked.output_text
    assert response["usage"]["output_tokens"] == asked.usage.output_tokens
    embedded = client.embeddings.create(model=MODEL, input=["a red fox", "a blue whale"])
    vectors = outputs["embed-1"]["response"]["body"]["data"]
    assert [v["index"] for v in vectors] == [0, 1]
    for line, direct in zip(vectors, embedded.data, strict=True):
        # Pooled beside other requests in the batch: equal up to bfloat16 rounding.
        pairs = zip(line["embedding"], direct.embedding, strict=True)
        assert sum(a * b for a, b in pairs) > 0.999  # unit vectors: their cosine

    errors = read_lines(client, batch.error_file_id)
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert "line 3" in errors[None]["error"]["message"]
    assert errors["nowhere"]["error"]["code"] == "invalid_url"
    assert errors["no-body"]["error"]["code"] == "invalid_request"
    assert "body" in errors["no-body"]["error"]["message"]
    refused = errors["refused"]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors["chat-1"]["error"]["code"] == "duplicate_custom_id"


def test_the_files_api(client):
    content = jsonl([request_line("a", "/v1/completions", TEXT)])
    file = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (file.filename, file.purpose, file.bytes) == ("mine.jsonl", "batch", len(content))
    assert client.files.retrieve(file.id) == file
    assert client.files.content(file.id).content == content
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert file.id not in [f.id for f in client.files.list(purpose="batch_output")]
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    assert file.id not in [f.id for f in client.files.list()]


def test_bad_parameters_are_named(client, gateway):
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError) as missing:
        client.batches.create(
            input_file_id="file-none", endpoint="/v1/completions", completion_window="24h"
        )
    assert missing.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-none")
    file = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    for field, value in (("completion_window", "1h"), ("endpoint", "/v1/moderations")):
        body = {"input_file_id": file.id, "endpoint": "/v1/completions", "completion_window": "24h"}
        body[field] = value
        check_error(httpx.post(gateway.url + "/v1/batches", json=body), 400, field)
    check_error(httpx.get(gateway.url + "/v1/batches", params={"limit": 0}), 400, "limit")
    check_error(httpx.post(gateway.url + "/v1/files", json={"purpose": "batch"}), 415, None)


def test_an_empty_file_fails_its_job(client):
    batch = run_job(client, [b"", b"  "])
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "empty_file"


def test_a_file_over_the_upload_limit_is_413(keyed):
    client = keyed_client(keyed, KEYS[0])
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(
            file=("big.jsonl", b"x" * int(UPLOAD_LIMIT_MIB * 1024 * 1024 + 1)), purpose="batch"
        )
    assert refused.value.status_code == 413
    assert refused.value.body["param"] == "file"


def test_each_key_sees_only_its_own(keyed):
    a, b = (keyed_client(keyed, key) for key in KEYS)
    file = a.files.create(
        file=("a.jsonl", jsonl([request_line("a", "/v1/completions", TEXT)])), purpose="batch"
    )
    batch = a.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    for call in (
        lambda: b.files.retrieve(file.id),
        lambda: b.files.content(file.id),
        lambda: b.files.delete(file.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file.id not in [f.id for f in b.files.list()]
    assert batch.id not in [job.id for job in b.batches.list()]
    done = wait_done(a, batch.id)
    assert done.status == "completed"
    assert done.output_file_id in [f.id for f in a.files.list(purpose="batch_output")]
    assert done.output_file_id not in [f.id for f in b.files.list()]
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    # A batch's input must be an uploaded batch file: not a job's output.
    with pytest.raises(openai.BadRequestError) as output:
        a.batches.create(
            input_file_id=done.output_file_id, endpoint="/v1/completions", completion_window="24h"
        )
    assert output.value.body["param"] == "input_file_id"
    assert a.batches.list().data[0].id == batch.id
    with pytest.raises(openai.AuthenticationError):
        keyed_client(keyed, "not-a-key").files.list()


def test_a_cancelled_job_keeps_what_it_answered(keyed):
    client = keyed_client(keyed, KEYS[1])
    body = {**TEXT, "max_tokens": 16, "ignore_eos": True}
    lines = [request_line(f"line-{i}", "/v1/completions", body) for i in range(16)]
    file = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id)
    assert done.status == "cancelled"
    assert done.cancelled_at is not None and done.cancelling_at is not None
    assert done.request_counts.completed < 16
    assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    # A finished job is what it is: cancelling it again changes nothing.
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_a_job_past_its_window_expires(keyed):
    client = keyed_client(keyed, KEYS[0])
    body = {**TEXT, "max_tokens": 16, "ignore_eos": True}
    lines = [request_line(f"line-{i}", "/v1/completions", body) for i in range(16)]
    file = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    # Its 24 hours end now.
    database = Path(keyed.server.config.batch_dir) / DATABASE_NAME
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        db.execute(
            "UPDATE batches SET object = json_set(object, '$.expires_at', 0) WHERE id = ?",
            (batch.id,),
        )
    done = wait_done(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts.completed < 16 and counts.completed + counts.failed == counts.total == 16
    errors = read_lines(client, done.error_file_id)
    assert len(errors) == counts.failed
    assert {line["error"]["code"] for line in errors.values()} == {"batch_expired"}


def test_two_gateways_on_one_database_run_each_line_once(services, tmp_path):
    """As the workers of one gateway (--workers) share a --batch-dir: each job runs under one
    lease at a time, every line once; either gateway answers for any job."""
    gateways = [
        start_gateway(services, batch_dir=str(tmp_path), batch_concurrency=1) for _ in range(2)
    ]
    try:
        clients = [
            openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0) for g in gateways
        ]
        body = {**TEXT, "max_tokens": 4}
        lines = [request_line(f"line-{i}", "/v1/completions", body) for i in range(3)]
        batches = []
        for client in clients:
            file = client.files.create(file=("job.jsonl", jsonl(lines)), purpose="batch")
            batches.append(
                client.batches.create(
                    input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
                )
            )
        for client, batch in zip(reversed(clients), batches, strict=True):
            done = wait_done(client, batch.id)
            assert (done.status, done.request_counts.completed) == ("completed", 3)
    finally:
        for server in gateways:
            server.close()
    store = BatchStore(tmp_path)
    try:
        for batch in batches:
            assert store.attempts(batch.id) == {line: 1 for line in range(1, 4)}
    finally:
        store.close()
