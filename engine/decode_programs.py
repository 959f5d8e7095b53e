"""The compiled decode programs as files: built once by torch.compile's ahead-of-time path, stored
under the Folio cache directory, loaded (not rebuilt) by every later engine whose programs would
be the same.

A program is `LlamaForCausalLM.hidden_states` compiled for one range of batch sizes
(torch.compile(...).aot_compile, inductor's C++ backend): its guards, its generated code and the
shared libraries inductor built, serialized whole. Loading one neither traces the model again
nor compiles anything; that is what makes a restart take seconds instead of the minutes of
tracing and compiling. The file's name is a hash of everything the programs depend on (the
model's config and weight shapes, dtype, quantization, batch sizes, Folio's C++ kernels' sources,
torch and Python versions, the CPU's instruction sets, thread count, the compile options); the
Python sources the programs were traced from are recorded inside and checked on loading, so an
edited model file builds them again. A file that cannot be read, or holds programs for another
key, is reported to the caller (engine.compiled_decode warns and builds again).

`python -m engine.decode_programs JOB_JSON` builds and stores one set in a process of its own,
at a lower CPU priority: an engine that serves eagerly meanwhile keeps its interpreter lock and
most of the CPU. This module never runs a real step (engine.compiled_decode does) and never
decides when to build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import pickle
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.config import cache_dir
from common.gguf_file import is_gguf
from common.parent_death import die_with_parent
from engine.fallback import failure_reason
from engine.kernels.cpu import extension
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.lora import LoraSlots
from engine.models.gguf_metadata import gguf_config, gguf_layout
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Raised with the options below or the stored layout: stored programs of an older scheme
# are then never looked up.
FORMAT = 1
# The build process's CPU niceness: an engine serving eagerly meanwhile comes first.
BUILD_NICENESS = 5
# How the build process reports: one JSON line on its stdout.
RESULT_PREFIX = "folio-decode-programs: "


def programs_dir() -> Path:
    return cache_dir() / "compiled-decode"


def inductor_cache_dir() -> str:
    return str(cache_dir() / "inductor")


def compile_options(dtype: str) -> dict[str, Any]:
    """Inductor's options for programs computing in `dtype` (float32, bfloat16, float16)."""
    return {
        # Only the guards a stored program can carry and check: its inputs' sizes and the
        # global grad state. The weights never change once loaded, and guarding the model's
        # ~300 parameters cost Python time every step (docs/compiled-decode.md); the caller
        # picks a program by batch size, checked once per size against these guards.
        "guard_filter_fn": _portable_input_guards,
        # Checks of every intermediate's size and alignment, ~600 Python calls a step,
        # on shapes inductor derived itself.
        "size_asserts": False,
        "alignment_asserts": False,
        # The program's own calls (~300 a step: kernels, the linears, attention) from C++
        # instead of Python. Its wrapper compiles apart from the kernels, at -O1 (glue code),
        # which keeps a cold compile short (docs/compiled-decode.md).
        "cpp_wrapper": True,
        "cpp_wrapper_build_separate": True,
        # Every bfloat16 (float16) value rounded where the model rounds it eagerly, not only at
        # a fused kernel's outputs: otherwise how inductor fuses decides the bits, and it fuses
        # the one-row program otherwise than the several-row one (at one row a residual add's
        # sum of squares fused into its loop read the float32 sum, not the rounded residual),
        # so a request's greedy text depended on its company and on speculative decoding's
        # verification steps. Rounded, both programs give a row eager decoding's bits. Not in
        # float32: there it only re-rounds a GGUF embedding's float16 scales (no change in
        # value) in kernels that then ran ~3% slower at one row.
        "emulate_precision_casts": dtype != "float32",
    }


def _portable_input_guards(entries: list[Any]) -> list[bool]:
    keep = torch.compiler.keep_portable_guards_unsafe(entries)
    return [
        k and not e.orig_guard.source.is_unspecialized_nn_module()
        for k, e in zip(keep, entries, strict=True)
    ]


