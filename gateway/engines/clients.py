"""The gateway's async gRPC clients of the engine and tokenizer services.

Every request to a replica rides on one long-lived, multiplexed Engine.Generate stream rather
than one stream per request: the engine then sends one message per step for all of them
instead of one per request per step, and per-message cost is what limits Python gRPC at high
concurrency. The replica's session (gateway/engines/session.py) opens it, reads it, and opens
a fresh one after a break. Generated tokens become text in the gateway itself, with the
tokenizer fetched once (GetTokenizerJson): no tokenizer call per step. Every call carries the
internal token when there is one (FOLIO_INTERNAL_TOKEN), and unary calls carry what is left of
their request's deadline (gateway/limits/deadlines.py). Transport and translation only: this
module never validates or decides anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Sequence,
)
from typing import Any, TypeVar

import grpc
from common.grpc_stubs.folio.v1 import engine_pb2_grpc, tokenizer_pb2_grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2_grpc

from common.auth import AUTHORIZATION, bearer_metadata
from common.config import GRPC_MESSAGE_OPTIONS, RECONNECT_CHANNEL_OPTIONS
from common.errors import FolioError, UnavailableError, error_for
from common.framing import FrameError
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from gateway import wire
from gateway.engines.generate_socket import (
    GenerateSocketConnection,
    GenerateSocketEnded,
    open_generate_socket,
)
from gateway.engines.lora import current_lora
from gateway.engines.pinning import current_pin
from gateway.limits.deadlines import call_timeout
from gateway.limits.service_level import current_service_level
from gateway.messages import (
    ChatPrompt,
    EngineModel,
    EngineStats,
    KvEventBatch,
    StepOutput,
    Tokenized,
    TokenizerInfo,
)

# Unary calls are quick (tokenize, stats); a stuck service must not hang an HTTP request.
UNARY_TIMEOUT = 30.0
HEALTH_TIMEOUT = 2.0
CHANNEL_OPTIONS = [*GRPC_MESSAGE_OPTIONS, *RECONNECT_CHANNEL_OPTIONS]

ResponseT = TypeVar("ResponseT", bound=Message)


logger = logging.getLogger(__name__)


class ServiceErrors:
    """One client's view of its service's failures, as exceptions and log lines. An unreachable
    or unready service is a plain "<service> unavailable" to callers (gRPC's words name its
    internal address, so they go to the log): one warning when an outage starts and one line
    when the service answers again; the calls in between log at debug level, since every
    /metrics scrape and dashboard sample would otherwise add a warning of its own."""

    def __init__(self, service: str, address: str) -> None:
        self.service = service
        self.address = address
        self.down = False

    def error(self, code: grpc.StatusCode, details: str | None) -> Exception:
        if code != grpc.StatusCode.UNAVAILABLE:
            return error_for(code, f"{self.service}: {details or code.name}")
        level = logging.DEBUG if self.down else logging.WARNING
        logger.log(
            level, "%s at %s is unavailable: %s", self.service, self.address, details or code.name
        )
        self.down = True
        return UnavailableError(f"{self.service} unavailable")

    def rpc_error(self, exc: grpc.aio.AioRpcError) -> Exception:
        return self.error(exc.code(), exc.details())

    def answered(self) -> None:
        if self.down:
            self.down = False
            logger.info("%s at %s answers again", self.service, self.address)


class _ServiceClient:
    """A channel to one of the internal services: unary calls with a timeout and errors mapped
    to the library's exceptions, and its health."""

    service = ""  # named in error messages

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.errors = ServiceErrors(self.service, address)
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._metadata = bearer_metadata(token)  # the internal token, if the service wants one

    async def serving(self) -> bool:
        try:
            # types-grpcio-health-checking declares HealthStub without its methods.
            response = await health_pb2_grpc.HealthStub(self._channel).Check(  # type: ignore[attr-defined]
                wire.health_request(), timeout=HEALTH_TIMEOUT
            )
        except grpc.aio.AioRpcError:
            return False
        if serving := wire.serving(response):
            self.errors.answered()
        return serving

    async def _unary(
        self, method: Callable[..., Awaitable[ResponseT]], request: Message
    ) -> ResponseT:
        try:
            response = await method(
                request, timeout=call_timeout(UNARY_TIMEOUT), metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise self.errors.rpc_error(exc) from None
        self.errors.answered()
        return response

    async def close(self) -> None:
        await self._channel.close()


# -- engine -------------------------------------------------------------------------------------


class GenerateStream:
    """One Generate stream: adds and aborts out, each engine step's outputs in (`steps`), in
    order; on the engine's Generate socket when it offers one that answers, else on gRPC's
    Generate (the socket's messages are the same, without gRPC's thread hand-offs per message).
    Transport only: whoever reads it decides what a step or a break means."""

    def __init__(self, client: EngineClient) -> None:
        self.address = client.address
        self._client = client
        # None ends the messages: the task that sends them must not be left waiting on the
        # queue when the stream is over (a coroutine left so outlives its event loop, and its
        # finalizer then raises in whatever the garbage collector interrupted).
        self._outbox: asyncio.Queue[wire.GenerateMessage | None] = asyncio.Queue()
        self.cancelled = False  # by cancel(): the stream did not break
        self.ended: Exception | None = None  # why it ended, once it has
        self._call: Any = None  # the gRPC call, when on gRPC
        self._socket: GenerateSocketConnection | None = None

    @property
    def transport(self) -> str | None:
        """What carries the stream once it has opened, "socket" or "grpc"; None before."""
        if self._socket is not None:
            return "socket"
        return None if self._call is None else "grpc"

    async def _messages(self) -> AsyncIterator[wire.GenerateMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _responses(self) -> AsyncIterator[wire.GenerateResponse]:
        self._socket = await self._client.generate_socket()
        if self.cancelled:
            if self._socket is not None:
                self._socket.close()
            return
        if self._socket is None:
            self._call = self._client.generate_call(self._messages())
            async for response in self._call:
                yield response
            return
        sender = asyncio.create_task(self._send(self._socket))
        try:
            async for response in self._socket.responses():
                yield response
        finally:
            sender.cancel()
            self._socket.close()

    async def _send(self, socket: GenerateSocketConnection) -> None:
        async for message in self._messages():
            socket.send(message)

    async def steps(self) -> AsyncGenerator[list[StepOutput], None]:
        """Each engine step's outputs until the stream ends; `ended` then says why."""
        errors = self._client.errors
        try:
            async for response in self._responses():
                yield wire.step_outputs(response)
        except grpc.aio.AioRpcError as exc:
            self.ended = errors.rpc_error(exc)
        except GenerateSocketEnded as exc:
            self.ended = errors.error(exc.code, exc.message)
        else:  # cancelled, or it ended without a status (worth a log line)
            self.ended = (
                UnavailableError("engine unavailable")
                if self.cancelled
                else errors.error(grpc.StatusCode.UNAVAILABLE, "the Generate stream ended")
            )
        finally:
            self._outbox.put_nowait(None)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        pooling: PoolingParams | None = None,
    ) -> None:
        self._outbox.put_nowait(
            wire.add_request(
                request_id,
                prompt_token_ids,
                params,
                priority,
                pooling,
                service=current_service_level(),
                lora_name=current_lora(),
                pin=current_pin(),
            )
        )

    def abort(self, request_ids: Sequence[str], samples: Sequence[tuple[str, int]] = ()) -> None:
        """Abort requests and single samples (request id, index), in one message."""
        self._outbox.put_nowait(wire.abort_request(request_ids, samples))

    def cancel(self) -> None:
        """End the stream, which aborts on the engine every request it carried."""
        self.cancelled = True
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._socket is not None:
            self._socket.close()


class EngineClient(_ServiceClient):
    service = "engine"

    def __init__(self, address: str, token: str | None = None) -> None:
        super().__init__(address, token)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._socket_unreachable = False  # said once in the log

    def generate_stream(self) -> GenerateStream:
        """A new Generate stream: one per replica carries all of the gateway's requests."""
        return GenerateStream(self)

    def generate_call(self, messages: AsyncIterator[wire.GenerateMessage]) -> Any:
        """gRPC's Generate, sending `messages`."""
        return self._stub.Generate(messages, metadata=self._metadata)

    async def generate_socket(self) -> GenerateSocketConnection | None:
        """A connection to the engine's Generate socket, when it offers one that answers; None
        for gRPC's Generate (GenerateSocketEnded when the engine refuses the connection)."""
        try:
            port = (await self.model_info()).generate_socket_port
        except FolioError:
            return None  # gRPC's Generate says what is wrong
        if not port:
            return None
        host = self.address.rsplit(":", 1)[0].strip("[]")
        try:
            authorization = dict(self._metadata).get(AUTHORIZATION, "")
            connection = await open_generate_socket(host, port, authorization)
        except (OSError, TimeoutError, FrameError) as exc:
            if not self._socket_unreachable:
                logger.warning(
                    "engine %s: its Generate socket (port %d) does not answer (%s); streaming "
                    "on gRPC's Generate",
                    self.address,
                    port,
                    exc or type(exc).__name__,
                )
                self._socket_unreachable = True
            return None
        logger.info("engine %s: streaming on its Generate socket (port %d)", self.address, port)
        return connection

    async def model_info(self) -> EngineModel:
        return wire.engine_model(
            await self._unary(self._stub.GetModelInfo, wire.model_info_request())
        )

    async def stats(self) -> EngineStats:
        return wire.engine_stats(await self._unary(self._stub.GetStats, wire.stats_request()))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._unary(self._stub.LoadLoraAdapter, wire.load_lora_request(name, path))

    async def unload_lora_adapter(self, name: str) -> None:
        await self._unary(self._stub.UnloadLoraAdapter, wire.unload_lora_request(name))

    async def lora_adapters(self) -> dict[str, bool]:
        return wire.lora_adapters(
            await self._unary(self._stub.ListLoraAdapters, wire.list_lora_request())
        )

    async def kv_events(
        self, start_sequence_number: int, epoch: str
    ) -> AsyncIterator[KvEventBatch]:
        """The engine's KV event batches from `start_sequence_number` of `epoch` on (a replay,
        or a snapshot), then live; raises grpc.aio.AioRpcError when the stream breaks."""
        call = self._stub.SubscribeKvEvents(
            wire.kv_events_request(start_sequence_number, epoch), metadata=self._metadata
        )
        async for batch in call:
            yield wire.kv_event_batch(batch)


# -- tokenizer ----------------------------------------------------------------------------------


class TokenizerClient(_ServiceClient):
    service = "tokenizer"

    def __init__(self, address: str, token: str | None = None) -> None:
        super().__init__(address, token)
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel)

    async def tokenize_text(
        self, text: str, add_special_tokens: bool = True, return_token_strs: bool = False
    ) -> Tokenized:
        request = wire.tokenize_text_request(text, add_special_tokens, return_token_strs)
        return wire.tokenized(await self._unary(self._stub.Tokenize, request))

    async def tokenize_chat(self, chat: ChatPrompt, return_token_strs: bool = False) -> Tokenized:
        request = wire.tokenize_chat_request(chat, return_token_strs)
        return wire.tokenized(await self._unary(self._stub.Tokenize, request))

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        request = wire.detokenize_request(token_ids, skip_special_tokens)
        return wire.detokenized(await self._unary(self._stub.Detokenize, request))

    async def info(self) -> TokenizerInfo:
        """The formats the model's chat template teaches and the sampling it recommends."""
        return wire.tokenizer_info(await self._unary(self._stub.GetInfo, wire.info_request()))

    async def tokenizer_json(self) -> str:
        """The tokenizer itself as its JSON text (GetTokenizerJson), for detokenizing in this
        process."""
        call = self._stub.GetTokenizerJson(
            wire.tokenizer_json_request(),
            timeout=call_timeout(UNARY_TIMEOUT),
            metadata=self._metadata,
        )
        try:
            chunks = [chunk async for chunk in call]
        except grpc.aio.AioRpcError as exc:
            raise self.errors.rpc_error(exc) from None
        self.errors.answered()
        return wire.tokenizer_json(chunks)
