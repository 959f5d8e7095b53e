"""Compiled decode programs on a tiny random Llama (SmolLM2's vocabulary): stored once, loaded by
the next engine instead of compiled again; a corrupt stored file skipped with one warning and
built again; and an engine that serves eagerly while its programs get ready in the background,
then switches to them, with transformers' greedy tokens before and after.

The programs live in the Folio cache like everyone's (keyed by content, so every run of these
tests shares them); only the first run on a machine compiles."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.decode_programs import build_lock, programs_key
from tiny_models import hf_greedy, make_tiny_smollm2

PROMPTS = [[1, 504, 3717, 5542, 30], [1, 9233, 2623, 253], [1, 42]]
NEW_TOKENS = 6
WARNING = re.compile(r"stored compiled decode steps unavailable \((.*)\); building them again")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_smollm2(tmp_path_factory.mktemp("tiny-compiled"), default_model_dir)


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    return [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]


def compiled_llm(model: Path, mode: str) -> LLM:
    return LLM(model=str(model), dtype="float32", enforce_eager=False, decode_compile=mode)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in llm.generate(PROMPTS, params)]


def test_stored_programs_are_loaded_and_a_corrupt_file_is_built_again(tiny, reference, caplog):
    """The second engine loads what the first stored (nothing compiled); a file that does not
    unpickle costs one warning, a rebuild over it, and nothing else: the tokens stay the
    oracle's, through the programs (three rows, then one as the shorter requests end)."""
    first = compiled_llm(tiny, "startup").engine.executor.runner.compiled_decode
    assert first is not None and first.ready
    path = Path(first.spec.path)
    assert path.is_file()

    restarted = compiled_llm(tiny, "startup")
    compiled = restarted.engine.executor.runner.compiled_decode
    assert compiled is not None and compiled.origin == "loaded"
    assert generate(restarted) == reference
    assert set(compiled.rows_run) == {len(PROMPTS)}

    path.write_bytes(b"not a pickle of programs")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rebuilt = compiled_llm(tiny, "startup")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("engine.")]
    assert len(said) == 1 and (warning := WARNING.search(said[0])), said
    assert warning[1].startswith("UnpicklingError: ")
    compiled = rebuilt.engine.executor.runner.compiled_decode
    assert compiled is not None and compiled.origin == "compiled"
    assert generate(rebuilt) == reference
    assert compiled.rows_run


def test_programs_built_for_a_limited_instruction_set_have_their_own_key(tiny, monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 makes inductor compile AVX2 code on an AVX-512 CPU: those
    programs and the CPU's own are stored apart, so neither is loaded in the other's place."""
    args = (tiny, "float32", None, "torch", 2, (1, 2))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    own = programs_key(*args)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    limited = programs_key(*args)
    assert limited != own and programs_key(*args) == limited


def test_background_programs_switch_between_steps(tiny, reference):
    """While another process holds the programs' lock (a build in progress), the engine answers
    eagerly; once the lock is free its thread loads them and the next decode steps run
    compiled. Greedy tokens are the oracle's either way."""
    path = Path(compiled_llm(tiny, "startup").engine.executor.runner.compiled_decode.spec.path)
    with build_lock(path):
        llm = compiled_llm(tiny, "background")
        compiled = llm.engine.executor.runner.compiled_decode
        assert compiled is not None
        assert generate(llm) == reference
        assert not compiled.ready and not compiled.rows_run
    assert compiled.done.wait(timeout=300)
    assert compiled.ready and compiled.origin == "loaded"
    assert generate(llm) == reference
    assert set(compiled.rows_run) == {len(PROMPTS)}
