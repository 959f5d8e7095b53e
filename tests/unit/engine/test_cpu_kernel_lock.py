"""A kernel build that never finished (its process killed while holding torch's lock file) does
not hang the next engine start: the next load finds the leftover lock under its own flock,
removes it, says so and loads the kernels."""

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
    (build / "lock").touch()  # what torch leaves when its holder is killed
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
