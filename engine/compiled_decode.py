"""Decode steps on the CPU as compiled programs: the CPU's counterpart of CUDA graphs
(engine.cuda_graphs), with torch.compile and inductor's C++ backend.

What compiles is the model's layers between attentions (projections, quantized linears, norms,
rotary embedding, SiLU-and-mul, residual adds): one program for one-row steps and one for any
larger batch (a third above the quantized kernels' row limit, where the linears change
kernel); attention stays the backend's own op (engine.attention.step), since it plans each step
from host-side lengths. Every program is compiled at start-up by warm-up steps, before any
request, so no request waits on the compiler; inductor's caches live under the Folio cache
directory, so a restart loads them instead of compiling again. Compiling is a speed-up, never a
condition of serving: if it fails (no C++ compiler, an inductor error), at start-up or in a later
step, one warning says why and decode steps run eagerly from then on. Prefill and mixed steps run
eagerly. `--enforce-eager` turns all of this off. This module never builds a real step's
inputs (the model runner does) and is never used with a GPU, the Triton backend or tensor
parallelism.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import torch

from common.config import EngineConfig, cache_dir
from engine.attention.metadata import AttentionMetadata
from engine.attention.step import running_step
from engine.attention.torch_backend import TorchAttentionBackend
from engine.fallback import warn_fallback
from engine.layers.linear import Linear
from engine.layers.quantization import QuantizedWeight
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def inductor_cache_dir() -> str:
    return str(cache_dir() / "inductor")


class DecodeRunner(Protocol):
    """What compiling decode steps needs of the model runner: the model, where it runs, its KV
    caches and placeholder decode inputs for the warm-up steps."""

    device: torch.device
    model: LlamaForCausalLM
    kv_caches: list[torch.Tensor]

    def placeholder_decode(
        self, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]: ...


def give_up(error: Exception) -> None:
    """Compiling or running a program failed: drop what dynamo holds and say why, once; the
    caller runs decode steps eagerly from then on."""
    torch._dynamo.reset()
    warn_fallback(logger, "compiled decode steps", "running them eagerly", error)


class CompiledDecode:
    @classmethod
    def compile_if_enabled(
        cls, runner: DecodeRunner, config: EngineConfig
    ) -> CompiledDecode | None:
        if config.enforce_eager or runner.device.type != "cpu":
            return None
        if not isinstance(runner.model.backend, TorchAttentionBackend):
            # The Triton kernels on a CPU are the interpreter's (tests): nothing to compile.
            return None
        try:
            return cls(runner, config)
        except Exception as error:  # an optional speed-up: see engine.fallback
            give_up(error)
            return None

    def __init__(self, runner: DecodeRunner, config: EngineConfig) -> None:
        # Read by inductor whenever it looks up or stores compiled code. Set, not defaulted:
        # torch fills in its own /tmp default the first time it asks.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
        self.model = runner.model
        self._forward = torch.compile(
            self.model.hidden_states,
            options={
                # The weights never change once loaded, and guarding the model's ~300
                # parameters costs Python time every step (docs/compiled-decode.md has the
                # figure). The inputs' guards (their sizes pick the program) stay.
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                # Checks of every intermediate's size and alignment, ~600 Python calls a step,
                # on shapes inductor derived itself.
                "size_asserts": False,
                "alignment_asserts": False,
                # The program's own calls (~300 a step: kernels, the linears, attention) from
                # C++ instead of Python. Its wrapper compiles apart from the kernels, at -O1
                # (glue code), which keeps a cold compile short (docs/compiled-decode.md).
                "cpp_wrapper": True,
                "cpp_wrapper_build_separate": True,
            },
        )
        started = time.perf_counter()
        # Two rows first, marked dynamic, so that the program for 2+ rows covers every size;
        # one row is its own program (torch specializes sizes of 1).
        sizes = [2, 1]
        quantized = next(
            (
                m.packed
                for m in self.model.modules()
                if isinstance(m, Linear) and isinstance(m.packed, QuantizedWeight)
            ),
            None,
        )
        if quantized is not None and quantized.max_kernel_rows < config.max_num_seqs:
            sizes.append(quantized.max_kernel_rows + 1)
        for rows in sizes:
            self._warm_up(runner, rows, dynamic=rows == 2)
        logger.info(
            "compiled decode steps (batches of %s rows) in %.1f s; inductor cache %s",
            ", ".join(map(str, sizes)),
            time.perf_counter() - started,
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        backend = self.model.backend
        with (
            torch.inference_mode(),
            running_step(backend, meta, kv_caches),
            backend.bound_decode_step(meta, kv_caches),
        ):
            return self._forward(input_ids, positions)

    def _warm_up(self, runner: DecodeRunner, rows: int, dynamic: bool) -> None:
        input_ids, positions, meta = runner.placeholder_decode(rows)
        if dynamic:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        self(input_ids, positions, runner.kv_caches, meta)
