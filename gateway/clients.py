"""The gateway's async gRPC clients of the engine and tokenizer services.

Every request of this gateway rides on one long-lived, multiplexed Engine.Generate stream
rather than one stream per request: the engine then sends one message per step for all of
them instead of one per request per step, and per-message cost is what limits Python gRPC at
high concurrency. A broken stream fails the requests it carried; the next request opens a
fresh one. Every call carries the internal token when there is one (FOLIO_INTERNAL_TOKEN), and
unary calls carry what is left of their request's deadline (gateway/deadlines.py). Transport and
translation only: this module never validates or decides anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import bearer_metadata
from common.config import GRPC_MESSAGE_OPTIONS, RECONNECT_CHANNEL_OPTIONS
from common.errors import UnavailableError, error_for
from common.sampling_params import sample_request_id
from gateway.deadlines import call_timeout

# Unary calls are quick (tokenize, stats); a stuck service must not hang an HTTP request.
UNARY_TIMEOUT = 30.0
HEALTH_TIMEOUT = 2.0
CHANNEL_OPTIONS = [*GRPC_MESSAGE_OPTIONS, *RECONNECT_CHANNEL_OPTIONS]


def _error(exc: grpc.aio.AioRpcError, service: str) -> Exception:
    return error_for(exc.code(), f"{service}: {exc.details() or exc.code().name}")


class _ServiceClient:
    """A channel to one of the internal services: unary calls with a timeout and errors mapped
    to the library's exceptions, and its health."""

    service = ""  # named in error messages

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._metadata = bearer_metadata(token)  # the internal token, if the service wants one

    async def serving(self) -> bool:
        try:
            response = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def _unary(self, method, request):
        try:
            return await method(
                request, timeout=call_timeout(UNARY_TIMEOUT), metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.service) from None


# -- engine -------------------------------------------------------------------------------------


class EngineRequest:
    """One request on the shared Generate stream: read its outputs, abort it, let it go. With
    n > 1 the samples' outputs interleave (told apart by index); it is done when each sample
    has ended."""

    def __init__(self, stream: _GenerateStream, request_id: str, num_samples: int = 1) -> None:
        self.request_id = request_id
        self._stream = stream
        self._outputs: asyncio.Queue[engine_pb2.RequestOutput | Exception] = asyncio.Queue()
        self._samples_left = num_samples
        self.done = False

    async def next(self) -> engine_pb2.RequestOutput:
        """The next output; raises the request's error (a FolioError) if it failed."""
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        if item.HasField("error"):
            self.done = True
            raise error_for(item.error.code, item.error.message, item.error.param or None)
        self._samples_left -= item.finished
        self.done = self._samples_left <= 0
        return item

    async def abort(self) -> engine_pb2.RequestOutput | None:
        """Abort and wait for the engine to confirm with the last output (its blocks are freed
        then); None if the request had already ended."""
        if self.done:
            return None
        self._stream.send_abort(self.request_id)
        while not (last := await self.next()).finished or not self.done:
            pass
        return last

    def abort_sample(self, index: int) -> None:
        """Abort one sample of an n > 1 request, without waiting: its last output (ABORT, or
        its own end if that came first) follows among the others'."""
        if not self.done:
            self._stream.send_abort(sample_request_id(self.request_id, index))

    def close(self) -> None:
        """Stop listening; a request still live is aborted without waiting."""
        if not self.done:
            self.done = True
            self._stream.send_abort(self.request_id)
        self._stream.forget(self.request_id)


class _GenerateStream:
    def __init__(
        self,
        stub: engine_pb2_grpc.EngineServiceStub,
        on_broken: Callable[[], None],
        metadata: Sequence[tuple[str, str]],
    ) -> None:
        self._outbox: asyncio.Queue[engine_pb2.GenerateRequest] = asyncio.Queue()
        self._requests: dict[str, EngineRequest] = {}
        self.closed = False
        self._on_broken = on_broken
        self._cancelled = False  # by close(): the stream did not break
        self._call = stub.Generate(self._messages(), metadata=metadata)
        self._reader = asyncio.create_task(self._read())

    async def _messages(self) -> AsyncIterator[engine_pb2.GenerateRequest]:
        while True:
            yield await self._outbox.get()

    async def _read(self) -> None:
        error: Exception = UnavailableError("engine: the Generate stream ended")
        try:
            async for response in self._call:
                for output in response.outputs:
                    request = self._requests.get(output.request_id)
                    if request is not None:  # else: already let go (aborted, client left)
                        request._outputs.put_nowait(output)
        except grpc.aio.AioRpcError as exc:
            error = _error(exc, "engine")
        finally:
            self.closed = True
            if not self._cancelled:
                self._on_broken()
            for request in self._requests.values():
                request._outputs.put_nowait(error)
            self._requests.clear()

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        priority: int,
    ) -> EngineRequest:
        request = EngineRequest(self, request_id, params.n if params.HasField("n") else 1)
        self._requests[request_id] = request
        self._outbox.put_nowait(
            engine_pb2.GenerateRequest(
                add=engine_pb2.EngineRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=params,
                    priority=priority,
                )
            )
        )
        return request

    def send_abort(self, request_id: str) -> None:
        if not self.closed:
            self._outbox.put_nowait(
                engine_pb2.GenerateRequest(abort=engine_pb2.AbortRequest(request_ids=[request_id]))
            )

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    async def close(self) -> None:
        self._cancelled = True
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)  # it ends CANCELLED


