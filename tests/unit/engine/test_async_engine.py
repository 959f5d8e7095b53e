"""AsyncEngine: a stop that comes while the loop thread still builds the engine (the service
cancelled its wait) ends the thread quietly, whether the build then succeeds or fails; with a
stream interval, a request's outputs gather into fewer, larger ones and none of its tokens is
lost (the first leaves at once, an abort sends what was held); a sink that fails stops neither
the engine nor the other requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers import LlamaConfig

from common.config import EngineConfig
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine, RequestFailed
from engine.engine import LLMEngine
from tiny_models import SMALL, make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_checkpoint(
        directory, LlamaConfig, dict(SMALL, num_attention_heads=4, num_key_value_heads=2)
    )
    return directory


@pytest.mark.parametrize("build_fails", [False, True])
def test_a_stop_during_start_up_ends_the_loop_thread_quietly(tiny, build_fails):
    building = threading.Event()
    release = threading.Event()

    def build() -> LLMEngine:
        building.set()
        release.wait(30)
        if build_fails:
            raise RuntimeError("the model did not load")
        return LLMEngine(EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=16))

    thread_errors: list[BaseException] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: thread_errors.append(args.exc_value)
    try:
        engine = AsyncEngine(build)
        ready = engine.start()
        assert building.wait(30)
        assert ready.cancel()  # the service stopped waiting
        release.set()
        engine.shutdown(timeout=60)
    finally:
        threading.excepthook = previous_hook
    assert not engine._thread.is_alive()
    assert thread_errors == []


async def _stream(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list:
    """The event lists a request's queue received, up to its last output."""
    events: asyncio.Queue = asyncio.Queue()
    engine.add_request(request_id, [5, 9, 13, 17, 21], params, events)
    batches: list[list] = []
    while not batches or not batches[-1][-1].finished:
        batches.append(await asyncio.wait_for(events.get(), 60))
    return [event for batch in batches for event in batch]


def _engine(tiny, stream_interval: int) -> AsyncEngine:
    engine = AsyncEngine(
        lambda: LLMEngine(
            EngineConfig(
                model=str(tiny), dtype="float32", num_kv_blocks=64, stream_interval=stream_interval
            )
        )
    )
    engine.start().result(60)
    return engine


def test_a_stream_interval_gathers_tokens_and_loses_none(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    async def run(interval: int) -> list:
        engine = _engine(tiny, interval)
        try:
            return await _stream(engine, "r", params)
        finally:
            engine.shutdown(timeout=60)

    every_step = asyncio.run(run(1))
    gathered = asyncio.run(run(3))

    assert [len(o.new_token_ids) for o in every_step] == [1] * 8
    # The first token at once, then three at a time; the end with what was left.
    assert [len(o.new_token_ids) for o in gathered] == [1, 3, 3, 1]
    assert [t for o in gathered for t in o.new_token_ids] == [
        t for o in every_step for t in o.new_token_ids
    ]
    assert [len(o.new_logprobs) for o in gathered] == [1, 3, 3, 1]
    assert [lp for o in gathered for lp in o.new_logprobs] == [
        lp for o in every_step for lp in o.new_logprobs
    ]
    assert [o.num_output_tokens for o in gathered] == [1, 4, 7, 8]
    assert gathered[-1].finish_reason == FinishReason.LENGTH


def test_an_abort_sends_the_tokens_a_request_gathered(tiny):
    async def run() -> list:
        engine = _engine(tiny, 1000)
        try:
            events: asyncio.Queue = asyncio.Queue()
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            engine.add_request("r", [5, 9, 13, 17, 21], params, events)
            outputs = list(await asyncio.wait_for(events.get(), 60))  # the first token
            # Steps go on, their tokens held: abort once two more have been generated.
            deadline = time.monotonic() + 60
            while engine.engine.requests["r"].num_output_tokens < 3:
                assert time.monotonic() < deadline, "the request made no progress"
                await asyncio.sleep(0.01)
            await asyncio.wrap_future(engine.abort(["r"]))
            while not outputs[-1].finished:
                outputs += await asyncio.wait_for(events.get(), 60)
            return outputs
        finally:
            engine.shutdown(timeout=60)

    first, last = asyncio.run(run())
    assert len(first.new_token_ids) == 1
    # The abort's (or the length's) last output carries every token held since the first.
    assert last.finished and last.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
    assert len(last.new_token_ids) > 1
    assert 1 + len(last.new_token_ids) == last.num_output_tokens


def test_a_stream_interval_below_one_is_refused(tiny):
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        EngineConfig(model=str(tiny), stream_interval=0)


class _FailingEngine(LLMEngine):
    """An engine whose fifth step fails (a fault injected into a real engine)."""

    steps = 0

    def step(self):
        self.steps += 1
        if self.steps == 5:
            raise RuntimeError("the fifth step failed")
        return super().step()


def test_a_failed_step_sends_what_was_held_before_the_failure(tiny):
    async def run() -> list:
        engine = AsyncEngine(
            lambda: _FailingEngine(
                EngineConfig(
                    model=str(tiny), dtype="float32", num_kv_blocks=64, stream_interval=100
                )
            )
        )
        engine.start().result(60)
        try:
            events: asyncio.Queue = asyncio.Queue()
            params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
            engine.add_request("r", [5, 9, 13, 17, 21], params, events)
            received: list = []
            while not received or not isinstance(received[-1], RequestFailed):
                received += await asyncio.wait_for(events.get(), 60)
            return received
        finally:
            engine.shutdown(timeout=60)

    first, held, failed = asyncio.run(run())
    # Step 1 (the prefill) sent the first token, steps 2-4 gathered theirs, step 5 failed.
    assert len(first.new_token_ids) == 1
    assert len(held.new_token_ids) == 3 and not held.finished and held.num_output_tokens == 4
    assert isinstance(failed, RequestFailed) and "the fifth step failed" in str(failed.error)


def test_a_sink_that_fails_stops_neither_the_engine_nor_other_requests(tiny):
    class BrokenSink:
        calls = 0

        def deliver(self, events: list) -> None:
            BrokenSink.calls += 1
            raise RuntimeError("a sink's bug")

    async def run() -> list:
        engine = _engine(tiny, 1)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            engine.add_request("broken", [5, 9, 13], params, BrokenSink())
            return await _stream(engine, "fine", params)
        finally:
            engine.shutdown(timeout=60)

    outputs = asyncio.run(run())
    assert BrokenSink.calls > 0
    assert [len(o.new_token_ids) for o in outputs] == [1] * 6 and outputs[-1].finished
