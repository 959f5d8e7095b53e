"""Loads the AVX2 weight-only quantized matmul kernels (cpu_quant.cpp) as a torch extension,
compiled once per machine into the Folio cache directory and reused after that.

`load()` registers the ops torch.ops.folio_quant.int8_linear and int4_linear and returns that
namespace, or None where they cannot run (a CPU without AVX2 and FMA, no C++ compiler): callers
then use torch's own weight-only kernels. It never quantizes weights
and never picks between kernels (engine.models.quantization does).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from common.config import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.cpp")


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> Any:
    if not cpu_has_avx2():
        return None
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "torch_extensions" / f"cpu_quant-torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        cpp_extension.load(
            name="folio_cpu_quant",
            sources=[str(SOURCE)],
            # Without OpenMP, at::parallel_for runs on the calling thread alone. The loader
            # binds libgomp.so.1 to the copy torch has loaded, so the pool is torch's own.
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("quantized CPU kernels unavailable (%s); using torch's", error)
        return None
    logger.info("quantized CPU kernels ready in %.1f s", time.perf_counter() - started)
    _register_output_shapes()
    return torch.ops.folio_quant


def _register_output_shapes() -> None:
    """What torch.compile traces the ops with: [rows, out features] of the activations' dtype."""

    def int8_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])

    def int4_shape(
        x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])

    torch.library.register_fake("folio_quant::int8_linear")(int8_shape)
    torch.library.register_fake("folio_quant::int4_linear")(int4_shape)