@dataclass(frozen=True)
class ProgramsSpec:
    """What one set of programs is built from: enough for another process to build it."""

    model_path: str
    dtype: str  # resolved: float32, bfloat16, float16
    quantization: str | None
    attention_backend: str
    num_threads: int  # inductor sizes its parallel loops by it
    sizes: tuple[int, ...]  # one example batch size per program, in dispatch order
    key: str
    path: str
    # An engine with LoRA slots (engine.layers.lora): how many, their rank and the rows of their
    # step's token slots. Its programs are two sets of `sizes`: steps with no adapter, then
    # steps with.
    lora: tuple[int, int, int] | None = None

    @classmethod
    def create(
        cls,
        model_path: str | Path,
        dtype: str,
        quantization: str | None,
        attention_backend: str,
        num_threads: int,
        sizes: tuple[int, ...],
        lora: tuple[int, int, int] | None = None,
    ) -> ProgramsSpec:
        """The spec of these programs, with their key and the file they are stored in."""
        key = programs_key(
            model_path, dtype, quantization, attention_backend, num_threads, sizes, lora
        )
        return cls(
            str(model_path),
            dtype,
            quantization,
            attention_backend,
            num_threads,
            sizes,
            key,
            str(programs_dir() / f"{key}.programs"),
            lora,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProgramsSpec:
        plain = json.loads(text)
        plain["sizes"] = tuple(plain["sizes"])
        if plain["lora"] is not None:
            plain["lora"] = tuple(plain["lora"])
        return cls(**plain)


def program_sizes(model: LlamaForCausalLM, max_num_seqs: int) -> tuple[int, ...]:
    """Two rows first (compiled dynamic: the program for any batch of 2 and more), one row (torch
    specializes sizes of 1), and above the quantized kernels' row limit, where the linears
    change kernel, a third."""
    sizes = [2, 1]
    bound = kernel_rows(model)
    if bound is not None and bound < max_num_seqs:
        sizes.append(bound + 1)
    return tuple(sizes)


def kernel_rows(model: torch.nn.Module) -> int | None:
    """The most rows a step may have for every quantized weight of `model` (its linears and
    its vocabulary's rows) to take its kernel; beyond, some multiply by the dequantized weight
    instead (QuantizedWeight.max_kernel_rows), which rounds otherwise: a row's result then
    depends on how many rows share its step. None: nothing is quantized."""
    from engine.layers.linear import Linear
    from engine.layers.quantization import QuantizedWeight
    from engine.layers.vocab import VocabRows

    bounds = [
        weight.max_kernel_rows
        for module in model.modules()
        for weight in (
            module.packed if isinstance(module, Linear) else None,
            module.quantized if isinstance(module, VocabRows) else None,
        )
        if isinstance(weight, QuantizedWeight)
    ]
    return min(bounds, default=None)


def programs_key(
    model_path: str | Path,
    dtype: str,
    quantization: str | None,
    attention_backend: str,
    num_threads: int,
    sizes: tuple[int, ...],
    lora: tuple[int, int, int] | None = None,
) -> str:
    """A hash of what the programs depend on, except the Python sources they are traced from
    (recorded in the file, checked when it is loaded). An engine with LoRA slots never shares
    one with an engine without (nor with other slots)."""
    digest = hashlib.sha256()

    def add(label: str, value: object) -> None:
        digest.update(f"{label}={value!r}\n".encode())

    add("format", FORMAT)
    options = compile_options(dtype)
    add("options", sorted((k, getattr(v, "__name__", v)) for k, v in options.items()))
    add("torch", torch.__version__)
    add("python", sys.version)
    add("machine", platform.machine())
    add("cpu flags", _cpu_flags())
    # Inductor compiles for less than the CPU has when told to (AVX2 forced on an AVX-512 CPU):
    # programs built one way must not be loaded the other.
    if vec_isa_limit := os.environ.get("ATEN_CPU_CAPABILITY"):
        add("aten cpu capability", vec_isa_limit)
    add("capabilities", dataclasses.asdict(cpu_capabilities()))
    add("kernels", extension.build_hash())
    add("dtype", dtype)
    add("quantization", quantization)
    add("attention", attention_backend)
    add("threads", num_threads)
    add("sizes", sizes)
    if lora is not None:  # absent without LoRA: the keys stored before it came stay valid
        add("lora", lora)
    # The model's config and its weights' names, dtypes and shapes (not their values: they
    # are the programs' inputs).
    if is_gguf(model_path):
        add("config", sorted(gguf_config(model_path).items()))
        add("tensors", gguf_layout(model_path))
        return digest.hexdigest()[:32]
    model_dir = Path(model_path)
    add("config", (model_dir / "config.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        add(weights.name, _safetensors_header(weights))
    return digest.hexdigest()[:32]


def _cpu_flags() -> str:
    """The instruction sets inductor may compile for (it probes the machine it runs on)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.processor()


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size)


@dataclass
class StoredPrograms:
    """One file: its key, the sources the programs were traced from, and the programs."""

    key: str
    sources: dict[str, str]  # module name -> sha256 of its file
    programs: list[bytes]  # serialized AOTCompiledFunctions, in `sizes` order


class StaleProgramsError(Exception):
    """The stored programs were traced from sources that changed since."""


def build(
    model: LlamaForCausalLM, spec: ProgramsSpec, lora: LoraSlots | None = None
) -> StoredPrograms:
    """Trace and compile one program per size (example inputs only: nothing runs), serialized
    for storing; with `lora` (the model's slots, for a spec with LoRA), one per size for steps
    without an adapter, then one per size for steps with."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    # From dynamo's clean slate: what an earlier compile in this process learned (a float seen
    # to vary becomes a symbolic input) makes aot_compile raise the restart that a plain
    # torch.compile would have handled (TensorifyScalarRestartAnalysis).
    torch._dynamo.reset()
    # torch.compile's wrapper of a function has aot_compile; its declared type does not say so.
    options = compile_options(spec.dtype)
    compiled: Any = torch.compile(model.hidden_states, fullgraph=True, options=options)
    if (lora is None) != (spec.lora is None):
        raise ValueError("LoRA slots are built with a spec that has LoRA, and only then")
    variants = (False, True) if lora is not None else (False,)
    serialized, sources = [], {}
    for active, rows in itertools.product(variants, spec.sizes):
        # The runner's step inputs are slices of bigger persistent buffers; so are these.
        input_ids = torch.zeros(rows + 1, dtype=torch.int64)[:rows]
        positions = torch.zeros(rows + 1, dtype=torch.int64)[:rows]
        if rows > 1:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        tracing = lora.tracing(active) if lora is not None else contextlib.nullcontext()
        with torch.inference_mode(), tracing:
            program = compiled.aot_compile(((input_ids, positions), {}))
        serialized.append(type(program).serialize(program).serialized_data)
        for inlined in program.source_info().inlined_sources:
            sources[inlined.module] = _module_hash(inlined.module)
    return StoredPrograms(spec.key, sources, serialized)


def _module_hash(module: str) -> str:
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None or not os.path.isfile(found.origin):
        return ""
    return _file_hash(Path(found.origin))


def store(stored: StoredPrograms, path: Path) -> None:
    """Written whole or not at all (a temporary file renamed), so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
        pickle.dump(dataclasses.asdict(stored), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(f.name, path)


def load(path: Path, key: str) -> list[Any] | None:
    """The stored programs, or None when there are none. Raises StaleProgramsError when their
    sources changed, and whatever reading them raised when the file is corrupt or foreign."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    stored = StoredPrograms(**pickle.loads(data))
    if stored.key != key:
        raise ValueError(f"{path} holds programs for another key ({stored.key!r})")
    changed = sorted(m for m, h in stored.sources.items() if _module_hash(m) != h)
    if changed:
        raise StaleProgramsError(", ".join(changed[:3]) + (" ..." if len(changed) > 3 else ""))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return [AOTCompiledFunction.deserialize(program) for program in stored.programs]


def missing_compiler() -> str | None:
    """Why inductor could not build programs here when it finds no C++ compiler (None when it
    finds one): said before building, not after the minute of tracing that comes first."""
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        names = " or ".join(repr(name) for name in torch._inductor.config.cpp.cxx if name)
        return f"no C++ compiler: {names} is not on PATH (install one or set CXX)"
    return None


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """One process at a time looks up or builds the programs of `path` (engine replicas start
    together): the others wait, then load what the first stored. An flock dies with its
    holder, so a killed builder never blocks the next."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_in_process(spec: ProgramsSpec) -> None:
    """Load the model, build its programs, store them; the lot in this (child) process."""
    from engine.layers.parallel import SINGLE
    from engine.models.loader import load_model

    torch.set_num_threads(spec.num_threads)
    dtype = getattr(torch, spec.dtype)
    model, config = load_model(
        spec.model_path, dtype, "cpu", spec.attention_backend, SINGLE, spec.quantization
    )
    lora = None
    if spec.lora is not None:
        # Empty slots like the engine's: the programs read the slots' tensors, not their values.
        max_loras, max_rank, slot_rows = spec.lora
        device = torch.device("cpu")
        lora = LoraSlots(model, config, max_loras, max_rank, 1, slot_rows, dtype, device)
    store(build(model, spec, lora), Path(spec.path))


def main() -> None:
    """The build process: one JSON line on stdout says how it went (the caller logs it)."""
    die_with_parent()
    spec = ProgramsSpec.from_json(sys.argv[1])
    os.nice(BUILD_NICENESS)  # the compilers it starts inherit it
    # What goes wrong is reported once, by the engine; not again here.
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    result: dict[str, object]
    try:
        build_in_process(spec)
    except Exception as error:
        result = {"error": failure_reason(error), "detail": traceback.format_exc()}
    else:
        result = {"seconds": time.perf_counter() - started}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    from engine import decode_programs  # the module proper, not this __main__ copy

    decode_programs.main()
