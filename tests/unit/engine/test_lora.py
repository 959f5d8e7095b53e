"""LoRA adapters (engine/lora/, engine/layers/lora.py) on a tiny random Llama (and one on the
default model): adapters made with peft, served together in one batch with the base model,
give the greedy tokens of transformers + peft with that adapter (float32), swapped through
fewer slots than adapters too; a prefix cached under one adapter is no hit for another; bad
adapters are refused naming the problem; run-time loads only from inside --lora-root; an
unload waits for its requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import threading

import pytest
from safetensors.torch import load_file, save_file

from common.config import EngineConfig
from common.errors import InvalidRequestError, ModelNotFound, NotFound
from common.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine import LLMEngine
from lora_adapters import make_adapter
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Four prompts sharing their first two blocks (of 4 tokens), so the prefix cache would serve
# one adapter's blocks to another if the hash chain did not tell them apart.
SHARED = [5, 17, 33, 2, 90, 41, 7, 12]
PROMPTS = [[*SHARED, 60 + i, 3 * i + 1, 100 - i] for i in range(4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base checkpoint and three adapters: ranks 8 (all seven targets), 4 (attention only,
    rslora), 2 (MLP only); each with its oracle."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    reference = make_checkpoint(base_dir, *VARIANTS["llama"])
    specs = {
        "all8": dict(rank=8, alpha=16),
        "attn4": dict(
            rank=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], rslora=True
        ),
        "mlp2": dict(rank=2, alpha=4, targets=["gate_proj", "up_proj", "down_proj"]),
    }
    oracles = {}
    for seed, (name, spec) in enumerate(specs.items(), 1):
        oracles[name] = make_adapter(base_dir, root / name, seed=seed, **spec)
    return root, base_dir, reference, oracles


def engine_for(root, base_dir, max_loras: int, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(base_dir),
            dtype="float32",
            block_size=4,
            num_kv_blocks=64,
            lora_modules=tuple(f"{n}={root / n}" for n in ("all8", "attn4", "mlp2")),
            max_loras=max_loras,
            max_lora_rank=8,
            **kwargs,
        )
    )


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]
) -> dict[str, list[int]]:
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, GREEDY, lora_name=lora)
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


LORAS = [None, "all8", "attn4", "mlp2"]


@pytest.mark.parametrize("max_loras", [3, 1], ids=["all-resident", "swapped"])
def test_mixed_batch_matches_transformers_with_peft(models, max_loras):
    """Base and three adapters in one batch (max_loras 3), or swapped through one slot: each
    request's greedy tokens are those of transformers + peft with its adapter (prompts and
    decode steps through Folio's grouped kernel); then the same prompts again with the adapters
    rotated hit the prefix cache only within an adapter."""
    from engine.kernels.cpu.capabilities import cpu_capabilities

    root, base_dir, reference, oracles = models
    engine = engine_for(root, base_dir, max_loras)
    try:
        slots = engine.executor.runner.lora
        assert slots is not None  # Folio's grouped kernel where it loaded (it did on AVX2)
        kernel = cpu_capabilities().folio_kernels
        assert all(layer.folio_kernel == kernel for layer in slots.layers.values())
        first = {f"r{i}": (PROMPTS[i], LORAS[i]) for i in range(4)}
        got = run(engine, first)
        hits_before = engine.stats().prefix_cache_hits
        rotated = {f"s{i}": (PROMPTS[i], LORAS[(i + 1) % 4]) for i in range(4)}
        got.update(run(engine, rotated))
        assert engine.stats().prefix_cache_hits > hits_before  # shared blocks within an adapter
        if max_loras == 1:
            assert engine.lora is not None and engine.lora.num_swaps >= 3
    finally:
        engine.close()
    want = {}
    for request_id, (prompt, lora) in (first | rotated).items():
        oracle = reference if lora is None else oracles[lora]
        want[request_id] = hf_greedy(oracle, prompt, GREEDY.max_tokens)
    assert got == want
    # The adapters matter: each changes some request's tokens from the base model's.
    base_tokens = {tuple(hf_greedy(reference, p, GREEDY.max_tokens)) for p in PROMPTS}
    assert any(tuple(got[f"r{i}"]) not in base_tokens for i in (1, 2, 3))


def test_prefix_cached_under_one_adapter_is_no_hit_for_another(models):
    root, base_dir, _, _ = models
    engine = engine_for(root, base_dir, 3)
    try:
        run(engine, {"a": (PROMPTS[0], "all8")})
        for lora, request_id in ((None, "base"), ("attn4", "other")):
            request = engine.add_request(request_id, PROMPTS[0], GREEDY, lora_name=lora)
            assert engine.kv_cache.get_cached_prefix(request)[1] == 0
            engine.abort(request_id)
        request = engine.add_request("same", PROMPTS[0], GREEDY, lora_name="all8")
        assert engine.kv_cache.get_cached_prefix(request)[1] == len(SHARED)
    finally:
        engine.close()


def test_compiled_decode_with_adapters_matches_transformers_with_peft(models):
    """Decode steps through compiled programs (their own key: never a plain engine's): base and
    three adapters through two slots, so adapters are copied into slots the programs read
    while they are in use; then an adapter unloaded and loaded again under another name. Every
    request's greedy tokens are transformers + peft's with its adapter; steps with and without
    adapters both ran compiled."""
    from engine.decode_programs import ProgramsSpec

    root, base_dir, reference, oracles = models
    engine = engine_for(
        root, base_dir, 2, enforce_eager=False, decode_compile="startup", lora_root=str(root)
    )
    try:
        compiled = engine.executor.runner.compiled_decode
        assert compiled is not None and compiled.ready and compiled.spec.lora is not None
        plain = ProgramsSpec.create(*dataclasses.astuple(compiled.spec)[:6])
        assert plain.key != compiled.spec.key
        got = run(engine, {f"r{i}": (PROMPTS[i], LORAS[i]) for i in range(4)})
        assert engine.lora is not None and engine.lora.num_swaps >= 1
        with_adapters = compiled.adapter_steps_run
        assert with_adapters > 0
        got.update(run(engine, {"base": (PROMPTS[1], None)}))
        assert sum(compiled.rows_run.values()) > with_adapters  # a step with no adapter
        engine.unload_lora_adapter("mlp2")
        engine.load_lora_adapter("mlp2-again", "mlp2")
        got.update(run(engine, {"again": (PROMPTS[2], "mlp2-again"), "r": (PROMPTS[3], "all8")}))
        assert compiled.adapter_steps_run > with_adapters
    finally:
        engine.close()
    oracle = {None: reference, "mlp2-again": oracles["mlp2"]} | oracles
    want = {f"r{i}": hf_greedy(oracle[LORAS[i]], PROMPTS[i], GREEDY.max_tokens) for i in range(4)}
    want["base"] = hf_greedy(reference, PROMPTS[1], GREEDY.max_tokens)
    want["again"] = hf_greedy(oracles["mlp2"], PROMPTS[2], GREEDY.max_tokens)
    want["r"] = hf_greedy(oracles["all8"], PROMPTS[3], GREEDY.max_tokens)
    assert got == want


def test_tensor_parallel_serves_adapters_as_one_rank(models, tmp_path):
    """Two ranks, each holding its share of the slots (B's rows of column-parallel layers, A's
    columns of row-parallel ones): base and three adapters through two slots, so the second
    rank loads adapters into slots between steps, give transformers + peft's greedy tokens
    (those of one rank, test_mixed_batch_matches_transformers_with_peft). Every rank reads an
    adapter's files once, when it is loaded, not when it takes a slot inside a step: with the
    files gone, the adapters still swap through the slots and give the same tokens."""
    root, base_dir, reference, oracles = models
    for name in oracles:
        shutil.copytree(root / name, tmp_path / name)
    engine = engine_for(tmp_path, base_dir, 2, tensor_parallel_size=2)
    requests = {f"r{i}": (PROMPTS[i], LORAS[i]) for i in range(4)}
    try:
        got = run(engine, requests)
        assert engine.lora is not None
        swaps = engine.lora.num_swaps
        assert swaps >= 1
        for name in oracles:
            shutil.rmtree(tmp_path / name)
        again = run(engine, {f"again-{r}": request for r, request in requests.items()})
        assert engine.lora.num_swaps > swaps
    finally:
        engine.close()
    oracle = {None: reference} | oracles
    want = {f"r{i}": hf_greedy(oracle[LORAS[i]], PROMPTS[i], GREEDY.max_tokens) for i in range(4)}
    assert got == want
    assert again == {f"again-{r}": tokens for r, tokens in want.items()}


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """An engine with --lora-root over the adapters' directory."""
    root, base_dir, _, _ = models
    engine = engine_for(root, base_dir, 2, lora_root=str(root))
    yield engine
    engine.close()


def test_unknown_adapter_is_model_not_found(served):
    with pytest.raises(ModelNotFound, match="'nope' does not exist"):
        served.add_request("x", PROMPTS[0], GREEDY, lora_name="nope")


def broken_copy(root, name: str, new: str, edit) -> str:
    """A copy of adapter `name` as `new`, its config and tensors passed through `edit`."""
    source, target = root / name, root / new
    target.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    tensors = load_file(source / "adapter_model.safetensors")
    config, tensors = edit(config, tensors)
    (target / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, target / "adapter_model.safetensors")
    return new


def test_bad_adapters_are_refused_naming_the_problem(models, served):
    root, _, _, _ = models
    other_base = root / "other-base"
    make_checkpoint(other_base, VARIANTS["llama"][0], dict(VARIANTS["llama"][1], hidden_size=32))
    make_adapter(other_base, root / "other", rank=4, alpha=8, seed=9)
    cases = {
        broken_copy(
            root, "all8", "no-weights", lambda c, t: (c, None)
        ): "adapter_model.safetensors is missing",
        broken_copy(
            root, "all8", "rank16", lambda c, t: (dict(c, r=16), t)
        ): "rank 16 is over the engine's max_lora_rank 8",
        broken_copy(
            root,
            "all8",
            "layer7",
            lambda c, t: (c, {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}),
        ): "target module .* of layer 7 is not in this model",
        broken_copy(
            root,
            "all8",
            "qkv",
            lambda c, t: (c, {k.replace("q_proj", "query_key_value"): v for k, v in t.items()}),
        ): "target module query_key_value is not one",
        "other": "an adapter of another base model",
        "missing-dir": "does not exist",
    }
    for path, message in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            served.load_lora_adapter(path, path)
        assert path not in served.lora.adapters


@pytest.mark.parametrize(
    "module",
    [
        "chat",
        "=path",
        "chat=",
        '{"name": "chat"}',
        '{"name": "chat", "path": 3}',
        '{"nme": 1}',
        "{bad",
    ],
)
def test_a_lora_module_is_name_and_path_in_either_form(module):
    with pytest.raises(ValueError, match=r'lora_modules takes NAME=PATH or \{"name"'):
        EngineConfig(lora_modules=(module,))


def test_runtime_paths_must_resolve_inside_the_lora_root(models, served, tmp_path):
    root, _, _, _ = models
    outside = tmp_path / "outside"
    outside.mkdir()
    link = root / "escape"
    os.symlink(outside, link)
    for path in (str(outside), "escape", "../outside", "/etc"):
        with pytest.raises(
            InvalidRequestError, match=r"must resolve .* inside the server's --lora-root"
        ):
            served.load_lora_adapter("x", path)


def test_load_and_unload_under_traffic(models, served):
    """An adapter loaded at run time serves at once; unloading one with a request running
    refuses new requests at once and frees it only when that request ends, which ends
    normally."""
    oracles = models[3]
    served.load_lora_adapter("again8", "all8")
    prompt = PROMPTS[1]
    got = run(served, {"new": (prompt, "again8")})
    assert got["new"] == hf_greedy(oracles["all8"], prompt, GREEDY.max_tokens)
    served.add_request("running", prompt, GREEDY, lora_name="again8")
    tokens = [t for out in served.step() for t in out.new_token_ids]
    gone: list[bool] = []
    served.unload_lora_adapter("again8", lambda: gone.append(True))
    with pytest.raises(ModelNotFound):
        served.add_request("late", prompt, GREEDY, lora_name="again8")
    assert "again8" in served.lora.adapters and not gone
    while served.has_unfinished:
        for out in served.step():
            tokens += out.new_token_ids
            finish = out.finish_reason
    assert gone == [True] and "again8" not in served.lora.adapters
    assert tokens == got["new"] and finish is not None and finish.value == "length"
    with pytest.raises(NotFound, match="no LoRA adapter named 'again8'"):
        served.unload_lora_adapter("again8")


def test_a_runtime_load_reads_its_files_while_the_engine_steps(models):
    """Through the AsyncEngine: while an adapter's files are read (the read held here), a
    running request keeps getting tokens; once read, the adapter is served."""
    root, base_dir, _, oracles = models
    engine = AsyncEngine(lambda: engine_for(root, base_dir, 1, lora_root=str(root)))
    engine.start().result(60)
    reading, release = threading.Event(), threading.Event()
    backend = engine._built().lora.backend
    read = backend.read_lora

    def held_read(path):
        reading.set()
        release.wait(60)
        return read(path)

    backend.read_lora = held_read

    async def load_beside_a_request():
        events: asyncio.Queue = asyncio.Queue()
        params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        engine.add_request("long", PROMPTS[0], params, events)
        await asyncio.wait_for(events.get(), 60)  # it runs
        loaded = asyncio.wrap_future(engine.load_lora_adapter("late8", "all8"))
        assert await asyncio.to_thread(reading.wait, 60)
        tokens = 0
        while tokens < 5:  # the loop steps on while the files are read
            tokens += sum(len(o.new_token_ids) for o in await asyncio.wait_for(events.get(), 20))
        assert not loaded.done()
        release.set()
        await asyncio.wait_for(loaded, 60)
        late: asyncio.Queue = asyncio.Queue()
        engine.add_request("late", PROMPTS[1], GREEDY, late, lora_name="late8")
        tokens_of_late: list[int] = []
        finished = False
        while not finished:
            outputs = await asyncio.wait_for(late.get(), 60)
            tokens_of_late += [t for o in outputs for t in o.new_token_ids]
            finished = any(o.finished for o in outputs)
        return tokens_of_late

    try:
        got = asyncio.run(load_beside_a_request())
        assert got == hf_greedy(oracles["all8"], PROMPTS[1], GREEDY.max_tokens)
    finally:
        release.set()
        engine.shutdown(60)


def test_stats_name_the_adapters_running_waiting_and_resident(served):
    """Three adapters' requests on two slots: two run, the third waits for a slot; the stats
    say which (each adapter once) and count the requests per adapter."""
    before = served.stats().lora_requests
    for i, lora in enumerate(("all8", "attn4", "mlp2")):
        served.add_request(f"stats{i}", PROMPTS[i], GREEDY, lora_name=lora)
    queued = served.stats()
    assert queued.running_lora_adapters == []
    assert queued.waiting_lora_adapters == ["all8", "attn4", "mlp2"]
    served.step()
    stepped = served.stats()
    assert stepped.running_lora_adapters == ["all8", "attn4"]
    assert stepped.waiting_lora_adapters == ["mlp2"]
    assert sorted(stepped.resident_lora_adapters) == ["all8", "attn4"]
    assert stepped.max_lora == 2
    for lora in ("all8", "attn4", "mlp2"):
        assert stepped.lora_requests[lora] == before.get(lora, 0) + 1
    while served.has_unfinished:
        served.step()
    assert served.stats().running_lora_adapters == served.stats().waiting_lora_adapters == []


def test_runtime_updates_can_be_disabled(models):
    root, base_dir, _, _ = models
    engine = engine_for(root, base_dir, 1, lora_root=str(root), lora_runtime_updates=False)
    try:
        with pytest.raises(InvalidRequestError, match="--no-lora-runtime-updates"):
            engine.load_lora_adapter("x", "all8")
    finally:
        engine.close()


@pytest.mark.parametrize(("method", "max_error"), [(None, 1e-5), ("int8", 0.05), ("int4", 0.35)])
def test_adapter_on_a_quantized_base_within_the_quantization_bound(models, method, max_error):
    """The adapter's logits on an int8/int4 base are as far from transformers + peft's as the
    quantized base alone is from the float one (test_quantization's bounds), and exact on a
    float32 base."""
    import numpy as np
    import torch
    from test_models import Runner, hf_logits, random_tokens
    from test_quantization import relative_error

    from engine.layers.lora import LoraSlots, fill_groups
    from engine.lora.host import LoraHost
    from engine.models.loader import load_model

    root, base_dir, _, oracles = models
    model, config = load_model(base_dir, torch.float32, "cpu", quantization=method)
    slots = LoraSlots(model, config, 1, 8, 4, 12, torch.float32, torch.device("cpu"))
    host = LoraHost(slots, 8, torch.float32)
    path = str(root / "all8")
    host.load_lora(1, path, host.read_lora(path))
    host.activate_lora(0, 1)
    prompt = random_tokens(12, 5)
    fill_groups(slots.step, np.zeros(len(prompt), dtype=np.int64), torch.device("cpu"), False)
    (logits,) = Runner(model, config).step([("a", prompt)])
    error = relative_error(logits, hf_logits(oracles["all8"], prompt))
    assert error <= max_error


def test_an_adapter_on_the_default_model_matches_transformers_with_peft(
    default_model_dir, tmp_path
):
    """The default model (float32) with a peft adapter on all seven targets, in one batch with a
    base request: each gives transformers + peft's greedy tokens (the adapter disabled for the
    base one), and the adapter changes the answer."""
    from transformers import AutoTokenizer

    oracle = make_adapter(default_model_dir, tmp_path / "chat", rank=8, alpha=16)
    prompt = AutoTokenizer.from_pretrained(default_model_dir)("The capital of France is")[
        "input_ids"
    ]
    engine = LLMEngine(
        EngineConfig(
            model=str(default_model_dir),
            dtype="float32",
            num_kv_blocks=64,
            # vLLM's JSON form of --lora-modules (NAME=PATH is used above).
            lora_modules=(
                json.dumps(
                    {
                        "name": "chat",
                        "path": str(tmp_path / "chat"),
                        "base_model_name": "SmolLM2-135M-Instruct",
                    }
                ),
            ),
            max_loras=1,
            max_lora_rank=8,
            enforce_eager=True,
        )
    )
    try:
        got = run(engine, {"adapter": (prompt, "chat"), "base": (prompt, None)})
    finally:
        engine.close()
    assert got["adapter"] == hf_greedy(oracle, prompt, GREEDY.max_tokens)
    with oracle.disable_adapter():
        assert got["base"] == hf_greedy(oracle, prompt, GREEDY.max_tokens)
    assert got["adapter"] != got["base"]
