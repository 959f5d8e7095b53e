"""Anthropic's Message Batches API through the real anthropic client (messages.batches) against
the real gateway and engine with the default model: a batch's requests are answered as
/v1/messages answers the same greedy requests, a bad one errors alone, results come in the
requests' order once the batch has ended; list, cancel (what had not run is canceled) and
delete; bad batches are 400s in Anthropic's error shape; the jobs are the Message Batches API's
own (OpenAI's /v1/batches does not list them)."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

from grpc_helpers import TIMEOUT

MODEL = "SmolLM2-135M-Instruct"
WAIT_SECONDS = 300.0
ASK = {"role": "user", "content": "Name a colour."}


def params(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 6, "messages": [ASK], "temperature": 0.0, **fields}


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=gateway.url, api_key="unused", max_retries=0, timeout=4 * TIMEOUT
    )


def wait_ended(client: anthropic.Anthropic, batch_id: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while (batch := client.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, f"batch still {batch.processing_status}: {batch}"
        time.sleep(0.2)
    return batch


def test_a_batch_answers_each_request_as_messages_does(client, gateway):
    requests = [
        {"custom_id": "colour", "params": params()},
        {"custom_id": "too-hot", "params": params(temperature=3.0)},
        {
            "custom_id": "capital",
            "params": params(messages=[{"role": "user", "content": "Paris?"}]),
        },
    ]
    created = client.messages.batches.create(requests=requests)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress"
    assert created.request_counts.processing == 3 and created.results_url is None
    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        client.messages.batches.delete(created.id)

    batch = wait_ended(client, created.id)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (2, 1, 0)
    assert batch.ended_at is not None and batch.results_url.endswith(f"/{batch.id}/results")

    results = list(client.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["colour", "too-hot", "capital"]
    for result, request in zip(results, requests, strict=True):
        if result.custom_id == "too-hot":
            assert result.result.type == "errored"
            assert result.result.error.error.type == "invalid_request_error"
            assert "temperature" in result.result.error.error.message
            continue
        # This client takes no temperature: it goes as an extra field.
        fields = {k: v for k, v in request["params"].items() if k != "temperature"}
        direct = client.messages.create(**fields, extra_body={"temperature": 0.0})
        assert result.result.type == "succeeded"
        assert result.result.message.content[0].text == direct.content[0].text
        assert result.result.message.usage.output_tokens == direct.usage.output_tokens

    listed = [b.id for b in client.messages.batches.list(limit=100)]
    assert batch.id in listed
    openai_jobs = httpx.get(gateway.url + "/v1/batches", timeout=TIMEOUT).json()["data"]
    assert batch.id not in [job["id"] for job in openai_jobs]

    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_a_cancelled_batch_ends_with_what_it_answered(client):
    requests = [
        {"custom_id": f"long-{i}", "params": params(max_tokens=400, temperature=1.0)}
        for i in range(12)
    ]
    created = client.messages.batches.create(requests=requests)
    cancelling = client.messages.batches.cancel(created.id)
    assert cancelling.processing_status in ("canceling", "ended")
    assert cancelling.cancel_initiated_at is not None
    batch = wait_ended(client, created.id)
    results = {r.custom_id: r.result.type for r in client.messages.batches.results(batch.id)}
    assert list(results) == [r["custom_id"] for r in requests]
    assert set(results.values()) <= {"succeeded", "canceled"} and "canceled" in results.values()
    counts = batch.request_counts
    assert counts.canceled == list(results.values()).count("canceled")
    assert counts.succeeded + counts.canceled == 12


def test_the_list_pages_newest_first_both_ways(client, gateway):
    one = [{"custom_id": "one", "params": params(max_tokens=1)}]
    a, b, c, d = (client.messages.batches.create(requests=one).id for _ in range(4))
    first = client.messages.batches.list(limit=2)
    assert [batch.id for batch in first.data] == [d, c] and first.has_more
    older = client.messages.batches.list(limit=2, after_id=c)
    assert [batch.id for batch in older.data] == [b, a]
    newer = client.messages.batches.list(limit=2, before_id=b)
    assert [batch.id for batch in newer.data] == [d, c] and not newer.has_more
    both = httpx.get(
        gateway.url + "/v1/messages/batches",
        params={"after_id": a, "before_id": c},
        timeout=TIMEOUT,
    )
    assert both.status_code == 400 and "at most one" in both.json()["error"]["message"]
    for batch_id in (a, b, c, d):
        wait_ended(client, batch_id)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "a b", "params": {}}]}, "custom_id"),
        ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]}, "a"),
        ({"requests": [{"custom_id": "a"}]}, "params"),
    ],
)
def test_a_bad_batch_is_refused_in_anthropics_shape(gateway, body, named):
    refused = httpx.post(gateway.url + "/v1/messages/batches", json=body, timeout=TIMEOUT)
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_an_unknown_batch_is_a_404(client):
    for batch_id in ("msgbatch_nothing", "batch_nothing"):
        with pytest.raises(anthropic.NotFoundError, match="no message batch"):
            client.messages.batches.retrieve(batch_id)
