"""One engine replica's session: its Generate stream and the output processor of the requests
on it.

The session opens the replica's Generate stream when a request needs one (a fresh one after the
last broke), sends each request and abort on it, and reads it: every engine step goes to its
output processor, and when the stream ends the processor fails what it still carried (the pool
may place those not started yet elsewhere). A bug the processor lets out is the gateway's, not
the replica's: it is logged, the call is cancelled (which aborts its requests on the engine)
and the replica stays in rotation. The session never chooses a replica (the pool does) and
never turns tokens into text itself (its processor does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from common.errors import UnavailableError
from common.sampling_params import SamplingParams
from gateway.engines.clients import EngineClient, GenerateStream
from gateway.messages import StepOutput
from gateway.metrics import Metrics
from gateway.pipeline.output_processor import (
    OutputProcessingError,
    OutputProcessor,
    RetryHook,
    TrackedRequest,
)

logger = logging.getLogger(__name__)


class ReplicaSession:
    """The requests of one replica: sent on its Generate stream, read back through its output
    processor."""

    def __init__(
        self,
        client: EngineClient,
        metrics: Metrics,
        retry: RetryHook,
        on_broken: Callable[[], None],
        on_outputs: Callable[[Sequence[StepOutput]], None] | None = None,
    ) -> None:
        """`retry`: offered each request a broken stream had not started; `on_broken`: told
        when the stream breaks, before its requests fail; `on_outputs`: given each step's
        outputs once processed."""
        self.client = client
        self.processor = OutputProcessor(self._abort, metrics, retry)
        self._on_broken = on_broken
        self._on_outputs = on_outputs
        self._stream: GenerateStream | None = None
        self._reader: asyncio.Task[None] | None = None
        # Generate streams that broke (the engine died or restarted): what the gateway learnt
        # from the engine before then may no longer hold.
        self.broken_streams = 0

    def submit(self, request: TrackedRequest, params: SamplingParams, priority: int) -> None:
        if self._stream is None:
            self._stream = self.client.generate_stream()
            self._reader = asyncio.create_task(self._read(self._stream))
        self.processor.add(request)
        self._stream.add(
            request.request_id, request.text.prompt_ids, params, priority, request.text.pooling
        )

    def release(self, requests: Iterable[TrackedRequest]) -> None:
        """The callers stopped listening: abort what still runs of these requests."""
        self.processor.release(requests)

    def _abort(self, request_ids: Sequence[str], samples: Sequence[tuple[str, int]]) -> None:
        if self._stream is not None:
            self._stream.abort(request_ids, samples)

    async def _read(self, stream: GenerateStream) -> None:
        error: Exception | None = None
        try:
            async with contextlib.aclosing(stream.steps()) as steps:
                async for outputs in steps:
                    self.processor.process_outputs(outputs)
                    if self._on_outputs is not None:
                        self._on_outputs(outputs)
        except Exception as exc:
            logger.exception("engine %s: processing the Generate stream failed", stream.address)
            error = OutputProcessingError(f"processing the engine's outputs failed: {exc}")
            stream.cancel()
        finally:
            self._stream = None
            if not stream.cancelled:
                self.broken_streams += 1
                self._on_broken()
            self.processor.fail_all(error or stream.ended or UnavailableError("engine unavailable"))

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)  # it ends CANCELLED
