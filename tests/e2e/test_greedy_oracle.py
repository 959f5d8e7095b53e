"""The correctness oracle: the engine's greedy tokens equal transformers `generate` on
SmolLM2-135M-Instruct in float32, whatever the batching does (one batch, chunked prefill,
prefix-cache hits, preemption under a tiny KV pool), with decode steps compiled, and with the
model sharded over 3 ranks; and, as a served `folio engine`, with no C++ compiler (eagerly) and
with the compiled programs stored before (loaded, not compiled). A bfloat16 copy of the model
with dtype "auto" on the AVX2 paths (its weights stored in bfloat16, widened in registers) gives
transformers' tokens of it run in float32."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import PROGRAMS_READY

from engine import LLM, SamplingParams
from engine.kernels.cpu.capabilities import ISA_ENV, cpu_capabilities
from engine.layers.linear import Bf16Tiles
from polling import wait_until

NEW_TOKENS = 32
SYSTEM = (
    "You are a meticulous assistant. Answer briefly, cite no sources, and prefer plain words "
    "over jargon. Never invent facts you are unsure about."
)
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime.",
    "Explain paged attention to a five year old, using an analogy about a library with many "
    "shelves and a librarian who keeps an index card for every book.",
    "Translate 'good morning' into French, Spanish, German and Italian.",
    "¿Cuál es la montaña más alta del mundo? 日本語でも答えてください。",
    "Summarize the plot of a story in which a robot learns to paint, meets an old painter, "
    "and they open a gallery together in a small town by the sea. Keep it under fifty words, "
    "and end with a question for the reader about what art means to them.",
    "2+2=",
]


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    chats = [
        tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    raw = [tok.encode("The quick brown fox"), tok.encode("Once upon a time, in a land far away,")]
    return chats + raw


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts):
    return transformers_greedy(default_model_dir, prompts)


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """transformers greedy tokens in float32, one prompt at a time (no padding), stopped at EOS
    like ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            new = gen[0, len(ids) :].tolist()
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    break
            out.append(new)
    return out


def run(model_dir, prompts, **engine_args):
    llm = LLM(model=str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return llm, [r.token_ids for r in llm.generate(prompts, params)]


def test_one_batch_matches_transformers(default_model_dir, prompts, reference):
    llm, got = run(default_model_dir, prompts)
    assert got == reference
    assert llm.engine.kv_cache.usage == 0


def test_compiled_decode_matches_transformers(default_model_dir, prompts, reference):
    """Decode steps through the compiled programs (the suite runs eagerly otherwise), built at
    start-up or loaded from the cache: the program for larger batches and the one-row one."""
    llm = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=False)
    compiled = llm.engine.executor.runner.compiled_decode
    assert compiled is not None and compiled.ready
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    assert [r.token_ids for r in llm.generate(prompts, params)] == reference
    assert max(compiled.rows_run) == len(prompts)
    compiled.rows_run.clear()
    assert [r.token_ids for r in llm.generate(prompts[-1:], params)] == reference[-1:]
    assert compiled.rows_run == {1: len(reference[-1]) - 1}


def test_chunked_prefill_matches_transformers(default_model_dir, prompts, reference):
    budget = 24
    assert max(len(p) for p in prompts) > 2 * budget
    _llm, got = run(default_model_dir, prompts, max_num_batched_tokens=budget, max_num_seqs=4)
    assert got == reference


