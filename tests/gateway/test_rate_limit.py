"""Per-caller rate limits: over its requests per second or tokens per minute a caller gets 429
with Retry-After and the OpenAI error body (the openai client raises RateLimitError), or
RESOURCE_EXHAUSTED over gRPC; callers are API keys (or client addresses without keys), each with
buckets of its own shared by both APIs; what a sequence did not generate is given back. The
buckets themselves are checked against a clock the test moves, both in one process's memory and
in the file the workers of one gateway share (gateway/limits/shared_buckets.py), where processes
taking from one bucket at once never take more than it holds."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from common.errors import QueueFullError, RateLimitExceeded
from common.sampling_params import SamplingParams
from gateway.limits.rate_limit import (
    MAX_TRACKED_CALLERS,
    LocalBuckets,
    RateLimiter,
    giving_back_unused,
)
from gateway.limits.shared_buckets import SharedBuckets
from gateway.pipeline.text import TextDelta, TextRequest, Usage
from gateway_helpers import check_error, start_gateway
from grpc_helpers import TIMEOUT

KEYS = ("sk-rate-limit-a", "sk-rate-limit-b")
# One request per 20 s: a second request is refused however slow the machine.
SLOW_RPS = 0.05
# Greedy, this prompt continues " 5," and stops at the comma: a sequence that leaves most of
# its max_tokens unused.
COUNTING = {"prompt": "1, 2, 3, 4,", "stop": [","], "temperature": 0}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def check_rate_limited(response: httpx.Response, retry_after: tuple[int, int] | None) -> str:
    """429 with the OpenAI body and Retry-After within `retry_after` (None: no header)."""
    error = check_error(response, 429, None)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    if retry_after is None:
        assert "retry-after" not in response.headers
    else:
        assert retry_after[0] <= int(response.headers["retry-after"]) <= retry_after[1]
    return error["message"]


def test_requests_per_second_per_key_across_http_and_grpc(services):
    server = start_gateway(services, api_keys=KEYS, rate_limit_rps=SLOW_RPS)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            assert http.get("/v1/models", headers=auth(KEYS[0])).status_code == 200
            message = check_rate_limited(http.get("/v1/models", headers=auth(KEYS[0])), (1, 20))
            assert "requests per second" in message and "this API key" in message
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
            with pytest.raises(openai.RateLimitError) as failure:
                client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
            assert failure.value.code == "rate_limit_exceeded"
            # Probes are never limited.
            for _ in range(3):
                assert http.get("/health").status_code == 200
            # The gRPC API charges the same key's bucket.
            stub = gateway_pb2_grpc.GatewayServiceStub(server.grpc_channel)
            request = gateway_pb2.GatewayServiceGenerateRequest(
                prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=1)
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(
                    stub.Generate(
                        request, metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=TIMEOUT
                    )
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests per second" in refused.value.details()
            # Another key has a bucket of its own, spent here over gRPC.
            metadata = (("authorization", f"Bearer {KEYS[1]}"),)
            assert list(stub.Generate(request, metadata=metadata, timeout=TIMEOUT))
            check_rate_limited(http.get("/v1/models", headers=auth(KEYS[1])), (1, 20))
    finally:
        server.close()


def test_without_keys_each_client_address_is_limited(services):
    server = start_gateway(services, rate_limit_rps=SLOW_RPS)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            assert http.get("/v1/models").status_code == 200
            assert "this client" in check_rate_limited(http.get("/v1/models"), (1, 20))
    finally:
        server.close()


def test_tokens_per_minute_reserve_max_tokens_and_give_back_what_was_not_used(services):
    # 60 tokens a minute refill one a second: negligible next to what the requests take.
    server = start_gateway(services, api_keys=KEYS, rate_limit_tpm=60)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            # More than a whole minute's tokens can never pass: no Retry-After.
            message = check_rate_limited(
                http.post(
                    "/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 100},
                    headers=auth(KEYS[0]),
                ),
                None,
            )
            assert "request too large" in message and "max_tokens" in message
            # Prompt (P) + 32 reserved, P + 2 used: 30 come back. Without the give-back the
            # second one would find 60 - (P + 32) < P + 32 tokens left.
            for _ in range(2):
                response = http.post(
                    "/v1/completions", json={**COUNTING, "max_tokens": 32}, headers=auth(KEYS[0])
                )
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["choices"][0]["finish_reason"] == "stop", body
                usage = body["usage"]
                assert usage["prompt_tokens"] + 32 <= 60 < 2 * (usage["prompt_tokens"] + 32)
                assert usage["completion_tokens"] <= 4
            # Left: 60 - 2 (P + completion) plus the refill; a request for all 60 must wait
            # about as many seconds as tokens are missing.
            used = 2 * usage["total_tokens"]
            prompt_tokens = usage["prompt_tokens"]
            message = check_rate_limited(
                http.post(
                    "/v1/completions",
                    json={**COUNTING, "max_tokens": 60 - prompt_tokens},
                    headers=auth(KEYS[0]),
                ),
                (1, used),
            )
            assert "tokens per minute" in message
            # The other key's tokens are its own.
            response = http.post(
                "/v1/completions",
                json={**COUNTING, "max_tokens": 60 - prompt_tokens},
                headers=auth(KEYS[1]),
            )
            assert response.status_code == 200, response.text
    finally:
        server.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sequence(prompt_tokens: int, max_tokens: int) -> TextRequest:
    return TextRequest(list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))


@pytest.fixture(params=["local", "shared"])
def buckets(request, tmp_path):
    """Where the limiter keeps its buckets: in memory, or in files as the workers share them."""
    if request.param == "local":
        return LocalBuckets
    return functools.partial(SharedBuckets.in_directory, tmp_path)


def test_buckets_refill_at_their_rate(buckets):
    clock = Clock()
    limiter = RateLimiter(
        requests_per_second=2, tokens_per_minute=600, clock=clock, buckets=buckets
    )
    limiter.admit_request("key-0")
    limiter.admit_request("key-0")  # a second's burst
    with pytest.raises(RateLimitExceeded) as failure:
        limiter.admit_request("key-0")
    assert failure.value.retry_after == 1  # half a second, rounded up
    limiter.admit_request("key-1")
    clock.now += 0.5
    limiter.admit_request("key-0")

    # 600 tokens a minute: 10 a second.
    reservation = limiter.reserve_tokens("key-0", [sequence(100, 200), sequence(100, 200)])
    with pytest.raises(RateLimitExceeded) as failure:
        limiter.reserve_tokens("key-0", [sequence(100, 100)])
    assert failure.value.retry_after == 20  # all 200 missing
    reservation.give_back(150)
    with pytest.raises(RateLimitExceeded) as failure:
        limiter.reserve_tokens("key-0", [sequence(100, 100)])
    assert failure.value.retry_after == 5  # 50 missing
    clock.now += 5
    limiter.reserve_tokens("key-0", [sequence(100, 100)])
    with pytest.raises(RateLimitExceeded) as failure:
        limiter.reserve_tokens("key-1", [sequence(1, 600)])
    assert failure.value.retry_after is None  # 601 > 600 can never pass
    # Give-backs never overfill a bucket.
    clock.now += 3600
    reservation.give_back(10**6)
    limiter.reserve_tokens("key-0", [sequence(300, 300)])
    with pytest.raises(RateLimitExceeded):
        limiter.reserve_tokens("key-0", [sequence(1, 1)])


def test_idle_callers_are_forgotten_beyond_the_tracking_bound(buckets):
    clock = Clock()
    limiter = RateLimiter(
        requests_per_second=1, tokens_per_minute=None, clock=clock, buckets=buckets
    )
    for i in range(MAX_TRACKED_CALLERS):
        limiter.admit_request(f"client-{i}")
    clock.now += 1  # every bucket is full again
    limiter.admit_request("client-new")
    assert len(limiter._requests) == 1
    limiter.admit_request("client-0")  # a forgotten caller starts over with a full bucket


def test_unused_tokens_come_back_when_sequences_finish_or_are_refused(buckets):
    clock = Clock()
    limiter = RateLimiter(
        requests_per_second=None, tokens_per_minute=600, clock=clock, buckets=buckets
    )
    requests = [sequence(100, 200), sequence(100, 200)]

    async def finished_one_then_refused():
        yield 0, TextDelta("text", finish_reason="stop", usage=Usage(100, 50))
        raise QueueFullError("the waiting queue is full")

    async def refused():
        raise QueueFullError("the waiting queue is full")
        yield

    async def run(stream) -> None:
        reservation = limiter.reserve_tokens("key-0", requests)  # all 600
        with pytest.raises(QueueFullError):
            async for _ in giving_back_unused(stream, requests, reservation):
                pass

    asyncio.run(run(finished_one_then_refused()))
    limiter.reserve_tokens("key-0", [sequence(50, 100)])  # the 150 sequence 0 did not use
    with pytest.raises(RateLimitExceeded):
        limiter.reserve_tokens("key-0", [sequence(1, 1)])
    clock.now += 60
    asyncio.run(run(refused()))
    limiter.reserve_tokens("key-0", [sequence(300, 300)])  # refused before it ran: all back


# Takes one token at a time from a bucket that never refills, as fast as it can once the test
# says go; prints how many it got. Clock: one fixed time, the same in every process.
TAKER = """
import sys, time
from pathlib import Path
from gateway.limits.shared_buckets import SharedBuckets
directory = Path(sys.argv[1])
buckets = SharedBuckets.in_directory(directory, "tokens", 1e-9, 15000)
print("ready", flush=True)
while not (directory / "go").exists():
    time.sleep(0.001)
print(sum(buckets.take("key-0", 1, 1000.0) == 0.0 for _ in range(10000)))
"""


def test_processes_sharing_a_bucket_never_take_more_than_it_holds(tmp_path):
    takers = [
        subprocess.Popen(
            [sys.executable, "-c", TAKER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    for taker in takers:
        assert taker.stdout is not None and taker.stdout.readline() == "ready\n"
    (tmp_path / "go").touch()
    taken = [int(taker.communicate(timeout=TIMEOUT)[0]) for taker in takers]
    assert sum(taken) == 15000, taken  # 30000 tries at once, 15000 tokens: each taken once
    # What they left is what the next one finds.
    buckets = SharedBuckets.in_directory(tmp_path, "tokens", 1e-9, 15000)
    assert buckets.take("key-0", 1, 1000.0) > 0
    assert buckets.take("key-1", 15000, 1000.0) == 0.0
