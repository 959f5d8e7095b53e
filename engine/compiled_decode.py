"""Decode steps on the CPU as compiled programs: the CPU's counterpart of CUDA graphs
(engine.cuda_graphs), with torch.compile and inductor's C++ backend.

What compiles is the model's layers between attentions (projections, quantized linears, norms,
rotary embedding, SiLU-and-mul, residual adds): one program for one-row steps and one for any
larger batch (a third above the quantized kernels' row limit, where the linears change
kernel); attention stays the backend's own op (engine.attention.step), since it plans each step
from host-side lengths. The programs are built once and stored, then loaded by every later
engine with the same model, dtype, kernels, torch and CPU (engine.decode_programs).

When: at start-up (`--decode-compile startup`, the offline LLM's default: the engine is built
with its programs ready), or in the background (`background`, a served engine's default): the
engine serves eagerly at once while a thread loads the stored programs, or has a process of its
own build them, and decode steps switch to the programs between two steps once all are ready. A
step reads the programs once, so it runs wholly eagerly or wholly compiled; both give the same
greedy tokens for float32 weights, and over kernels that round activations to 8 bits (a GGUF's
int4) may part at a near-tie. An engine with LoRA slots (engine.layers.lora) has two sets: one
for steps whose rows use no adapter (the base model's program) and one for steps with adapters,
which reads the step's token slots and weights, persistent tensors updated in place (an adapter
loaded into a slot is seen by the next step's program). Compiling is a speed-up, never a
condition of serving: if it fails (no C++ compiler, an inductor error), at start-up, in the
background or in a later step, one warning says why and decode steps run eagerly from then on.
A step that only verifies speculative drafts (engine.spec_decode) runs its tokens as one-token
rows, each the decode of a context ending at itself, through the same programs and under the
same rules. Prefill and mixed steps run eagerly.

A row's bits do not depend on its company: the programs round every bfloat16 (float16) value
where eager decoding does (inductor's emulate_precision_casts, engine.decode_programs), so the
one-row and the several-row programs give a row the same hidden states (on the default model
eager decode steps did too), and greedy text is the same alone, beside other requests and with
speculative decoding (whose verification rows run the several-row program). Without it,
inductor rounded only at fused kernels' outputs and fused the one-row program otherwise. In
float32 the linears' own products (torch's) are not row-count invariant, so there this holds
only up to their rounding.

`--enforce-eager` turns all of this off. This module never builds a real step's inputs (the
model runner does) and is never used with a GPU, the Triton backend or tensor parallelism.
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from common.config import EngineConfig
from common.heap import freeze_loaded_heap
from common.parent_death import child_env
from engine.attention.metadata import AttentionMetadata
from engine.attention.step import running_step
from engine.attention.torch_backend import TorchAttentionBackend
from engine.decode_programs import (
    RESULT_PREFIX,
    ProgramsSpec,
    StaleProgramsError,
    build,
    build_lock,
    load,
    missing_compiler,
    program_sizes,
    store,
)
from engine.fallback import warn_fallback
from engine.layers.lora import LoraSlots
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SPEEDUP = "compiled decode steps"
FALLBACK = "running them eagerly"


class DecodeRunner(Protocol):
    """What compiling decode steps needs of the model runner: the model, where it runs, its
    dtype and its LoRA slots (None without)."""

    device: torch.device
    dtype: torch.dtype
    model: LlamaForCausalLM
    lora: LoraSlots | None


def give_up(error: BaseException | str) -> None:
    """Building, loading or running a program failed: drop what dynamo holds and say why, once;
    the caller runs decode steps eagerly from then on."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    # A failed build process's reason is already one line, its error's type included.
    warn_fallback(
        logger, SPEEDUP, FALLBACK, str(error) if isinstance(error, BuildFailed) else error
    )


class BuildFailed(Exception):
    """The build process failed; its message is the reason it gave, in one line."""


