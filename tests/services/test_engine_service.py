"""The engine service over real gRPC on loopback, with a real engine on a tiny random-weight
Llama: streamed tokens equal the engine library's own greedy tokens, streams multiplex, aborts
and cancellations free every KV block, bad requests fail alone with a status code naming the
parameter, a full queue answers RESOURCE_EXHAUSTED, warming and draining answer UNAVAILABLE."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import EngineConfig
from common.grpc_server import State
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from grpc_helpers import TIMEOUT, RequestStream, ServerThread, assert_health_and_reflection
from services.engine.server import EngineService

ENGINE_ARGS = dict(
    dtype="float32", block_size=4, num_kv_blocks=1024, max_num_batched_tokens=32, max_num_seqs=8
)
# Long enough that a request is still running when the test acts on it, however slow the machine.
LONG = 3000
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerThread(
        EngineService(EngineConfig(model=str(model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
    )
    yield server
    server.close()


@pytest.fixture
def stub(server):
    yield engine_pb2_grpc.EngineServiceStub(server.channel)
    # Every test must leave the engine empty: no request and no KV block held.
    llm = server.service.engine.engine
    assert llm.requests == {} and llm.kv_cache.usage == 0


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


def add(
    request_id: str, ids: list[int], params: common_pb2.SamplingParams
) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=ids, sampling_params=params
        )
    )


def reference(model_dir, prompts: dict[str, list[int]], params: dict[str, SamplingParams]):
    """The engine library driven by a plain loop, each prompt alone: tokens and logprobs by id."""
    llm = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_ARGS))
    tokens, logprobs = {}, {}
    for request_id, ids in prompts.items():
        llm.add_request(request_id, ids, params[request_id])
        while llm.has_unfinished:
            for out in llm.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    return tokens, logprobs


def collect(responses) -> tuple[dict[str, list[int]], dict[str, engine_pb2.RequestOutput], list]:
    """Run a stream to its end: tokens by request, last output by request, every response."""
    tokens, last, seen = {}, {}, []
    for response in responses:
        seen.append(response)
        for out in response.outputs:
            assert out.request_id not in last, "output after a request's last one"
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                last[out.request_id] = out
    return tokens, last, seen


def test_one_request_streams_the_engines_greedy_tokens(server, stub, model_dir):
    ids = prompt(11, seed=1)
    library_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected, _ = reference(model_dir, {"a": ids}, {"a": library_params})
    tokens, last, responses = collect(
        stub.Generate(iter([add("a", ids, greedy(12))]), timeout=TIMEOUT)
    )
    assert tokens["a"] == expected["a"]
    # One message per engine step, one token each, then the end with finish reason and usage.
    assert [len(r.outputs[0].token_ids) for r in responses] == [1] * 12
    assert last["a"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last["a"].usage == common_pb2.Usage(
        prompt_tokens=11, completion_tokens=12, cached_tokens=0
    )
    assert not last["a"].HasField("error")


def test_many_requests_multiplexed_on_one_stream(server, stub, model_dir):
    prompts = {f"r{i}": prompt(5 + 3 * i, seed=10 + i) for i in range(5)}
    lengths = {f"r{i}": 4 + 2 * i for i in range(5)}
    params = {r: greedy(lengths[r], **({"logprobs": 3} if r == "r2" else {})) for r in prompts}
    library_params = {
        r: SamplingParams(
            temperature=0.0,
            max_tokens=lengths[r],
            ignore_eos=True,
            logprobs=3 if r == "r2" else None,
        )
        for r in prompts
    }
    expected, expected_logprobs = reference(model_dir, prompts, library_params)

    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    for r in prompts:
        requests.send(add(r, prompts[r], params[r]))
    requests.close()
    logprobs = []
    tokens, last = {}, {}
    for response in responses:
        # Several requests advance in the same step: one message carries them all.
        for out in response.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.request_id == "r2":
                logprobs.extend(out.logprobs)
            if out.finished:
                last[out.request_id] = out
    assert tokens == expected
    assert {r: last[r].usage.completion_tokens for r in prompts} == lengths
    assert [lp.token_id for lp in logprobs] == tokens["r2"]
    for got, (chosen, top) in zip(logprobs, expected_logprobs["r2"], strict=False):
        assert got.logprob == pytest.approx(chosen, abs=1e-5)
        assert [t.token_id for t in got.top_logprobs] == [t for t, _ in top]


def test_abort_mid_stream_frees_kv_blocks(server, stub):
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(add("long", prompt(9, seed=2), greedy(LONG)))
    for _ in range(3):
        next(responses)
    stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)
    assert stats.num_running == 1 and stats.kv_cache_usage > 0
    assert (stats.block_size, stats.num_kv_blocks) == (4, 1024)  # ENGINE_ARGS
    requests.send(engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=["long"])))
    requests.close()
    _, last, _ = collect(responses)
    assert last["long"].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert 3 <= last["long"].usage.completion_tokens < LONG
    stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_unary_abort_reaches_a_request_on_any_stream(server, stub):
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(add("other", prompt(6, seed=3), greedy(LONG)))
    requests.close()
    next(responses)
    answer = stub.Abort(engine_pb2.AbortRequest(request_ids=["other", "unknown"]), timeout=TIMEOUT)
    assert list(answer.aborted_request_ids) == ["other"]
    _, last, _ = collect(responses)
    assert last["other"].finish_reason == common_pb2.FINISH_REASON_ABORT


def test_cancelled_stream_aborts_all_its_requests(server, stub):
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    for i in range(3):
        requests.send(add(f"c{i}", prompt(7, seed=20 + i), greedy(LONG)))
    seen = 0
    while seen < 3:  # all three are running
        seen += len(next(responses).outputs)
    assert server.service.engine.engine.kv_cache.usage > 0
    steps_before = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT).num_steps
    responses.cancel()
    llm = server.service.engine.engine
    deadline = time.monotonic() + 10
    while (llm.requests or llm.kv_cache.usage) and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    # Aborted at once, not run to max_tokens.
    assert stats.num_steps - steps_before < LONG // 2


def test_a_client_that_stops_reading_stalls_nobody(server, stub):
    # Logprobs make every message large, so the silent stream's flow-control window fills up.
    silent = stub.Generate(
        iter([add("silent", prompt(6, seed=30), greedy(LONG, logprobs=20))]), timeout=TIMEOUT
    )
    next(silent)
    tokens, last, _ = collect(
        stub.Generate(iter([add("busy", prompt(6, seed=31), greedy(50))]), timeout=TIMEOUT)
    )
    assert (
        len(tokens["busy"]) == 50 and last["busy"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    )
    silent.cancel()
    llm = server.service.engine.engine
    deadline = time.monotonic() + 10
    while llm.requests and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(
    "bad, parameter",
    [
        (dict(ids=[]), "prompt_token_ids"),
        (dict(ids=[5, 160, 7]), "prompt_token_ids"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_request_fails_alone_naming_the_parameter(server, stub, bad, parameter):
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(add("good", prompt(8, seed=4), greedy(6)))
    first = next(responses)  # the good request is running
    bad = dict(bad)
    ids = bad.pop("ids", prompt(5, seed=5))
    params = common_pb2.SamplingParams(**{"max_tokens": 4, **bad})
    requests.send(add("bad", ids, params))
    requests.close()
    tokens, last, _ = collect(responses)
    assert last["bad"].error.code == INVALID_ARGUMENT
    assert parameter in last["bad"].error.message
    assert last["bad"].finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert last["good"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.outputs[0].token_ids) + len(tokens["good"]) == 6


def test_reused_request_id_on_a_stream_is_refused(server, stub):
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    # The first request runs LONG so that it is still in flight when its id comes again.
    requests.send(add("same", prompt(8, seed=6), greedy(LONG)))
    next(responses)
    requests.send(add("same", prompt(8, seed=7), greedy(5)))
    outputs = []
    for response in responses:
        outputs += [out for out in response.outputs if out.finished]
        if outputs:
            break
    requests.send(engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=["same"])))
    requests.close()
    outputs += [out for response in responses for out in response.outputs if out.finished]
    assert [(o.error.code, o.finish_reason) for o in outputs] == [
        (INVALID_ARGUMENT, common_pb2.FINISH_REASON_UNSPECIFIED),
        (0, common_pb2.FINISH_REASON_ABORT),
    ]
    assert "request_id" in outputs[0].error.message


def test_malformed_message_fails_the_stream(server, stub):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(iter([engine_pb2.GenerateRequest()]), timeout=TIMEOUT))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info(server, stub, model_dir):
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    llm = server.service.engine.engine
    assert (info.model, info.model_path) == (model_dir.name, str(model_dir))
    assert (info.vocab_size, info.max_model_len) == (160, 4096)
    assert list(info.eos_token_ids) == sorted(llm.eos_token_ids)
    assert (info.dtype, info.kv_cache_dtype, info.device, info.block_size) == (
        "float32",
        "float32",
        "cpu",
        4,
    )
    assert info.num_kv_blocks == 1024


def test_health_and_reflection(server):
    assert_health_and_reflection(server.channel, "folio.v1.EngineService")


def test_full_queue_answers_resource_exhausted(model_dir, serve):
    config = EngineConfig(
        model=str(model_dir), **dict(ENGINE_ARGS, max_num_seqs=1, max_waiting_requests=1)
    )
    server = serve(EngineService(config, "127.0.0.1", 0))
    stub = engine_pb2_grpc.EngineServiceStub(server.channel)
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(add("running", prompt(6, seed=8), greedy(LONG)))
    next(responses)  # running: the one slot is taken
    requests.send(add("waiting", prompt(6, seed=9), greedy(3)))
    requests.send(add("refused", prompt(6, seed=10), greedy(3)))
    refused = next(
        out for response in responses for out in response.outputs if out.request_id == "refused"
    )
    assert refused.finished and refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "max_waiting_requests" in refused.error.message
    requests.send(
        engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=["running"]))
    )
    requests.close()
    _, last, _ = collect(responses)
    assert last["running"].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert last["waiting"].finish_reason == common_pb2.FINISH_REASON_LENGTH


class GatedEngineService(EngineService):
    """An engine service whose warm-up waits for the test's go."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.go = threading.Event()

    async def warm_up(self) -> None:
        await asyncio.to_thread(self.go.wait, TIMEOUT)
        await super().warm_up()


