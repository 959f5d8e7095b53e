"""`folio serve` as a user runs it: three real processes with the default model.

One shared server (the `folio_server` fixture) answers the Node.js gRPC client and the OpenAI
client; the stop tests start servers of their own, since they end them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

import grpc
import torch
from common.grpc_stubs.folio.v1 import engine_pb2, engine_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI
from serve_process import (
    ENGINE_ARGS,
    STARTING,
    alive,
    processes_with,
    start_serve,
)

from common.default_model import gguf_path
from common.tokenizer import Tokenizer
from engine import LLM, SamplingParams
from engine.models.gguf_metadata import file_quantization

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = ROOT / ".tools" / "node_modules"


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_all_three_services_are_up(folio_server):
    children = folio_server.children()
    roles = sorted(re.search(r"folio\.cli (\w+)", cmd)[1] for cmd in children.values())
    assert roles == ["engine", "gateway", "tokenizer"]
    # folio serve said how long each took to become healthy.
    for role in roles:
        assert re.search(rf"folio: {role} healthy in \d+\.\d s", folio_server.output()), role
    with urllib.request.urlopen(f"{folio_server.url}/health", timeout=10) as response:
        assert response.status == 200
    for address in (folio_server.engine_address, folio_server.tokenizer_address):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_engine_flags_reach_the_engine_process(folio_server):
    with grpc.insecure_channel(folio_server.engine_address) as channel:
        info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), metadata=folio_server.internal_metadata(), timeout=10
        )
    assert dict(zip(ENGINE_ARGS[::2], ENGINE_ARGS[1::2], strict=False)) == {
        "--num-kv-blocks": str(info.num_kv_blocks),
        "--max-num-seqs": str(info.max_num_seqs),
    }
    # The default model, served from its wheel's GGUF file as it is, under its own name.
    assert info.model == "SmolLM2-135M-Instruct"
    assert info.model_path == str(gguf_path())


def test_node_grpc_client(folio_server):
    assert shutil.which("node"), "node is missing"
    for package in ("grpc-js", "proto-loader"):
        assert (NODE_MODULES / "@grpc" / package).is_dir(), "the set-up (make) installs it with npm"
    env = dict(
        os.environ,
        NODE_PATH=str(NODE_MODULES),
        FOLIO_ENGINE_ADDRESS=folio_server.engine_address,
        FOLIO_TOKENIZER_ADDRESS=folio_server.tokenizer_address,
        FOLIO_GATEWAY_GRPC_ADDRESS=folio_server.grpc_address,
        FOLIO_INTERNAL_TOKEN=folio_server.internal_token,
    )
    result = subprocess.run(
        [
            "node",
            "--test",
            "--test-reporter=tap",
            str(ROOT / "tests" / "node" / "grpc_client.test.js"),
        ],
        env=env,
        capture_output=True,
        text=True,
        # Four streamed calls against the default model: 100-140 s on a loaded 2-core machine.
        timeout=300,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    # The runner really ran the client's tests, and each passed.
    assert re.search(r"^# pass 4$", result.stdout, re.MULTILINE), report
    assert re.search(r"^# fail 0$", result.stdout, re.MULTILINE), report


def test_openai_client_chat(folio_server, default_model_dir):
    openai = client(folio_server)
    model = openai.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=model, messages=messages, max_tokens=16, temperature=0)
    whole = openai.chat.completions.create(**kwargs)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in openai.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
    )
    answer = whole.choices[0].message.content
    assert answer and streamed == answer
    expected_prompt = Tokenizer.from_dir(default_model_dir).encode_chat(messages)
    assert whole.usage.prompt_tokens == len(expected_prompt)
    assert 0 < whole.usage.completion_tokens <= 16


def test_decode_steps_run_compiled(folio_server):
    """The shared server's decode steps run compiled once its programs are ready (loaded, or
    built in the background while it served eagerly), and its greedy tokens are an eager
    engine's of the same model and dtype: equal for float32 weights; where the compiled program
    rounds fused intermediates differently and that shows (bfloat16; the default model's GGUF,
    whose int4 kernels round each activation to 8 bits, so a last-bit difference in a fused
    norm can move a code), equal up to a first disagreement, which must be a near-tie (each
    side's token in the other's top 5, vLLM's check_logprobs_close)."""
    assert re.search(r"compiled decode steps \(batches of 2, 1 rows\)", folio_server.output())
    prompt = "Once upon a time, in a land far away,"
    openai = client(folio_server)
    model = openai.models.list().data[0].id
    served = openai.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=5
    )
    with LLM(enforce_eager=True) as eager:
        dtype = eager.engine.executor.runner.dtype
        expected = eager.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
        )[0]
    assert served.usage.completion_tokens == len(expected.token_ids)
    if dtype == torch.float32 and file_quantization(gguf_path()) is None:
        assert served.choices[0].text == expected.text
        return
    tokenizer = Tokenizer.from_dir(gguf_path())
    served_logprobs = served.choices[0].logprobs
    for position, token_id in enumerate(expected.token_ids):
        served_token = served_logprobs.tokens[position]
        eager_token = tokenizer.decode([token_id], skip_special_tokens=False)
        if served_token == eager_token:
            continue
        eager_top = [
            tokenizer.decode([t], skip_special_tokens=False)
            for t, _ in expected.logprobs[position][1]
        ]
        assert served_token in eager_top, (position, served_token, eager_top)
        assert eager_token in served_logprobs.top_logprobs[position], (position, eager_token)
        break


def stopped_cleanly(server, children: dict[int, str]) -> None:
    code = server.process.wait(90)
    output = server.output()
    assert code == 0, output
    assert "folio: stopped" in output
    assert not [pid for pid in children if alive(pid)], "orphaned service processes"


def test_ctrl_c_stops_all_three(tmp_path):
    server = start_serve(tmp_path / "serve.log", *ENGINE_ARGS)
    try:
        children = server.children()
        assert len(children) == 3
        # A terminal's Ctrl-C: SIGINT to the whole foreground process group.
        os.killpg(server.process.pid, signal.SIGINT)
        stopped_cleanly(server, children)
    finally:
        server.kill()


def test_sigterm_lets_a_stream_in_flight_finish_then_stops_all_three(tmp_path):
    server = start_serve(tmp_path / "serve.log", *ENGINE_ARGS)
    try:
        children = server.children()
        assert len(children) == 3
        openai = client(server)
        stream = openai.completions.create(
            model=openai.models.list().data[0].id,
            prompt="Count to one hundred:",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)  # the request is running
        signalled = threading.Timer(0, server.process.send_signal, (signal.SIGTERM,))
        signalled.start()
        rest = list(chunks)
        signalled.join()
        # The gateway drained it: every token came, though the engine was asked to stop too.
        finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        assert finish[-1] == "length"
        stopped_cleanly(server, children)
    finally:
        server.kill()


def test_a_service_failing_at_start_up_ends_serve_with_an_error(tmp_path):
    bad_model = tmp_path / "no-such-model"
    server = start_serve(tmp_path / "serve.log", "--model", str(bad_model), wait=False)
    try:
        code = server.process.wait(90)
        output = server.output()
        assert code == 1, output
        assert re.search(
            r"folio: error: (tokenizer|engine) exited with code \d+ during start-up", output
        ), output
        assert "folio: serving on" not in output
        # The gateway was healthy enough to run: it must not outlive serve either.
        engine_address = STARTING.search(output)[2]
        assert not processes_with(f"--model {bad_model}") and not processes_with(engine_address)
    finally:
        server.kill()