class EngineClient(_ServiceClient):
    service = "engine"

    def __init__(self, address: str, token: str | None = None) -> None:
        super().__init__(address, token)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._stream: _GenerateStream | None = None
        # Generate streams that broke (the engine died or restarted): what the gateway learnt
        # from the engine before then may no longer hold.
        self.broken_streams = 0

    def _stream_broke(self) -> None:
        self.broken_streams += 1

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        priority: int = 0,
    ) -> EngineRequest:
        if self._stream is None or self._stream.closed:
            self._stream = _GenerateStream(self._stub, self._stream_broke, self._metadata)
        return self._stream.add(request_id, prompt_token_ids, params, priority)

    async def model_info(self) -> engine_pb2.GetModelInfoResponse:
        return await self._unary(self._stub.GetModelInfo, engine_pb2.GetModelInfoRequest())

    async def stats(self) -> engine_pb2.GetStatsResponse:
        return await self._unary(self._stub.GetStats, engine_pb2.GetStatsRequest())

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        await self._channel.close()


# -- tokenizer ----------------------------------------------------------------------------------


class DetokenizeSession:
    """One generation's DetokenizeStream: token ids in, certain text out, one reply per push."""

    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerServiceStub,
        options: tok_pb2.DetokenizeOptions,
        metadata: Sequence[tuple[str, str]],
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._options = options
        self._call = None
        self._opening: asyncio.Future | None = None

    def open(self) -> None:
        """Open the stream and send the options now, reading their (empty) reply in the
        background: called while the engine computes the prompt, it takes the stream's set-up
        off the path to the first token."""
        if self._call is None:
            self._call = self._stub.DetokenizeStream(metadata=self._metadata)
            self._opening = asyncio.ensure_future(
                self._exchange(tok_pb2.DetokenizeStreamRequest(options=self._options))
            )

    async def push(
        self, token_ids: Sequence[int], finish: bool = False
    ) -> tok_pb2.DetokenizeStreamResponse:
        self.open()
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening
        return await self._exchange(
            tok_pb2.DetokenizeStreamRequest(token_ids=token_ids, finish=finish)
        )

    async def _exchange(
        self, request: tok_pb2.DetokenizeStreamRequest
    ) -> tok_pb2.DetokenizeStreamResponse:
        try:
            await self._call.write(request)
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, "tokenizer") from None
        except asyncio.InvalidStateError:
            # The stream had already ended between two pushes (the tokenizer went away).
            raise error_for(
                await self._call.code(), f"tokenizer: {await self._call.details()}"
            ) from None
        if response is grpc.aio.EOF:
            raise UnavailableError("tokenizer: the DetokenizeStream ended early")
        return response

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            # A failure nobody pushed after is not news: the stream is being dropped anyway.
            self._opening.add_done_callback(lambda done: done.cancelled() or done.exception())
        if self._call is not None:
            self._call.cancel()


class TokenizerClient(_ServiceClient):
    service = "tokenizer"

    def __init__(self, address: str, token: str | None = None) -> None:
        super().__init__(address, token)
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel)

    async def tokenize(self, request: tok_pb2.TokenizeRequest) -> tok_pb2.TokenizeResponse:
        return await self._unary(self._stub.Tokenize, request)

    async def detokenize(self, request: tok_pb2.DetokenizeRequest) -> tok_pb2.DetokenizeResponse:
        return await self._unary(self._stub.Detokenize, request)

    async def info(self) -> tok_pb2.GetInfoResponse:
        return await self._unary(self._stub.GetInfo, tok_pb2.GetInfoRequest())

    def detokenize_stream(self, options: tok_pb2.DetokenizeOptions) -> DetokenizeSession:
        return DetokenizeSession(self._stub, options, self._metadata)

    async def close(self) -> None:
        await self._channel.close()
