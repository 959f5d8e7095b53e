"""Parallel sampling and priorities through the services: the engine's gRPC contract for n > 1
(one request, outputs told apart by index, one sample aborted alone by AbortRequest.samples or
the older "<id>#<index>"), the
OpenAI n with a seed through the gateway (one engine request sharing the prompt), and
`priority` passed from HTTP to an engine run with the priority policy."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)

from common.config import EngineConfig
from gateway_helpers import ENGINE_ARGS, GatewayThread, engine_stats
from grpc_helpers import TIMEOUT, RequestStream, ServerThread
from services.engine.server import EngineService

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )


def prompt_tokens_prefilled(gateway) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text
    return float(
        next(
            line.split()[-1]
            for line in text.splitlines()
            if line.startswith("folio_prompt_tokens_total ")
        )
    )


def test_n3_with_a_seed_gives_three_distinct_reproducible_choices(client, gateway, tokenizer):
    args = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    before = prompt_tokens_prefilled(gateway)
    first = client.completions.create(**args)
    # One engine request for the three choices: the prompt was prefilled once.
    assert prompt_tokens_prefilled(gateway) - before == len(tokenizer.encode(PROMPT))
    again = client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3  # sample i draws from seed + i
    assert all(c.text == "".join(c.logprobs.tokens) for c in first.choices)
    # The prompt counts once, as OpenAI counts it; each choice its own tokens.
    assert first.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert first.usage.completion_tokens == 3 * 12


def test_streamed_n3_chat_equals_the_whole_answer(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, seed=8, n=3)
    whole = [c.message.content for c in client.chat.completions.create(**args).choices]
    streamed = ["", "", ""]
    finish = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert streamed == whole and set(finish) == {0, 1, 2}


def test_a_stop_string_aborts_only_its_own_sample(client, engine_stub):
    args = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=32,
        temperature=1.0,
        seed=21,
        n=2,
        extra_body={"ignore_eos": True},
    )
    reference = client.completions.create(**args, logprobs=0).choices
    # A word sample 0 says early and sample 1 never says: only sample 0 may stop on it.
    early = "".join(reference[0].logprobs.tokens[:12])
    words = [w.strip(".,;:!?'\"") for w in early.split()]
    stop = max((w for w in words if len(w) >= 4 and w not in reference[1].text), key=len)
    text = ["", ""]
    finish: dict[int, str] = {}
    after_stop = 0  # sample 1's chunks once sample 0 has stopped
    for chunk in client.completions.create(**args, stop=[stop], stream=True):
        for choice in chunk.choices:
            text[choice.index] += choice.text
            after_stop += choice.index == 1 and 0 in finish
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish[0] == "stop"
    assert text[0] == reference[0].text[: reference[0].text.index(stop)]
    # Sample 1 was not aborted with it, and went on while sample 0's abort was confirmed
    # (unless its own text, which may differ once it runs alone, hit the stop string too).
    assert finish[1] in ("length", "stop")
    if finish[1] == "length":
        assert after_stop >= 5
    stats = engine_stats(engine_stub)
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_engine_streams_each_sample_and_aborts_one_alone(engine_stub, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    requests = RequestStream()
    responses = engine_stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(
        engine_pb2.GenerateRequest(
            add=engine_pb2.EngineRequest(
                request_id="par",
                prompt_token_ids=prompt_ids,
                sampling_params=common_pb2.SamplingParams(
                    n=3, seed=5, temperature=1.0, max_tokens=500, ignore_eos=True
                ),
            )
        )
    )
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last: dict[int, engine_pb2.RequestOutput] = {}

    def read() -> None:
        for out in next(responses).outputs:
            assert out.request_id == "par" and not out.HasField("error")
            tokens[out.index].extend(out.token_ids)
            if out.finished:
                last[out.index] = out

    while min(map(len, tokens.values())) < 3:
        read()
    requests.send(engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=["par#1"])))
    while 1 not in last:
        read()
    assert set(last) == {1}  # the other samples go on
    requests.send(engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=["par"])))
    requests.close()
    for response in responses:  # the stream ends once every sample has ended
        for out in response.outputs:
            tokens[out.index].extend(out.token_ids)
            if out.finished:
                last[out.index] = out
    assert set(last) == {0, 1, 2}
    for index, out in last.items():
        assert out.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert out.usage.prompt_tokens == len(prompt_ids)
        assert out.usage.completion_tokens == len(tokens[index]) < 500
    stats = engine_stats(engine_stub)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_abort_request_samples_abort_one_sample_on_the_stream_and_by_the_unary_abort(
    engine_stub, tokenizer
):
    requests = RequestStream()
    responses = engine_stub.Generate(iter(requests), timeout=TIMEOUT)
    params = common_pb2.SamplingParams(
        n=2, seed=5, temperature=1.0, max_tokens=500, ignore_eos=True
    )
    requests.send(
        engine_pb2.GenerateRequest(
            add=engine_pb2.EngineRequest(
                request_id="refs", prompt_token_ids=tokenizer.encode(PROMPT), sampling_params=params
            )
        )
    )
    counts = {0: 0, 1: 0}
    ended: dict[int, int] = {}  # index -> finish reason

    def read() -> None:
        for out in next(responses).outputs:
            assert not out.HasField("error")
            counts[out.index] += len(out.token_ids)
            if out.finished:
                ended[out.index] = out.finish_reason

    while min(counts.values()) < 2:
        read()
    sample_one = engine_pb2.SampleRef(request_id="refs", index=1)
    requests.send(engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(samples=[sample_one])))
    while 1 not in ended:
        read()
    assert ended == {1: common_pb2.FINISH_REASON_ABORT}  # sample 0 goes on
    sample_zero = engine_pb2.SampleRef(request_id="refs", index=0)
    answer = engine_stub.Abort(engine_pb2.AbortRequest(samples=[sample_zero]), timeout=TIMEOUT)
    assert list(answer.aborted_request_ids) == ["refs#0"]
    requests.close()
    for response in responses:  # the stream ends once both samples have ended
        for out in response.outputs:
            if out.finished:
                ended[out.index] = out.finish_reason
    assert ended == {0: common_pb2.FINISH_REASON_ABORT, 1: common_pb2.FINISH_REASON_ABORT}
    stats = engine_stats(engine_stub)
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_the_one_sequence_grpc_api_refuses_n_by_name(gateway):
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    with pytest.raises(grpc.RpcError) as failure:
        list(
            stub.Generate(
                gateway_pb2.GatewayServiceGenerateRequest(
                    prompt="Hi", sampling_params=common_pb2.SamplingParams(n=2)
                ),
                timeout=TIMEOUT,
            )
        )
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details().startswith("n must be 1")


LOW_TOKENS = 60


@pytest.fixture(scope="module")
def priority_services(services, default_model_dir):
    """An engine with the priority policy and one sequence slot, and a gateway in front."""
    config = EngineConfig(
        model=str(default_model_dir),
        **dict(ENGINE_ARGS, max_num_seqs=1, scheduling_policy="priority"),
    )
    engine = ServerThread(EngineService(config, "127.0.0.1", 0))
    gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{services[1].port}")
    yield gateway, engine_pb2_grpc.EngineServiceStub(engine.channel)
    gateway.close()
    engine.close()


def test_priority_from_http_lets_a_late_urgent_request_finish_first(priority_services):
    gateway, stub = priority_services
    finished: list[str] = []

    def complete(name: str, max_tokens: int, priority: int) -> dict:
        response = httpx.post(
            gateway.url + "/v1/completions",
            timeout=TIMEOUT,
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "priority": priority,
            },
        )
        assert response.status_code == 200, response.text
        finished.append(name)
        return response.json()

    with ThreadPoolExecutor(3) as pool:
        lows = [pool.submit(complete, f"low{i}", LOW_TOKENS, 10) for i in range(2)]
        deadline = time.monotonic() + TIMEOUT
        while (stats := engine_stats(stub)).num_running + stats.num_waiting < 2:
            assert time.monotonic() < deadline, "the low-priority requests never arrived"
            time.sleep(0.01)
        high = pool.submit(complete, "high", 4, 0)
        answers = [f.result(TIMEOUT) for f in (high, *lows)]
    # One slot, held by a low request: only preempting it lets the urgent one in this early.
    assert finished[0] == "high", finished
    assert engine_stats(stub).num_preemptions >= 1
    assert [a["usage"]["completion_tokens"] for a in answers] == [4, LOW_TOKENS, LOW_TOKENS]
