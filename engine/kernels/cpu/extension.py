"""Loads Folio's AVX2 CPU kernels as one torch extension, compiled once per machine into the
Folio cache directory and reused after that: the weight-only quantized matmuls (cpu_quant.cpp,
ops torch.ops.folio_quant.int8_linear, grouped_int8_linear, int4_linear and parts_linear, a fused
layer's parts in different ones of those layouts), paged attention
(cpu_attention.cpp, torch.ops.folio_cpu_attention.paged_attention for any step,
paged_decode_attention for decode-only ones, and decode_step_attention for compiled decode
programs), and dense linears that compiled programs can call (cpu_linear.cpp:
torch.ops.folio_linear.packed_linear over oneDNN-packed weights; bf16_linear, AVX-512 BF16
products over Folio's own tiles, on CPUs that have those; widened_bf16_linear, float32
activations times the same tiles widened to float32 in registers, on any AVX2 CPU), and the
grouped LoRA product (cpu_lora.cpp: torch.ops.folio_lora.lora_add), and the mixture of
experts (cpu_moe.cpp, torch.ops.folio_moe: route and combine, the gather and weighted sum around
experts run one at a time; pack_experts and experts, a layer's gated-SiLU experts packed once
into panels and run stacked, every expert in one call, on AMX tiles where amx_usable says the
CPU and Linux allow them, on AVX-512 BF16 dot products for bfloat16 ones without AMX).

`load()` registers the ops and returns True, or False where they cannot run (a CPU without AVX2
and FMA, no C++ compiler to build them, a build error: one warning says which): callers then use
torch's own ops. FOLIO_KERNEL_DIR puts the build somewhere other than the cache directory (the
container image builds them into its own layer, where the cache volume does not hide them);
under it each build lies in a directory of its own named by a hash of the sources, their path,
the compiler flags and torch's version (build_dir), marked once its library is whole: a later
load then loads that library alone, with neither torch's build machinery nor a compiler. This
module never quantizes weights and never picks between kernels: engine.kernels.cpu.capabilities
says what loaded, engine.layers.linear and the torch attention backend choose.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from common.config import cache_dir
from engine.fallback import warn_fallback

# Folio's int4 layout (cpu_quant.cpp's kBlock and kStrip): groups of 32 input features, each with
# a scale and a minimum, and strips of 16 output channels.
INT4_GROUP_SIZE = 32
INT4_STRIP = 16

logger = logging.getLogger(__name__)

KERNEL_DIR_ENV = "FOLIO_KERNEL_DIR"
KERNELS = "Folio's CPU kernels"
NAME = "folio_cpu_kernels"
LIBRARY = f"{NAME}.so"
# Made in a build's directory once its library is whole: a later load needs nothing else.
BUILT = "folio.built"
TORCH_OPS = "using torch's ops"
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_quant.cpp",
        "cpu_attention.cpp",
        "cpu_linear.cpp",
        "cpu_lora.cpp",
        "cpu_moe.cpp",
    )
]
# The headers the sources include: part of what a build is made of.
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# Without OpenMP, at::parallel_for runs on the calling thread alone. The loader binds libgomp.so.1
# to the copy torch has loaded, so the pool is torch's own.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def kernel_dir() -> Path:
    return Path(os.environ.get(KERNEL_DIR_ENV) or cache_dir() / "torch_extensions")


@functools.cache
def load() -> bool:
    if not cpu_has_avx2():
        return False
    directory = build_dir()
    started = time.perf_counter()
    try:
        if (directory / BUILT).exists():
            # Built before: loaded as it is, without torch's build machinery (importing it takes
            # most of a second of an engine's start) and without a compiler.
            torch.ops.load_library(directory / LIBRARY)
        elif not build(directory):
            return False
    except Exception as error:  # an optional speed-up: see engine.fallback
        warn_fallback(logger, KERNELS, TORCH_OPS, error)
        return False
    logger.info("Folio's CPU kernels ready in %.1f s", time.perf_counter() - started)
    _register_output_shapes()
    return True


def build(directory: Path) -> bool:
    """Build the kernels into `directory` (or load them, if another process built them
    meanwhile) and mark them built; False, with one warning, where there is no compiler."""
    compiler = cxx_compiler()
    if shutil.which(compiler) is None:
        # Said before trying: torch's own attempt prints pages of warnings first.
        reason = f"no C++ compiler: {compiler!r} is not on PATH (install one or set CXX)"
        warn_fallback(logger, KERNELS, TORCH_OPS, reason)
        return False
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with builder_lock(directory):
        cpp_extension.load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            # Lists of their own: torch appends its libraries to the flags it is given.
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        (directory / BUILT).touch()  # only once the library is whole
    return True


def cxx_compiler() -> str:
    """The compiler torch's cpp_extension builds with on Linux (its get_cxx_compiler's rule),
    without importing it."""
    return os.environ.get("CXX", "c++")


def build_dir() -> Path:
    """Where the kernels of these sources are built: a directory named by build_hash(): a
    checkout never rebuilds over another's binary, nor a change of the sources over the last
    one's."""
    return kernel_dir() / f"cpu_kernels-{build_hash()}"


