"""Runs an LLMEngine in a thread of its own, so that asyncio callers (the engine service) never
stall a step and a step never waits on them.

The engine is built in the loop thread too, so all torch work of the process stays on one
thread: when several threads run parallel regions, OpenMP throttles its spin-waiting and every
step of this small-op model gets much slower (docs/serving.md has the figure).

Callers post commands to a thread-safe inbox; the loop thread runs them between steps, steps
while requests remain, and hands each step's outputs to the sink registered for each request,
one list of events per sink per step: an asyncio queue, through loop.call_soon_threadsafe, or a
sink of the caller's that takes them in the loop thread without waking any other (the engine
service's Generate socket writes them to its connection). Requests may share a sink (one stream
multiplexes many). With a stream interval above 1 (the engine
config's), a request's outputs are gathered until that many tokens are ready, so that a step
whose requests all gather wakes no consumer at all. Only the loop thread touches the LLMEngine.
This module never imports grpc and never blocks on a consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.service_level import NO_SERVICE_LEVEL, ServiceLevel
from engine.core.outputs import EngineStats, RequestOutput, StepTimings
from engine.engine import LLMEngine
from engine.errors import EngineError, EngineGroupError
from engine.lora.registry import lora_listing

logger = logging.getLogger(__name__)


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _glibc_malloc_trim()

# The loop thread's name as the OS shows it (top -H, /proc/<pid>/task/<tid>/comm). Threads it
# starts inherit it: OpenMP's workers, which run its steps, first of all. So the CPU the steps
# take can be told apart from what the service around them takes per token (the event loop,
# gRPC's threads): `folio bench serve` prints the latter.
STEP_THREAD_NAME = "folio-engine"
_PR_SET_NAME = 15


def _name_this_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux, at most 15 bytes); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])


def release_free_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc; elsewhere nothing).

    Steps of varied batch shapes allocate and free activations of every size; glibc keeps
    what they freed, so without this the engine's resident memory creeps up under load and
    stays there. Called when the engine goes idle, where its cost (about a millisecond) is free.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _settle(target: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    """Give `target` the outcome of `done`."""
    if (error := done.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(done.result())


@dataclass
class RequestFailed:
    """A request that could not start (validation, full queue) or died with a failed step."""

    request_id: str
    error: Exception


Event = RequestOutput | RequestFailed


class OutputGathering:
    """Holds each request's outputs until `interval` new tokens have gathered, joined into one
    output: a request's first output (its first token: time to first token is not delayed)
    and its last (finished: ended, aborted, failed at a deadline) leave at once, the latter
    with whatever was held before it. Interval 1 holds nothing."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[tuple[str, int], RequestOutput] = {}  # (request id, sample index)

    def ready(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Of this step's outputs (joined with what was held of their requests), those to send
        now; the rest are held."""
        if self.interval == 1:
            return outputs
        ready = []
        for output in outputs:
            key = (output.request_id, output.index)
            if (held := self._held.pop(key, None)) is not None:
                output = dataclasses.replace(
                    output,
                    new_token_ids=held.new_token_ids + output.new_token_ids,
                    new_logprobs=held.new_logprobs + output.new_logprobs,
                    prompt_logprobs=held.prompt_logprobs or output.prompt_logprobs,
                )
            first = output.num_output_tokens == len(output.new_token_ids)
            if output.finished or first or len(output.new_token_ids) >= self.interval:
                ready.append(output)
            else:
                self._held[key] = output
        return ready

    def release(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """What is held of these requests (they are failing): the tokens they did generate."""
        wanted = set(request_ids)
        keys = [key for key in self._held if key[0] in wanted]
        return [self._held.pop(key) for key in keys]


class EventSink(Protocol):
    """Where requests' events go. `deliver` runs in the loop thread, once per step with that
    step's events of the sink's requests in order; it must never block on the consumer."""

    def deliver(self, events: list[Event]) -> None: ...


@dataclass(frozen=True)
class QueueSink:
    """Events as lists put on an asyncio queue, in the event loop that owns it (one wake-up of
    that loop per step)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def deliver(self, events: list[Event]) -> None:
        # RuntimeError: the consumer's event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, events)


class AsyncEngine:
    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        on_fatal: Callable[[EngineGroupError], None] | None = None,
    ) -> None:
        """`on_fatal(error)` runs in the loop thread when the engine cannot go on (a
        tensor-parallel rank died): live requests have been failed and the loop is ending."""
        self._build_engine = build_engine
        self._on_fatal = on_fatal
        self.engine: LLMEngine | None = None  # set by the loop thread before `start` resolves
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, EventSink] = {}  # live request id -> its sink; loop thread only
        self._gathering = OutputGathering(1)  # the engine config's interval once it is built
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="folio-engine-loop", daemon=True)

    # -- called from asyncio code ---------------------------------------------------------------

    def start(self) -> concurrent.futures.Future[None]:
        """Start the loop thread; resolves once it has built the engine (or with the error)."""
        self._thread.start()
        return self._ready

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        events: asyncio.Queue | EventSink,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        service: ServiceLevel = NO_SERVICE_LEVEL,
        lora_name: str | None = None,
        pin_ttl_seconds: float = 0.0,
        pin_owner: str = "",
        pin_owner_max_bytes: int | None = None,
    ) -> None:
        """Queue a request (an embedding request with `pooling`; with the LoRA adapter
        `lora_name`; its prompt pinned for pin_ttl_seconds, as pin_owner's pins, of which at
        most pin_owner_max_bytes at once). Its outputs, or one RequestFailed, arrive in
        `events` as lists (a queue: of the running event loop)."""
        sink = (
            QueueSink(asyncio.get_running_loop(), events)
            if isinstance(events, asyncio.Queue)
            else events
        )
        queued = time.monotonic()
        # Its deadlines count from now: the wait for the loop to take it is spent from them.
        self._inbox.put(
            lambda: self._add(
                request_id,
                list(prompt_token_ids),
                params,
                priority,
                pooling,
                sink,
                service.after(time.monotonic() - queued),
                lora_name,
                pin_ttl_seconds,
                pin_owner,
                pin_owner_max_bytes,
            )
        )

    def abort(self, request_ids: Sequence[str]) -> concurrent.futures.Future[list[str]]:
        """Abort requests and free their KV blocks; resolves to the ids that were live.

        Each aborted request's queue gets a last output with FinishReason.ABORT (one per live
        sample of an n > 1 request; a sample id, sample_request_id, aborts that sample alone).
        Callers that do not need the answer (a cancelled stream) may drop the future.
        """
        return self._call(self._abort, list(request_ids))

    def load_lora_adapter(self, name: str, path: str) -> concurrent.futures.Future[None]:
        """Serve a LoRA adapter from now on (LLMEngine.load_lora_adapter: its rules and errors):
        its files are read and checked on a thread of their own while the engine steps on, and
        the loop serves it between two steps."""
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()

        def read_then_serve() -> None:
            try:
                read = self._built().read_lora_adapter(name, path)
            except Exception as exc:
                loaded.set_exception(exc)
                return
            served = self._call(lambda: self._built().load_lora_adapter(name, path, read))
            served.add_done_callback(lambda done: _settle(loaded, done))

        threading.Thread(target=read_then_serve, name=f"lora-read-{name}", daemon=True).start()
        return loaded

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter: new requests for it are refused from the loop's next
        command on; returns once its running requests have ended and it is freed (NotFound if
        no such adapter is served)."""
        gone: concurrent.futures.Future[None] = concurrent.futures.Future()
        await asyncio.wrap_future(
            self._call(
                lambda: self._built().unload_lora_adapter(name, lambda: gone.set_result(None))
            )
        )
        await asyncio.wrap_future(gone)

    async def lora_adapters(self) -> list[tuple[str, bool]]:
        """The LoRA adapters served, each with whether it is resident in a slot."""
        return await asyncio.wrap_future(self._call(lambda: lora_listing(self._built().lora)))

    async def stats(self) -> tuple[EngineStats, StepTimings]:
        """Counters read between steps, so they are consistent with each other."""
        return await asyncio.wrap_future(
            self._call(lambda: (self._built().stats(), dataclasses.replace(self._built().timings)))
        )

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop: requests still live are aborted (their queues are told), KV freed."""
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as exc:
                    future.set_exception(exc)

        self._inbox.put(command)
        return future

    # -- the loop thread ------------------------------------------------------------------------

    def _built(self) -> LLMEngine:
        """The engine, for the commands: they run only after the loop thread has built it."""
        if self.engine is None:
            raise RuntimeError("the engine has not been built yet")
        return self.engine

    def _run(self) -> None:
        _name_this_thread(STEP_THREAD_NAME)  # before the engine starts any thread of its own
        # The waiter may have given up (a stop during start-up cancels it): nobody to tell then.
        try:
            self.engine = self._build_engine()
            self._gathering = OutputGathering(self.engine.config.stream_interval)
        except BaseException as exc:
            if self._ready.set_running_or_notify_cancel():
                self._ready.set_exception(exc)
            return
        # A rank that dies while the loop waits for work: the loop wakes to fail and stop.
        self.engine.add_failure_listener(lambda error: self._inbox.put(lambda: self._fatal(error)))
        if self._ready.set_running_or_notify_cancel():
            self._ready.set_result(None)
        try:
            while not self._stopping:
                self._drain_inbox(wait=not self.engine.has_unfinished)
                if self.engine.has_unfinished and not self._stopping:
                    self._step()
                    if not self.engine.has_unfinished:
                        release_free_heap()
            # Commands posted before the stop still run; the requests they add are aborted
            # just below.
            self._drain_inbox(wait=False)
            self._abort(list(self._sinks))
        finally:
            self.engine.close()

    def _drain_inbox(self, wait: bool) -> None:
        try:
            command = self._inbox.get(block=wait)
            while True:
                if command is None:
                    self._stopping = True
                else:
                    command()
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        pooling: PoolingParams | None,
        sink: EventSink,
        service: ServiceLevel,
        lora_name: str | None,
        pin_ttl_seconds: float,
        pin_owner: str,
        pin_owner_max_bytes: int | None,
    ) -> None:
        try:
            self._built().add_request(
                request_id,
                prompt_token_ids,
                params,
                priority,
                pooling,
                service=service,
                lora_name=lora_name,
                pin_ttl_seconds=pin_ttl_seconds,
                pin_owner=pin_owner,
                pin_owner_max_bytes=pin_owner_max_bytes,
            )
        except Exception as exc:
            # EngineError is the caller's fault or a full queue; anything else is logged as a bug.
            if not isinstance(exc, EngineError):
                logger.exception("add_request(%r) failed", request_id)
            self._deliver([(sink, RequestFailed(request_id, exc))])
            return
        self._sinks[request_id] = sink

    def _step(self) -> None:
        try:
            outputs = self._built().step()
        except EngineGroupError as exc:
            self._fatal(exc)
            return
        except Exception as exc:
            # Fail this step's requests, not the process: the next requests may well succeed.
            logger.exception("engine step failed; failing every live request")
            self._fail(list(self._sinks), exc)
            return
        self._deliver(self._route(self._gathering.ready(outputs)))

    def _fatal(self, error: EngineGroupError) -> None:
        """The engine cannot go on: fail every live request with `error` and stop the loop."""
        if self._stopping:
            return
        logger.error("the engine cannot go on, failing every live request: %s", error)
        self._fail(list(self._sinks), error)
        self._stopping = True
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """These requests fail with `error`: what was held of them first, then the failure;
        their blocks are freed (nothing runs on the ranks)."""
        held = self._gathering.release(request_ids)
        for request_id in request_ids:
            self._built().abort(request_id)
        self._deliver(
            self._route(held) + [(self._sinks.pop(r), RequestFailed(r, error)) for r in request_ids]
        )

    def _abort(self, request_ids: list[str]) -> list[str]:
        """Abort by request id, or one sample of an n > 1 request by its sample id."""
        aborted: list[str] = []
        outputs: list[RequestOutput] = []
        for request_id in request_ids:
            ended = self._built().abort(request_id)
            if ended:
                aborted.append(request_id)
                outputs.extend(ended)
        self._deliver(self._route(self._gathering.ready(outputs)))
        return aborted

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[EventSink, Event]]:
        """Each output with its request's sink; a sink is let go once its request has left the
        engine (with n > 1, after the last sample's last output)."""
        events: list[tuple[EventSink, Event]] = [(self._sinks[o.request_id], o) for o in outputs]
        for out in outputs:
            if out.finished and out.request_id not in self._built().requests:
                self._sinks.pop(out.request_id, None)
        return events

    @staticmethod
    def _deliver(events: list[tuple[EventSink, Event]]) -> None:
        """One list per sink (equal queue sinks are one), in order; never waits for the
        consumer."""
        grouped: dict[EventSink, list[Event]] = {}
        for sink, event in events:
            grouped.setdefault(sink, []).append(event)
        for sink, batch in grouped.items():
            try:
                sink.deliver(batch)
            except Exception:  # the sink's bug: its requests go on, the engine too
                logger.exception("delivering a step's outputs failed")