class CompiledDecode:
    @classmethod
    def start_if_enabled(
        cls, runner: DecodeRunner, config: EngineConfig, model_path: str | Path
    ) -> CompiledDecode | None:
        if config.enforce_eager or runner.device.type != "cpu":
            return None
        if not isinstance(runner.model.backend, TorchAttentionBackend):
            # The Triton kernels on a CPU are the interpreter's (tests): nothing to compile.
            return None
        try:
            return cls(runner, config, model_path)
        except Exception as error:  # an optional speed-up: see engine.fallback
            give_up(error)
            return None

    def __init__(self, runner: DecodeRunner, config: EngineConfig, model_path: str | Path) -> None:
        self.model = runner.model
        # With LoRA slots, two sets of programs: for steps with no adapter (the base model's
        # cost) and for steps with some, which read the persistent token slots and weights.
        self.lora = runner.lora
        lora = self.lora
        self.spec = ProgramsSpec.create(
            model_path,
            str(runner.dtype).removeprefix("torch."),
            config.quantization,
            config.attention_backend,
            torch.get_num_threads(),
            # A verification step stays within the quantized kernels' rows (the drafter cuts
            # its drafts there): past them only plain steps of more requests go.
            program_sizes(self.model, config.max_num_seqs),
            None if lora is None else (lora.max_loras, lora.max_rank, len(lora.step.slots)),
        )
        # Set once, when every program is ready: a step reads it once (the switch-over).
        self._programs: list[Any] | None = None
        # (Adapters in the step, batch size) -> the program that takes it (None: none does;
        # that step runs eagerly).
        self._by_rows: dict[tuple[bool, int], Any] = {}
        # How the programs came: "loaded" (stored before) or "compiled" (built now).
        self.origin: str | None = None
        # Decode steps run compiled, by batch size.
        self.rows_run: collections.Counter[int] = collections.Counter()
        # Of those, the steps with LoRA adapters in them, and those that verified drafts.
        self.adapter_steps_run = 0
        self.verify_steps_run = 0
        self.done = threading.Event()  # ready, or given up
        if config.decode_compile == "background":
            logger.info(
                "decode steps run eagerly until their compiled programs are ready (loaded or "
                "built in the background: %s)",
                self.spec.path,
            )
            threading.Thread(
                target=self._prepare_in_background, name="compiled-decode", daemon=True
            ).start()
        else:
            try:
                self._prepare(build_here=True)
            finally:
                self.done.set()

    @property
    def ready(self) -> bool:
        return self._programs is not None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        verify: bool = False,
    ) -> torch.Tensor | None:
        """The step's hidden states through its program; None while there are no programs
        yet, or none for this batch size (the caller runs the step eagerly). `meta` has one
        query token a row: a decode step's, or a verification step's as one-token rows
        (`verify`; engine.model_runner's prepare)."""
        programs = self._programs
        if programs is None:
            return None
        rows = len(input_ids)
        active = self.lora is not None and self.lora.step.active
        if (active, rows) not in self._by_rows:
            sizes = len(self.spec.sizes)
            variant = programs[sizes:] if active else programs[:sizes]
            self._by_rows[active, rows] = self._pick(variant, input_ids, positions)
        program = self._by_rows[active, rows]
        if program is None:
            return None
        backend = self.model.backend
        with (
            torch.inference_mode(),
            running_step(backend, meta, kv_caches),
            backend.bound_decode_step(meta, kv_caches),
        ):
            hidden = program(self.model, input_ids, positions)
        self.rows_run[rows] += 1
        self.adapter_steps_run += active
        self.verify_steps_run += verify
        return hidden

    def _pick(self, programs: list[Any], input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """The first program whose guards (sizes, dtypes, grad state) take these inputs. Checked
        outside inference mode (the step runs in it), under no_grad, as they were recorded:
        inference mode would hide the inputs' autograd dispatch keys from the check."""
        with torch.inference_mode(False), torch.no_grad():
            return next(
                (p for p in programs if p.guard_check(self.model, input_ids, positions)), None
            )

    def _prepare_in_background(self) -> None:
        try:
            self._prepare(build_here=False)
        except Exception as error:  # an optional speed-up: see engine.fallback
            give_up(error)
        finally:
            self.done.set()

    def _prepare(self, build_here: bool) -> None:
        """Load the stored programs, or build and store them (in this process, or in a process
        of its own so that a serving engine keeps its interpreter lock), then switch to them."""
        path = Path(self.spec.path)
        started = time.perf_counter()
        with build_lock(path):
            programs = self._load(path)
            if programs is not None:
                origin = "loaded"
            else:
                origin = "compiled"
                if reason := missing_compiler():
                    raise BuildFailed(reason)
                if build_here:
                    store(build(self.model, self.spec, self.lora), path)
                else:
                    self._build_in_child()
                # What was stored, loaded like any other time: one way to the programs.
                programs = load(path, self.spec.key)
                if programs is None:
                    raise BuildFailed(f"the build process stored nothing at {path}")
        for program in programs:
            program.disable_guard_check()  # checked once per batch size instead (_pick)
        self.origin = origin
        self._programs = programs
        if not build_here:  # loaded while serving: their graphs join what start-up froze
            freeze_loaded_heap(SPEEDUP, collect=False)
        logger.info(
            "%s (batches of %s rows) %s in %.1f s; stored in %s",
            SPEEDUP,
            ", ".join(map(str, self.spec.sizes)),
            origin,
            time.perf_counter() - started,
            path,
        )

    def _load(self, path: Path) -> list[Any] | None:
        try:
            return load(path, self.spec.key)
        except StaleProgramsError as changed:
            logger.info("stored %s were traced from sources changed since (%s)", SPEEDUP, changed)
        except Exception as error:  # corrupt or foreign: built again, over it
            warn_fallback(logger, f"stored {SPEEDUP}", "building them again", error)
        return None

    def _build_in_child(self) -> None:
        command = [sys.executable, "-m", "engine.decode_programs", self.spec.to_json()]
        finished = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),  # it dies with the engine
            check=False,
        )
        lines = [
            line.removeprefix(RESULT_PREFIX)
            for line in finished.stdout.splitlines()
            if line.startswith(RESULT_PREFIX)
        ]
        if not lines:
            raise BuildFailed(f"the build process exited with code {finished.returncode}")
        report = json.loads(lines[-1])
        if "error" in report:
            logger.debug("the build process failed:\n%s", report["detail"])
            raise BuildFailed(report["error"])
