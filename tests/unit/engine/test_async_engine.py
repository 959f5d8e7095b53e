"""AsyncEngine's start-up: a stop that comes while the loop thread still builds the engine (the
service cancelled its wait) ends the thread quietly, whether the build then succeeds or fails."""

from __future__ import annotations

import threading

import pytest
from transformers import LlamaConfig

from common.config import EngineConfig
from engine.async_engine import AsyncEngine
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
