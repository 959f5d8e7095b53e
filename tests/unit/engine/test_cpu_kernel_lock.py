"""A kernel build that never finished (its process killed while holding torch's lock file) does
not hang the next engine start: the next load finds the leftover lock under its own flock,
removes it, says so and loads the kernels. A whole build loads without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from engine.kernels.cpu import extension

LOAD = (
    "import logging, sys\n"
    "logging.basicConfig()\n"
    "from engine.kernels.cpu import extension\n"
    "sys.exit(0 if extension.load() else 1)\n"
)


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path):
    assert extension.load()  # built (or loaded) once in the shared kernel directory
    name = extension.build_dir().name
    build = tmp_path / name
    shutil.copytree(extension.kernel_dir() / name, build)  # modification times kept: no rebuild
    # What a build killed midway leaves: torch's lock file, and no mark of a whole library.
    (build / "lock").touch()
    (build / extension.BUILT).unlink()
    result = subprocess.run(
        [sys.executable, "-c", LOAD],
        env={**os.environ, extension.KERNEL_DIR_ENV: str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "left by a kernel build that did not finish" in result.stderr
    assert not (build / "lock").exists()
    assert (build / extension.BUILT).exists()


def test_built_kernels_load_without_torchs_build_machinery(tmp_path):
    """Once built, the kernels load from their library alone: torch's cpp_extension (setuptools
    with it) is never imported, and no compiler is needed."""
    assert extension.load()
    probe = LOAD.replace(
        "sys.exit(0 if extension.load() else 1)\n",
        "assert extension.load()\n"
        "import torch\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
        "assert torch.ops.folio_quant.int4_linear is not None\n",
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PATH": str(tmp_path)},  # no compiler to be found
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Folio's CPU kernels unavailable" not in result.stderr
