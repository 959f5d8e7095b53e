"""One Generate stream's requests on the engine, whichever transport carries the stream (gRPC's
Generate, or the Generate socket): each client message becomes an add or an abort on the
AsyncEngine, and the stream's live requests are counted, so that a request id is not used twice
on it and whatever it still carries is aborted when it goes away.

The transport reads and writes; this module never does, and never decides what a request means
beyond the stream's own rules (the engine library validates the rest).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from common.grpc_stubs.folio.v1 import engine_pb2 as pb

from common.errors import UnavailableError
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams, parent_request_id, sample_request_id
from common.sampling_proto import sampling_params_from_proto
from common.service_level import ServiceLevel
from engine.async_engine import AsyncEngine, Event, EventSink, RequestFailed
from engine.errors import InvalidRequestError
from services.engine.convert import error_output

if TYPE_CHECKING:
    from common.grpc_server import GrpcService

# Why a stream ends with INVALID_ARGUMENT when `handle` says a message is malformed.
MALFORMED_MESSAGE = "GenerateRequest must set add or abort"


def unreadable(error: Exception) -> str:
    """Why a stream ends with INVALID_ARGUMENT when a message does not parse or act."""
    return f"reading the request stream failed: {error}"


def abort_ids(request: pb.AbortRequest) -> list[str]:
    """The engine library's ids of what an AbortRequest names: requests, and single samples
    (by SampleRef, or already in the library's own "<request_id>#<index>" form)."""
    return [
        *request.request_ids,
        *(sample_request_id(s.request_id, s.index) for s in request.samples),
    ]


def _service_level(request: pb.EngineRequest) -> ServiceLevel:
    return ServiceLevel(
        request.tenant,
        request.tenant_weight or 1.0,
        request.slo_ttft_ms if request.HasField("slo_ttft_ms") else None,
        request.slo_total_ms if request.HasField("slo_total_ms") else None,
    )


class GenerateSession:
    """The requests of one stream. `handle` runs on the event loop; `count` wherever the
    stream's events are seen (the loop, or the engine's loop thread for the socket)."""

    def __init__(
        self,
        service: GrpcService,
        engine: AsyncEngine,
        events: asyncio.Queue | EventSink,
        reject: Callable[[pb.GenerateResponse], None],
    ) -> None:
        """`events`: where the requests' outputs go; `reject`: sends a request's refusal the
        session answers itself."""
        self._service = service
        self._engine = engine
        self._events = events
        self._reject = reject
        self._lock = threading.Lock()
        # Live requests -> how many of their samples have not ended (n, or 1).
        self._live: dict[str, int] = {}

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._live

    def count(self, events: Sequence[Event]) -> None:
        """Forget the requests these events end."""
        with self._lock:
            for event in events:
                if isinstance(event, RequestFailed):
                    self._live.pop(event.request_id, None)
                elif event.finished:
                    left = self._live.pop(event.request_id, 1) - 1
                    if left:
                        self._live[event.request_id] = left

    def abort_live(self) -> None:
        """The stream went away: nothing of it may keep holding KV blocks."""
        with self._lock:
            live = list(self._live)
        if live:
            self._engine.abort(live)

    def handle(self, message: pb.GenerateRequest) -> bool:
        """Act on one client message; False if it is malformed."""
        action = message.WhichOneof("action")
        if action == "abort":
            # Only this stream's requests (or their samples); the unary Abort reaches any.
            with self._lock:
                ids = [
                    r
                    for r in abort_ids(message.abort)
                    if r in self._live or parent_request_id(r) in self._live
                ]
            self._engine.abort(ids)
        elif action == "add":
            self._add(message.add)
        else:
            return False
        return True

    def _refuse(self, request_id: str, error: Exception) -> None:
        self._reject(pb.GenerateResponse(outputs=[error_output(request_id, error)]))

    def _add(self, request: pb.EngineRequest) -> None:
        if not request.request_id:
            self._refuse("", InvalidRequestError("request_id must not be empty"))
            return
        with self._lock:
            in_use = request.request_id in self._live
        if in_use:
            self._refuse(
                request.request_id,
                InvalidRequestError(
                    f"request_id {request.request_id!r} is already in use on this stream"
                ),
            )
            return
        try:
            self._service.check_available()  # draining refuses new requests
        except UnavailableError as exc:
            self._refuse(request.request_id, exc)
            return
        params = sampling_params_from_proto(request.sampling_params)
        pooling = None
        if request.HasField("pooling"):
            pooling = PoolingParams(
                request.pooling.dimensions if request.pooling.HasField("dimensions") else None
            )
            params = SamplingParams()  # ignored: an embedding request generates nothing
        with self._lock:
            self._live[request.request_id] = params.n  # an invalid n fails the request instead
        self._engine.add_request(
            request.request_id,
            request.prompt_token_ids,
            params,
            self._events,
            request.priority,
            pooling,
            service=_service_level(request),
            lora_name=request.lora_name or None,
            pin_ttl_seconds=request.pin_ttl_seconds,
            pin_owner=request.pin_owner,
            pin_owner_max_bytes=(
                request.pin_owner_max_bytes if request.HasField("pin_owner_max_bytes") else None
            ),
        )