def test_unavailable_while_warming_and_draining(model_dir, serve):
    server = serve(
        GatedEngineService(EngineConfig(model=str(model_dir), **ENGINE_ARGS), "127.0.0.1", 0),
        wait=False,
    )
    stub = engine_pb2_grpc.EngineServiceStub(server.channel)
    health = health_pb2_grpc.HealthStub(server.channel)

    def status() -> int:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status

    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(iter([add("early", [5, 6], greedy(2))]), timeout=TIMEOUT))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as error:
        stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE

    server.service.go.set()
    server.call(server.service.wait_serving())
    assert status() == health_pb2.HealthCheckResponse.SERVING

    # Draining: a request in flight finishes, a new one on the same stream is refused.
    requests = RequestStream()
    responses = stub.Generate(iter(requests), timeout=TIMEOUT)
    requests.send(add("inflight", prompt(6, seed=11), greedy(40)))
    first = next(responses)
    stopping = asyncio.run_coroutine_threadsafe(server.service.stop(grace=TIMEOUT), server.loop)
    deadline = time.monotonic() + 10
    while server.service.state is not State.DRAINING and time.monotonic() < deadline:
        time.sleep(0.005)
    requests.send(add("late", prompt(6, seed=12), greedy(3)))
    requests.close()
    tokens, last, _ = collect(responses)
    assert last["late"].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert last["inflight"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.outputs[0].token_ids) + len(tokens["inflight"]) == 40
    stopping.result(TIMEOUT)