def test_prefix_cache_hits_match_transformers(default_model_dir, prompts, reference):
    llm = LLM(model=str(default_model_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = [r.token_ids for r in llm.generate(prompts[:1], params)]
    # The shared system prompt of the first request is now cached for all the others.
    rest = llm.generate(prompts[1:], params)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert sum(r.num_cached_tokens for r in rest) >= 16 * (len(rest) - 2)
    assert first + [r.token_ids for r in rest] == reference
    # A second pass hits the cache for whole prompts and still gives the same tokens.
    again = llm.generate(prompts, params)
    assert [r.token_ids for r in again] == reference
    assert all(r.num_cached_tokens > 0 for r in again if len(r.prompt_token_ids) > 16)


def test_preemption_matches_transformers(default_model_dir, prompts, reference):
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    num_blocks = (longest + 15) // 16 + 6
    llm, got = run(
        default_model_dir, prompts, num_kv_blocks=num_blocks, enable_prefix_caching=False
    )
    assert llm.engine.stats().num_preemptions > 0
    assert got == reference
    assert llm.engine.kv_cache.usage == 0


def test_tensor_parallel_3_matches_transformers(default_model_dir, prompts, reference):
    """SmolLM2-135M's 9 heads and 3 KV heads over 3 ranks (one KV head each): worker ranks as
    real processes over gloo, the same greedy tokens, with ngram drafts verified (their
    tokens carried to the workers in the step's plan)."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    with LLM(
        model=str(default_model_dir),
        dtype="float32",
        tensor_parallel_size=3,
        speculative_config=ngram,
    ) as llm:
        assert llm.engine.drafter is not None
        llm.engine.drafter.measured = None  # drafts whatever the machine's load says
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        assert [r.token_ids for r in got] == reference
        stats = llm.engine.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@contextlib.contextmanager
def served_engine(model_dir, stderr: Path, env: dict[str, str]) -> Iterator[int]:
    """A `folio engine` with compiled decode steps (in the background: its default), serving;
    yields its port, and checks that SIGTERM ends it cleanly."""
    command = [sys.executable, "-m", "folio.cli", "engine", "--model", str(model_dir)]
    command += ["--dtype", "float32", "--no-enforce-eager", "--port", "0"]
    command += ["--num-kv-blocks", "512", "--max-num-seqs", "32"]
    stdout = stderr.with_name(stderr.name + ".stdout")
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    try:
        port = wait_until(
            lambda: re.search(r"listening on 127\.0\.0\.1:(\d+)", stdout.read_text()),
            "the engine's address",
            seconds=120,
        )[1]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_until(
                lambda: (
                    process.poll() is not None
                    or health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                "the engine to serve",
                seconds=600,
                interval=0.5,
            )
        assert process.poll() is None, stderr.read_text()[-3000:]
        yield int(port)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def generate_served(port: int, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt, from one Generate stream."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    requests = [
        engine_pb2.GenerateRequest(
            add=engine_pb2.EngineRequest(
                request_id=str(i), prompt_token_ids=ids, sampling_params=params
            )
        )
        for i, ids in enumerate(prompts)
    ]
    tokens: dict[str, list[int]] = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for response in stub.Generate(iter(requests), timeout=600):
            for output in response.outputs:
                assert not output.HasField("error"), output.error
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def test_engine_without_a_compiler_serves_eagerly(default_model_dir, prompts, reference, tmp_path):
    """An optional speed-up never takes the engine down: `folio engine` asked for compiled decode
    with no C++ compiler on PATH, CXX pointing nowhere and an empty cache (nothing built before)
    says once why Folio's kernels and the compiled steps are unavailable, then serves the oracle
    prompts eagerly, token for token."""
    # The interpreter's own folder only (ninja is there): no c++, g++, gcc or cc anywhere.
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable),
        "CXX": str(tmp_path / "nowhere" / "c++"),
        "CC": str(tmp_path / "nowhere" / "cc"),
        "FOLIO_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("FOLIO_KERNEL_DIR", None)
    stderr = tmp_path / "stderr"
    with served_engine(default_model_dir, stderr, env) as port:
        assert generate_served(port, prompts) == reference
        # The programs' build process fails in the background; the engine says so once.
        wait_until(lambda: "running them eagerly" in stderr.read_text(), "the warning", 300)
    log = stderr.read_text()
    kernels = re.findall(r"Folio's CPU kernels unavailable \((.*)\); using torch's ops", log)
    compiled = re.findall(r"compiled decode steps unavailable \((.*)\); running them eagerly", log)
    assert kernels == [f"no C++ compiler: {env['CXX']!r} is not on PATH (install one or set CXX)"]
    assert len(compiled) == 1 and "C++ compiler" in compiled[0], compiled
    assert "Traceback" not in log, log[-3000:]


def test_restarted_engine_loads_its_programs(default_model_dir, prompts, reference, tmp_path):
    """A `folio engine` whose programs are stored (by an in-process engine of the same model,
    dtype and batch sizes: built now, or loaded when an earlier run built them) loads them in
    the background instead of compiling, and its compiled decode steps give the oracle's
    tokens."""
    stored = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=False)
    assert stored.engine.executor.runner.compiled_decode.ready
    stderr = tmp_path / "stderr"
    with served_engine(default_model_dir, stderr, dict(os.environ)) as port:
        wait_until(lambda: re.search(PROGRAMS_READY, stderr.read_text()), "the programs", 600)
        assert generate_served(port, prompts) == reference
    log = stderr.read_text()
    assert re.search(r"compiled decode steps \(batches of 2, 1 rows\) loaded in", log), log[-3000:]
    assert " compiled in " not in log and "unavailable" not in log, log[-3000:]
    # A service process's loaded objects (start-up's, then the programs loaded while it serves)
    # are out of the garbage collector's scans (common.heap).
    for what in ("EngineService warm-up", "compiled decode steps"):
        assert re.search(rf"{what}: \d+ objects moved out of the garbage collector", log), what


@pytest.fixture(scope="module")
def bf16_checkpoint(default_model_dir, tmp_path_factory) -> Path:
    """The default model stored in bfloat16 (each value rounded once), as most checkpoints are."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("bf16-model")
    for item in default_model_dir.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy(item, directory)
    weights = load_file(default_model_dir / "model.safetensors")
    save_file(
        {name: tensor.bfloat16() for name, tensor in weights.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_bf16_checkpoint_matches_transformers_on_avx2_paths(bf16_checkpoint, prompts, monkeypatch):
    """dtype "auto" on an AVX2-only CPU (forced here with FOLIO_CPU_ISA=avx2 where the CPU has
    more) runs a bfloat16 checkpoint with float32 activations over its bfloat16 weights, widened
    in registers: transformers' greedy tokens of the bfloat16 checkpoint run in float32. (This
    CPU's own float32 path is the other tests'.)"""
    chosen = [prompts[4], prompts[7], prompts[-1]]  # prefill rows past a block; decode rows
    new_tokens = 16  # half the other tests': this one must fit the suite's budget
    reference = transformers_greedy(bf16_checkpoint, chosen, new_tokens)
    monkeypatch.setenv(ISA_ENV, "avx2")
    cpu_capabilities.cache_clear()
    try:
        with LLM(model=str(bf16_checkpoint)) as llm:
            runner = llm.engine.executor.runner
            assert runner.dtype == torch.float32
            if cpu_capabilities().folio_kernels:
                qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed
                assert isinstance(qkv, Bf16Tiles) and qkv.widened
                assert qkv.tiles.dtype == torch.bfloat16
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
            assert [r.token_ids for r in llm.generate(chosen, params)] == reference
    finally:
        monkeypatch.delenv(ISA_ENV)
        cpu_capabilities.cache_clear()
