"""engine.core is torch-free: every module of it imports in a fresh interpreter without torch
coming along (import-linter's contract checks the import graph; this checks what really runs,
lazy imports included)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import engine.core


def core_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(engine.core.__path__, "engine.core.")]


def test_every_core_module_imports_without_torch():
    modules = core_modules()
    assert {"engine.core.scheduler", "engine.core.kv_cache_manager"} <= set(modules)
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