@functools.cache
def build_hash() -> str:
    """A hash of everything the binary is made of (the sources' and headers' bytes, the
    compiler and its flags, torch's version) and of where the sources lie, which torch's build
    commands name; read once, so that it names the kernels this process loads even when the
    sources change while it runs (compiled decode programs are keyed by it)."""
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(f"{path}\0".encode())
        digest.update(path.read_bytes())
    digest.update("\0".join([cxx_compiler(), *CFLAGS, *LDFLAGS, torch.__version__]).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def builder_lock(directory: Path) -> Iterator[None]:
    """One Folio process at a time loads (and if need be builds) the kernels of `directory`.

    torch's own guard is a lock file it creates and deletes: a process killed while holding it
    (a SIGKILLed engine, a container stopped mid-build) leaves the file behind, and every later
    load waits on it forever. An flock is released by the kernel with its holder, so whoever
    holds this one knows nobody else is building, and a torch lock file found then is such a
    leftover."""
    with open(directory / "folio.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _register_output_shapes() -> None:
    """What torch.compile traces the ops with: [rows, out features] of the activations' dtype,
    and attention's output shaped like its query."""

    def int8_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0] * (INT4_STRIP if codes.dim() == 3 else 1))

    def grouped_int8_shape(
        x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:  # row-major [N, K], or strips of 16 output channels
        return x.new_empty(x.shape[0], codes.shape[0] * (INT4_STRIP if codes.dim() == 3 else 1))

    def grouped_int8_lookup_shape(
        ids: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        in_features = codes.shape[1] * (INT4_GROUP_SIZE if codes.dim() == 3 else 1)
        return ids.new_empty(*ids.shape, in_features, dtype=torch.float32)

    def int4_shape(
        x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0] * INT4_STRIP)

    def parts_linear_shape(
        x: torch.Tensor,
        codes: list[torch.Tensor],
        scales: list[torch.Tensor],
        minimums: list[torch.Tensor | None],
    ) -> torch.Tensor:
        widths = [part.shape[0] * (INT4_STRIP if part.dim() == 3 else 1) for part in codes]
        return x.new_empty(x.shape[0], sum(widths))

    def int4_dequantize_shape(
        codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return codes.new_empty(
            codes.shape[0] * INT4_STRIP, codes.shape[1] * INT4_GROUP_SIZE, dtype=dtype
        )

    def packed_linear_shape(
        x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], packed.shape[0])

    def bf16_linear_shape(
        x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], out_features)

    def attention_shape(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def lora_add_shape(
        y: torch.Tensor,
        x: torch.Tensor,
        slots: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        shard_outputs: list[int],
        isa: int,
    ) -> torch.Tensor:
        return torch.empty_like(y)

    torch.library.register_fake("folio_quant::int8_linear")(int8_shape)
    torch.library.register_fake("folio_quant::int4_linear")(int4_shape)
    torch.library.register_fake("folio_quant::grouped_int8_linear")(grouped_int8_shape)
    torch.library.register_fake("folio_quant::grouped_int8_lookup")(grouped_int8_lookup_shape)
    torch.library.register_fake("folio_quant::parts_linear")(parts_linear_shape)
    torch.library.register_fake("folio_quant::int4_dequantize")(int4_dequantize_shape)
    torch.library.register_fake("folio_cpu_attention::decode_step_attention")(attention_shape)
    torch.library.register_fake("folio_linear::packed_linear")(packed_linear_shape)
    torch.library.register_fake("folio_linear::bf16_linear")(bf16_linear_shape)
    torch.library.register_fake("folio_linear::widened_bf16_linear")(bf16_linear_shape)
    torch.library.register_fake("folio_lora::lora_add")(lora_add_shape)
