"""The internal services' shared token: a tokenizer or engine service given one answers every
call without it UNAUTHENTICATED (health excepted, for orchestrators), the gateway's clients send
it on unary calls and on both streams, `folio serve` makes one per run and hands it to its
children in their environment, never on a command line; and every service listens on loopback
unless told otherwise."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.auth import KeySet
from common.config import EngineConfig, GatewayServerConfig
from common.errors import InternalError
from common.flags import from_args
from common.sampling_params import SamplingParams
from folio.cli import build_parser
from gateway.engines.clients import EngineClient, TokenizerClient
from grpc_helpers import TIMEOUT
from services.engine.server import EngineService
from services.supervisor import INTERNAL_HOST, ServeConfig, Supervisor
from services.tokenizer.server import TokenizerService
from tiny_models import VARIANTS, make_checkpoint

TOKEN = "internal-token-for-tests-0123456789"
ENGINE_ARGS = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    config_class, kwargs = VARIANTS["llama"]
    make_checkpoint(directory, config_class, kwargs)
    return directory


@pytest.fixture
def guarded(serve, default_model_dir, tiny_model_dir):
    """A tokenizer and an engine service that require TOKEN."""
    tokenizer = TokenizerService(str(default_model_dir), "127.0.0.1", 0)
    engine = EngineService(EngineConfig(model=str(tiny_model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
    for service in (tokenizer, engine):
        service.require_keys(KeySet([TOKEN]), "internal token")
    return serve(tokenizer), serve(engine)


def metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


def test_services_refuse_calls_without_the_token(guarded):
    tokenizer, engine = guarded
    tokenize = tokenizer_pb2_grpc.TokenizerServiceStub(tokenizer.channel)
    engine_stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
    generate = engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            sampling_params=common_pb2.SamplingParams(max_tokens=2),
        )
    )
    calls = [
        lambda m: tokenize.Tokenize(
            tok_pb2.TokenizeRequest(text="Hi"), metadata=m, timeout=TIMEOUT
        ),
        lambda m: list(
            tokenize.DetokenizeStream(
                iter([tok_pb2.DetokenizeStreamRequest(token_ids=[12], finish=True)]),
                metadata=m,
                timeout=TIMEOUT,
            )
        ),
        lambda m: engine_stub.GetModelInfo(
            engine_pb2.GetModelInfoRequest(), metadata=m, timeout=TIMEOUT
        ),
        lambda m: list(engine_stub.Generate(iter([generate]), metadata=m, timeout=TIMEOUT)),
    ]
    for server in guarded:
        reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
        calls.append(
            lambda m, r=reflection: list(
                r.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    metadata=m,
                    timeout=TIMEOUT,
                )
            )
        )
    for token in (None, "wrong-token", TOKEN[:-1]):
        for call in calls:
            with pytest.raises(grpc.RpcError) as failure:
                call(metadata(token))
            assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "internal token" in failure.value.details()
            assert TOKEN not in failure.value.details()
    for call in calls:
        assert call(metadata(TOKEN))
    # Health needs no token: orchestrators and `folio serve` probe it.
    for server in guarded:
        health = health_pb2_grpc.HealthStub(server.channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_the_gateway_clients_send_the_token(guarded):
    tokenizer, engine = guarded

    async def use(token: str | None) -> list[int]:
        engine_client = EngineClient(f"127.0.0.1:{engine.port}", token)
        tokenizer_client = TokenizerClient(f"127.0.0.1:{tokenizer.port}", token)
        try:
            await engine_client.model_info()
            prompt = await tokenizer_client.tokenize_text("Hi")
            stream = engine_client.generate_stream()
            stream.add("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), 0)
            tokens: list[int] = []
            async for outputs in stream.steps():
                for output in outputs:
                    assert output.error is None, output.error
                    tokens += output.token_ids
                if outputs[-1].finished:
                    break
            if stream.ended is not None:
                raise stream.ended
            assert prompt.token_ids
            assert await tokenizer_client.tokenizer_json()  # a stream of the tokenizer's
            return tokens
        finally:
            await engine_client.close()
            await tokenizer_client.close()

    assert len(asyncio.run(use(TOKEN))) == 3
    with pytest.raises(InternalError, match="internal token"):
        asyncio.run(use(None))


def test_folio_serve_gives_its_children_one_token_in_their_environment():
    args = build_parser().parse_args(
        ["serve", "--api-key", "sk-serve-key", "--rate-limit-rps", "3", "--request-timeout", "9"]
    )
    supervisor = Supervisor(from_args(ServeConfig, args))
    tokens = {child.env["FOLIO_INTERNAL_TOKEN"] for child in supervisor.children}
    assert len(tokens) == 1 and len(next(iter(tokens))) >= 32
    assert supervisor.gateway.env["FOLIO_API_KEYS"] == "sk-serve-key"
    for child in supervisor.children:
        assert not any(secret in arg for arg in child.args for secret in ("sk-serve-key", *tokens))
    gateway = from_args(GatewayServerConfig, build_parser().parse_args(supervisor.gateway.args))
    policy = gateway.front.policy
    assert (policy.rate_limit_rps, policy.request_timeout, gateway.front.keys.api_key) == (
        3.0,
        9.0,
        (),
    )
    # A new run, a new token.
    assert Supervisor(from_args(ServeConfig, args)).engine.env["FOLIO_INTERNAL_TOKEN"] not in tokens


def test_every_service_listens_on_loopback_by_default():
    for command in (["tokenizer"], ["engine"], ["gateway"], ["serve"]):
        assert build_parser().parse_args(command).host == "127.0.0.1", command
    assert INTERNAL_HOST == "127.0.0.1"
    gateway = build_parser().parse_args(["gateway"])
    assert gateway.engine_address[0].startswith("127.0.0.1:")
    assert gateway.tokenizer_address.startswith("127.0.0.1:")
