"""The engine service: EngineService over gRPC, a thin adapter on engine.async_engine.

Token ids in, token ids out: it never sees text or HTTP. The engine loop runs in its own thread
(AsyncEngine), so gRPC I/O never stalls a step. A stream's requests are tracked only to abort
them when the stream goes away; everything else is the library's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from common.grpc_stubs.folio.v1 import engine_pb2 as pb
from common.grpc_stubs.folio.v1 import engine_pb2_grpc

from common.config import EngineConfig
from common.default_model import model_name
from common.errors import FolioError, status_code_for
from common.grpc_server import GrpcService
from engine.async_engine import AsyncEngine
from engine.core.kv_events import KVEventBatch
from engine.engine import LLMEngine
from engine.errors import EngineGroupError
from services.engine.convert import event_to_proto, kv_event_batch_to_proto
from services.engine.generate_session import (
    MALFORMED_MESSAGE,
    GenerateSession,
    abort_ids,
    unreadable,
)
from services.engine.generate_socket import GenerateSocket

logger = logging.getLogger(__name__)
# How long a failed engine whose step is stuck in a tensor-parallel collective gets to fail its
# requests before the process exits.
TP_FAILURE_EXIT_SECONDS = 5.0


@dataclass
class _EndOfInput:
    """The client half-closed its side of the stream, or the stream must end with `code`:
    INVALID_ARGUMENT for something malformed it sent, INTERNAL for a failure of ours."""

    error: str | None = None
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, service: EngineService) -> None:
        self._service = service

    async def _engine(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncEngine:
        await self._service.abort_unless_available(context)
        assert self._service.engine is not None  # serving: warm-up built it
        return self._service.engine

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context
    ) -> AsyncIterator[pb.GenerateResponse]:
        engine = await self._engine(context)
        # Per step: list[Event] from the engine; a rejection the session answered itself; the end.
        inbox: asyncio.Queue = asyncio.Queue()
        session = GenerateSession(self._service, engine, inbox, inbox.put_nowait)
        reader = asyncio.create_task(self._read(request_iterator, session, inbox))
        input_done = False
        try:
            while not (input_done and session.idle):
                item = await inbox.get()
                if isinstance(item, _EndOfInput):
                    if item.error is not None:
                        await context.abort(item.code, item.error)
                    input_done = True
                elif isinstance(item, pb.GenerateResponse):
                    yield item
                else:
                    session.count(item)
                    yield pb.GenerateResponse(outputs=[event_to_proto(e) for e in item])
        finally:
            # Cancelled, failed or done: nothing of this stream may keep holding KV blocks.
            reader.cancel()
            session.abort_live()

    @staticmethod
    async def _read(request_iterator, session: GenerateSession, inbox: asyncio.Queue) -> None:
        messages = aiter(request_iterator)
        while True:
            try:
                message = await anext(messages)
            except StopAsyncIteration:
                break
            except Exception as exc:  # e.g. a message that does not parse: the client's
                inbox.put_nowait(_EndOfInput(unreadable(exc)))
                return
            try:
                handled = session.handle(message)
            except Exception as exc:  # acting on a readable message: a failure of ours
                logger.exception("Generate: acting on a request message failed")
                inbox.put_nowait(_EndOfInput(f"internal error: {exc}", grpc.StatusCode.INTERNAL))
                return
            if not handled:
                inbox.put_nowait(_EndOfInput(MALFORMED_MESSAGE))
                return
        inbox.put_nowait(_EndOfInput())

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        engine = await self._engine(context)
        aborted = await asyncio.wrap_future(engine.abort(abort_ids(request)))
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context
    ) -> pb.GetModelInfoResponse:
        llm = (await self._engine(context)).engine
        assert llm is not None  # serving: the engine thread built it
        config = llm.config
        return pb.GetModelInfoResponse(
            model=model_name(llm.model_path),
            model_path=str(llm.model_path),
            vocab_size=llm.vocab_size,
            max_model_len=llm.max_model_len,
            eos_token_ids=sorted(llm.eos_token_ids),
            dtype=llm.dtype_name,
            device=config.device,
            block_size=config.block_size,
            num_kv_blocks=llm.kv_cache.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            generate_socket_port=(
                self._service.generate_socket.port if self._service.generate_socket else 0
            ),
            kv_cache_dtype=llm.kv_cache_dtype_name,
        )

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        running = await self._engine(context)
        stats, timings = await running.stats()
        assert running.engine is not None  # serving: the engine thread built it
        return pb.GetStatsResponse(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            num_kv_blocks=stats.num_kv_blocks,
            block_size=running.engine.config.block_size,
            kv_cache_dtype=running.engine.kv_cache_dtype_name,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            num_steps=timings.steps,
            step_seconds=timings.as_dict(),
            queued_prefill_tokens=stats.queued_prefill_tokens,
            prefill_token_seconds=stats.prefill_token_seconds,
            decode_step_seconds=stats.decode_step_seconds,
            spec_num_drafts=stats.spec_num_drafts,
            spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
            kv_tier_hits=stats.kv_tier_hits,
            kv_tier_usage=stats.kv_tier_usage,
            kv_pinned_blocks=stats.kv_pinned_blocks,
            running_lora_adapters=stats.running_lora_adapters,
            waiting_lora_adapters=stats.waiting_lora_adapters,
            resident_lora_adapters=stats.resident_lora_adapters,
            max_lora=stats.max_lora,
            lora_requests=stats.lora_requests,
        )

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context
    ) -> pb.LoadLoraAdapterResponse:
        engine = await self._engine(context)
        loaded = asyncio.wrap_future(engine.load_lora_adapter(request.lora_name, request.lora_path))
        await _as_status(loaded, context)
        return pb.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context
    ) -> pb.UnloadLoraAdapterResponse:
        engine = await self._engine(context)
        await _as_status(engine.unload_lora_adapter(request.lora_name), context)
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context
    ) -> pb.ListLoraAdaptersResponse:
        listing = await (await self._engine(context)).lora_adapters()
        return pb.ListLoraAdaptersResponse(
            adapters=[pb.LoraAdapter(name=name, resident=resident) for name, resident in listing]
        )

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        llm = (await self._engine(context)).engine
        assert llm is not None  # serving: the engine thread built it
        loop = asyncio.get_running_loop()
        # None: the service is stopping (a drain must not wait for subscribers to leave).
        batches: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()

        def deliver(batch: KVEventBatch) -> None:  # in the engine thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(batches.put_nowait, batch)

        backlog, subscription = llm.kv_events.subscribe(
            request.start_sequence_number, request.epoch, deliver
        )
        self._service.kv_subscribers.add(batches)
        try:
            for batch in backlog:
                yield kv_event_batch_to_proto(batch)
            while (next_batch := await batches.get()) is not None:
                yield kv_event_batch_to_proto(next_batch)
        finally:
            subscription.close()
            self._service.kv_subscribers.discard(batches)


async def _as_status(call: Awaitable[None], context) -> None:
    """Await `call`; a FolioError it raises ends the RPC with its status and message."""
    try:
        await call
    except FolioError as exc:
        await context.abort(status_code_for(exc), str(exc))


def _exit_unless_stopped_soon(error: Exception) -> None:
    """A tensor-parallel group failed: the loop fails the requests and the service stops; if a
    step stuck in a collective keeps the loop from it, the process ends anyway (exit 1), so
    that `folio serve` restarts the group instead of waiting on it forever."""

    def exit_now() -> None:
        logger.error(
            "the engine did not stop %g s after %s; exiting", TP_FAILURE_EXIT_SECONDS, error
        )
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(TP_FAILURE_EXIT_SECONDS, exit_now)
    timer.daemon = True
    timer.start()


class EngineService(GrpcService):
    service_names = (pb.DESCRIPTOR.services_by_name["EngineService"].full_name,)

    def __init__(
        self,
        config: EngineConfig,
        host: str,
        port: int,
        build_engine: Callable[[], LLMEngine] | None = None,
        generate_socket_port: int = 0,
    ) -> None:
        """`build_engine` makes the engine in its loop thread (default: LLMEngine on the model
        executor, which alone loads torch and the model code; the simulated engines pass
        their own). `generate_socket_port`: where the Generate socket listens, on `host` (0: a
        free port; -1: no socket, Generate on gRPC only)."""
        super().__init__(host, port)
        self._generate_socket_port = generate_socket_port
        self.generate_socket: GenerateSocket | None = None
        if config.decode_compile == "auto":
            # A served engine answers at once, eagerly, while its decode programs get ready.
            config = dataclasses.replace(config, decode_compile="background")
        self.config = config
        self._build_engine = build_engine or functools.partial(LLMEngine, config)
        self.engine: AsyncEngine | None = None
        # The queues of the live SubscribeKvEvents streams.
        self.kv_subscribers: set[asyncio.Queue[KVEventBatch | None]] = set()

    def add_servicers(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(self), server)

    async def start(self) -> int:
        port = await super().start()
        if self._generate_socket_port >= 0:
            # A speed-up, not a necessity: without it, clients stream on gRPC's Generate.
            host = self.address.rsplit(":", 1)[0]
            try:
                self.generate_socket = GenerateSocket(self, host, self._generate_socket_port)
            except OSError as exc:
                logger.warning(
                    "no Generate socket (port %d: %s); Generate is served on gRPC only",
                    self._generate_socket_port,
                    exc,
                )
            else:
                self.generate_socket.start()
                logger.info("Generate socket on port %d", self.generate_socket.port)
        return port

    async def warm_up(self) -> None:
        # Loading the model takes seconds: in the engine's own thread (where every step runs),
        # off the event loop, so health checks get answers meanwhile. `close` joins that
        # thread, so a stop during warm-up waits for the load instead of killing it midway.
        loop = asyncio.get_running_loop()

        def on_fatal(error: EngineGroupError) -> None:
            loop.call_soon_threadsafe(self.fail, error)

        self.engine = AsyncEngine(self._build_engine, on_fatal=on_fatal)
        await asyncio.wrap_future(self.engine.start())
        engine = self.engine.engine
        assert engine is not None  # start() built it
        engine.add_failure_listener(_exit_unless_stopped_soon)

    async def drain(self, grace: float | None) -> None:
        if self.generate_socket is not None:
            await self.generate_socket.drain(grace)

    async def stop(self, grace: float | None) -> None:
        # KV event streams never end on their own: end them first, so the drain waits only for
        # requests in flight.
        for batches in self.kv_subscribers:
            batches.put_nowait(None)
        await super().stop(grace)

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
