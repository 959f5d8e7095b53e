"""The simulated engine: the real engine loop, scheduler and KV cache manager on a simulated
executor, behind the real engine service, no model and no torch. Its steps ask for the time the
cost model gives, it streams placeholder tokens that tokenize back to themselves, its KV events
name blocks by the shared chained hash, and `folio engine --simulate --replicas K` serves K of
them, each on its own port."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common.block_hash import prefix_block_hashes
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.engine import LLMEngine
from engine.simulated import SimulatedExecutor, StepCostModel, simulated_engine
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.simulate import simulated_services

COST = StepCostModel(fixed_seconds=2.0, prefill_token_seconds=0.5, decode_sequence_seconds=1.0)
CONFIG = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)


def test_nothing_the_simulator_imports_pulls_in_torch(tmp_path, default_model_dir):
    cost_path = tmp_path / "cost.json"
    COST.save(cost_path)
    code = textwrap.dedent(
        f"""
        import sys
        import folio.cli
        import services.engine.simulate
        from common.config import EngineConfig
        from common.sampling_params import SamplingParams
        from engine.simulated import StepCostModel, simulated_engine
        engine = simulated_engine(
            EngineConfig(model={str(default_model_dir)!r}, block_size=4, num_kv_blocks=16),
            StepCostModel.load(__import__("pathlib").Path({str(cost_path)!r})),
            sleep=lambda seconds: None,
        )
        engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, seed=3))
        while engine.has_unfinished:
            engine.step()
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_steps_ask_for_the_modelled_time_and_emit_placeholder_tokens(default_model_dir):
    slept: list[float] = []
    engine = simulated_engine(
        EngineConfig(model=str(default_model_dir), **CONFIG), COST, sleep=slept.append
    )
    engine.add_request("a", list(range(100, 110)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(200, 206)), SamplingParams(max_tokens=2, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    # Step 1 prefills 16 tokens; then two decodes; then one.
    modelled = [2.0 + 0.5 * 16, 2.0 + 1.0 * 2, 2.0 + 1.0 * 1]
    assert len(slept) == 3
    for asked, expected in zip(slept, modelled, strict=True):
        assert expected - 0.5 < asked <= expected  # the scheduling time is part of the step
    placeholder = engine.executor.placeholder_token_id
    assert tokens == {"a": [placeholder] * 3, "b": [placeholder] * 2}
    tokenizer = Tokenizer.from_dir(default_model_dir)
    text = tokenizer.decode([placeholder] * 4)
    assert tokenizer.encode(text, add_special_tokens=False) == [placeholder] * 4
    assert engine.stats().num_running == 0 and engine.kv_cache.usage == 0
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("c", [1, 2], SamplingParams(logprobs=2))


def test_the_simulated_engine_is_the_engine_loop_on_a_simulated_executor(default_model_dir):
    simulated = simulated_engine(EngineConfig(model=str(default_model_dir), **CONFIG), COST)
    assert type(simulated) is LLMEngine and isinstance(simulated.executor, SimulatedExecutor)
    # Admission, scheduling and the update after a step are the loop's alone: nothing in the
    # simulated executor's module is a second engine.
    module = sys.modules[SimulatedExecutor.__module__]
    loop_methods = {"add_request", "abort", "step", "_step", "_update", "_retire"}
    for name, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            assert not loop_methods & set(vars(value)), f"{name} copies the engine loop"


def test_simulated_engine_services_stream_tokens_and_kv_events(default_model_dir):
    config = EngineConfig(model=str(default_model_dir), **CONFIG)
    fast = dataclasses.replace(COST, fixed_seconds=0.001, prefill_token_seconds=0.0)
    servers = [
        ServerThread(service) for service in simulated_services(config, fast, "127.0.0.1", 0, 2)
    ]
    try:
        assert len({s.port for s in servers}) == 2
        for server in servers:
            stub = engine_pb2_grpc.EngineServiceStub(server.channel)
            events = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)
            prompt = list(range(300, 313))
            request = engine_pb2.GenerateRequest(
                add=engine_pb2.EngineRequest(
                    request_id="x",
                    prompt_token_ids=prompt,
                    sampling_params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
                )
            )
            outputs = [
                o for r in stub.Generate(iter([request]), timeout=TIMEOUT) for o in r.outputs
            ]
            assert sum(len(o.token_ids) for o in outputs) == 4 and outputs[-1].finished
            info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
            assert info.dtype == "simulated" and info.block_size == 4
            tokens = prompt + [t for o in outputs for t in o.token_ids]
            expected = prefix_block_hashes(tokens[:-1], 4)
            stored: list[bytes] = []
            while len(stored) < len(expected):
                batch = next(events)
                stored += [h for e in batch.events for h in e.block_stored.block_hashes]
            assert stored == expected
            events.cancel()
            stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)
            assert "overrun" in stats.step_seconds and stats.num_steps >= 4
    finally:
        for server in servers:
            server.close()


def test_folio_engine_simulate_serves_k_engines_then_stops(tmp_path, default_model_dir):
    cost_path = tmp_path / "cost.json"
    COST.save(cost_path)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "folio.cli",
            "engine",
            "--simulate",
            "--replicas",
            "3",
            "--port",
            "0",
            "--model",
            str(default_model_dir),
            "--step-cost",
            str(cost_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "FOLIO_INTERNAL_TOKEN": ""},
    )
    try:
        line = process.stdout.readline()
        match = re.fullmatch(
            r"folio: 3 simulated engines listening on 127\.0\.0\.1:([\d,]+)\n", line
        )
        assert match, line
        assert len(set(match[1].split(","))) == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
