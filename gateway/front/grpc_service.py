"""The gateway's public gRPC text API: folio.v1.GatewayService (Generate, Chat), server-streaming
text deltas over the same generation pipeline as the HTTP routes.

A thin adapter: calls in and answers out through the protobuf edge (gateway/wire.py), serving.py
(as the HTTP routes) between; errors become status codes through common.errors. Calls need an
API key in their metadata when the gateway has keys (UNAUTHENTICATED otherwise) and are rate
limited like HTTP requests (RESOURCE_EXHAUSTED). A call's ServiceLevel field asks what HTTP's
x-slo-* and x-tenant headers ask (limits/service_level.py) and may put it in the batch lane.
A call's deadline, or the gateway's request
timeout if sooner, bounds the calls it makes to the tokenizer and ends its generation
(DEADLINE_EXCEEDED). Cancelling the call closes the pipeline, which aborts the engine request.
It never holds business logic of its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from common.grpc_stubs.folio.v1 import gateway_pb2_grpc

from common.config import GatewayConfig
from common.errors import InvalidParameter, QueueFullError, status_code_for
from common.grpc_server import GrpcService
from common.sampling_params import BATCH_PRIORITY
from gateway import wire
from gateway.front.http_errors import log_failure
from gateway.front.serving import serve
from gateway.limits.auth import Access
from gateway.limits.deadlines import set_deadline
from gateway.limits.service_level import set_service_level
from gateway.messages import ChatPrompt, TextCall
from gateway.pipeline.generation import Gateway, new_request_id
from gateway.pipeline.text import TextDelta, TextRequest
from gateway.pipeline.validation import ModelInfo, text_request

_Context = grpc.aio.ServicerContext[Any, Any]
# Trailing metadata of a refusal that waiting would lift: whole seconds, as HTTP's Retry-After.
RETRY_AFTER = "retry-after"


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, service: GatewayGrpcService) -> None:
        self._service = service
        self._gateway = service.gateway
        self._access = service.access
        self._request_timeout = service.config.request_timeout

    async def Generate(
        self, request: wire.GenerateCall, context: _Context
    ) -> AsyncIterator[wire.GenerateAnswer]:
        async def plan(call: TextCall) -> TextRequest:
            info = await self._gateway.check_model(call.model)
            prompt = await self._gateway.tokenize_text(call.prompt)
            return self._text_request(info, prompt.token_ids, call, "prompt")

        async for delta in self._stream(request, plan, context):
            yield wire.generate_answer(delta)

    async def Chat(
        self, request: wire.ChatCall, context: _Context
    ) -> AsyncIterator[wire.ChatAnswer]:
        async def plan(call: TextCall) -> TextRequest:
            info = await self._gateway.check_model(call.model)
            prompt = await self._gateway.tokenize_chat(ChatPrompt(call.messages))
            return self._text_request(info, prompt.token_ids, call, "messages")

        async for delta in self._stream(request, plan, context):
            yield wire.chat_answer(delta)

    def _text_request(
        self, info: ModelInfo, prompt_ids: Sequence[int], call: TextCall, prompt_param: str
    ) -> TextRequest:
        params = call.params
        if params.n != 1:  # each call streams one sequence's text
            raise InvalidParameter(f"n must be 1 here (one sequence per call), got {params.n}", "n")
        return text_request(
            info,
            prompt_ids,
            params,
            prompt_param=prompt_param,
            stop=call.stop,
            include_stop_str_in_output=call.include_stop_str_in_output,
            priority=BATCH_PRIORITY if call.asked.batch else call.priority,
        )

    async def _stream(
        self,
        message: wire.GenerateCall | wire.ChatCall,
        plan: Callable[[TextCall], Awaitable[TextRequest]],
        context: _Context,
    ) -> AsyncIterator[TextDelta]:
        """The pipeline's deltas; an error ends the call with its status code (a refusal
        that waiting would lift tells how long in the trailing metadata's retry-after)."""
        arrival = time.monotonic()
        timeout = self._request_timeout
        if (remaining := context.time_remaining()) is not None:
            timeout = min(timeout, remaining)
        deadline = arrival + timeout
        set_deadline(deadline)  # this call's task: its tokenizer calls carry the deadline
        try:
            self._service.check_available()
            caller = self._access.admit_grpc(context)
            call = wire.text_call(message)
            # The engine schedules it by its tenant and deadlines (its ServiceLevel, its key's).
            set_service_level(self._access.service_levels.of_call(caller, call.asked), arrival)
            request = await plan(call)
            deltas = serve(
                self._gateway,
                self._access.limiter,
                caller,
                [request],
                new_request_id("grpc"),
                arrival,
                deadline,
                timeout,
            )
            async with contextlib.aclosing(deltas):
                async for _, delta in deltas:
                    yield delta
        except Exception as exc:
            log_failure(exc)
            if context.done():  # the caller's own deadline passed: its call is already over
                return
            if isinstance(exc, QueueFullError) and exc.retry_after is not None:
                context.set_trailing_metadata(((RETRY_AFTER, str(exc.retry_after)),))
            await context.abort(status_code_for(exc), str(exc))


class GatewayGrpcService(GrpcService):
    """Health, reflection and drain come from GrpcService; serving needs no warm-up."""

    service_names = (wire.GATEWAY_SERVICE,)

    def __init__(
        self,
        gateway: Gateway,
        host: str,
        port: int,
        config: GatewayConfig | None = None,
        access: Access | None = None,
    ) -> None:
        super().__init__(host, port)
        self.gateway = gateway
        self.config = config or GatewayConfig()
        self.access = access or Access(self.config)
        self.require_keys(
            self.access.keys, "API key", open_health=not self.access.protect_health_metrics
        )
        if self.config.ssl_keyfile is not None and self.config.ssl_certfile is not None:
            self.serve_tls(self.config.ssl_keyfile, self.config.ssl_certfile)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(self), server)
